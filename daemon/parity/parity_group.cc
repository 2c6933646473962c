#include "daemon/parity/parity_group.h"

#include <algorithm>

#include "common/io/net.h"

namespace flashckpt {

Result<ParityGroup> ParityGroup::Make(uint32_t members, uint32_t parity) {
  if (members < 2 || members > 255) {
    return InvalidArgument("a parity group has 2 to 255 members (--ec-group), not " + std::to_string(members));
  }
  if (parity < 1 || parity >= members) {
    return InvalidArgument("--ec-parity must be at least 1 and less than the group's " + std::to_string(members) +
                           " members, not " + std::to_string(parity));
  }
  return ParityGroup(members, parity);
}

std::optional<uint32_t> ParityGroup::RowOf(uint32_t stripe, uint32_t member) const {
  uint32_t row = (member + members_ - stripe % members_) % members_;
  if (row >= parity_) return std::nullopt;
  return row;
}

std::optional<uint32_t> ParityGroup::DataIndexOf(uint32_t stripe, uint32_t member) const {
  uint32_t from_first = (member + members_ - stripe % members_) % members_;
  if (from_first < parity_) return std::nullopt;
  return from_first - parity_;
}

std::optional<uint32_t> ParityGroup::BlockOfStripe(uint32_t member, uint32_t stripe) const {
  uint32_t block = (stripe + 2 * members_ - member % members_ - 1) % members_;
  if (block >= data_blocks()) return std::nullopt;
  return block;
}

uint64_t ParityGroup::BlockBytes(uint64_t image_bytes) const {
  return image_bytes / data_blocks() + (image_bytes % data_blocks() != 0 ? 1 : 0);
}

ParityGroup::Range ParityGroup::Block(uint64_t image_bytes, uint32_t block) const {
  uint64_t each = BlockBytes(image_bytes);
  uint64_t offset = std::min(image_bytes, each * block);
  return {offset, std::min(each, image_bytes - offset)};
}

std::string ParityGroup::ToString() const {
  return std::to_string(members_) + " members, " + std::to_string(parity_) + " parity";
}

Result<ParityGroupConfig> ParseParityGroup(const std::vector<std::string>& members, uint32_t parity,
                                           const std::string& replica_listen, bool tls) {
  if (replica_listen.empty()) {
    return InvalidArgument("--ec-group needs --replica-listen: the members push and fetch parity on the replica "
                           "listener, and this daemon's place in the group is its --replica-listen address");
  }
  ASSIGN_OR_RETURN(ListenAddress own, ParseListenAddress(replica_listen, "--replica-listen"));
  if (own.port == 0) {
    return InvalidArgument("--ec-group needs a fixed --replica-listen port: the other members reach this daemon there");
  }
  ASSIGN_OR_RETURN(ParityGroup group, ParityGroup::Make(static_cast<uint32_t>(std::min<size_t>(members.size(), 256)),
                                                        parity));
  std::vector<std::string> targets;
  std::vector<std::string> hosts;
  std::optional<uint32_t> self;
  std::vector<std::pair<uint32_t, std::string>> others;
  for (uint32_t i = 0; i < members.size(); ++i) {
    ASSIGN_OR_RETURN(ListenAddress member, ParseListenAddress(members[i], "--ec-group"));
    if (std::find(targets.begin(), targets.end(), member.Target()) != targets.end()) {
      return InvalidArgument("--ec-group gives " + member.Target() + " twice");
    }
    targets.push_back(member.Target());
    hosts.push_back(member.host);
    if (!tls && !member.loopback) {
      return InvalidArgument("--ec-group " + member.Target() + " is not a loopback address: between nodes the replica "
                             "channel needs mutual TLS (--replica-tls-cert, --replica-tls-key, --replica-tls-ca)");
    }
    if (member.Target() == own.Target()) {
      self = i;
    } else {
      others.emplace_back(i, member.Target());
    }
  }
  if (!self) {
    return InvalidArgument("--ec-group does not list this daemon's --replica-listen " + own.Target() +
                           ": every member gives the same list, its own address included");
  }
  return ParityGroupConfig{group, *self, std::move(others), std::move(hosts)};
}

}  // namespace flashckpt
