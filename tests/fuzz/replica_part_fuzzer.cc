// libFuzzer target: a ReplicaPart arrives from a peer (a replica push, a parity share, a rebuild's
// read), so its bytes are untrusted, and ReceivedPart::Read parses the common encoding by hand
// (daemon/replica/replica_wire.h) before falling back on protobuf. The input is split into up to
// three gRPC slices at input-chosen points (a message arrives in slices of any size).
// Properties: Read never crashes; it accepts exactly what protobuf's own parser accepts, and reads
// the same part: header or data, the data's bytes (in place or not) and the checksum.
#include <grpc/grpc.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/grpc_library.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "daemon/replica/replica_wire.h"
#include "fuzz_check.h"
#include "replica.pb.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  static grpc::internal::GrpcLibraryInitializer initializer;
  initializer.summon();
  grpc_init();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace flashckpt;
  if (size == 0) return 0;
  // The first byte: how many cuts (0-2) and where, as fractions of the message.
  const uint8_t shape = data[0];
  const std::string message(reinterpret_cast<const char*>(data + 1), size - 1);
  std::vector<size_t> cuts;
  for (int i = 0; i < (shape & 3) % 3; ++i) cuts.push_back(message.size() * ((shape >> (2 + 3 * i)) & 7) / 7);
  cuts.push_back(message.size());
  std::sort(cuts.begin(), cuts.end());
  std::vector<grpc::Slice> slices;
  size_t from = 0;
  for (size_t cut : cuts) {
    slices.emplace_back(message.data() + from, cut - from);
    from = cut;
  }
  grpc::ByteBuffer buffer(slices.data(), slices.size());

  ReceivedPart part;
  const Status read = part.Read(&buffer);
  v1::ReplicaPart expected;
  const bool parsed = expected.ParseFromString(message);
  FUZZ_CHECK(read.ok() == parsed);
  if (!parsed) return 0;
  FUZZ_CHECK(part.has_header() == expected.has_header());
  FUZZ_CHECK(part.xxh3() == expected.xxh3());
  std::string bytes;
  for (const ByteSpan& span : part.data()) bytes.append(span.data, span.size);
  FUZZ_CHECK(bytes.size() == part.data_bytes());
  FUZZ_CHECK(bytes == (expected.part_case() == v1::ReplicaPart::kData ? expected.data() : std::string()));
  return 0;
}
