// A parity group member as its daemon serves it, for parity_bench and parity_test: its replica and
// parity stores (without a memory bound), its parity service over a replica listener on 127.0.0.1,
// and a plain channel to that listener. Where a member's own memory checkpoints come from (what
// FetchBlock serves) is the caller's `own`.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/base/status.h"
#include "daemon/parity/parity_group.h"
#include "daemon/parity/parity_service.h"
#include "daemon/parity/parity_store.h"
#include "daemon/replica/replica_client.h"
#include "daemon/replica/replica_server.h"

namespace flashckpt::bench {

// Host memory that admits everything.
inline HostMemory UnboundedMemory() {
  return HostMemory{[](uint64_t, const std::string&) { return Status::OK(); }, [](uint64_t) {}};
}

struct ParityMember {
  // `allow` and `hosts`: the service's allowed names and members' hosts, for a listener with TLS.
  // `stall`: how long the service lets a push send nothing.
  ParityMember(const ParityGroup& group, uint32_t index, OwnImageSource own, std::vector<std::string> allow = {},
               std::vector<std::string> hosts = {}, std::chrono::milliseconds stall = kReplicaStallTimeout)
      : parity(group, index, UnboundedMemory()),
        service(&parity, std::move(allow), std::move(hosts), std::move(own), stall) {}

  // Listens on 127.0.0.1 (`config` gives the TLS files and names); `channel` is a plain one, for a
  // listener without TLS.
  Status Start(ReplicaListenConfig config = {}) {
    config.listen = "127.0.0.1:0";
    server = std::make_unique<ReplicaServer>(&replicas, config);
    server->AddService(&service);
    RETURN_IF_ERROR(server->Start());
    ASSIGN_OR_RETURN(channel, ReplicaChannel({"127.0.0.1:" + std::to_string(server->port()), "", "", "", ""}));
    return Status::OK();
  }

  ReplicaStore replicas{UnboundedMemory(), 0};
  ParityStore parity;
  ParityService service;
  std::unique_ptr<ReplicaServer> server;
  std::shared_ptr<grpc::Channel> channel;
};

}  // namespace flashckpt::bench
