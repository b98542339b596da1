// Node-aggregated pushes: routes and the forward of relay rows (see node_relay.h).
#include "core/node_relay.h"

#include <algorithm>
#include <string>

namespace odc {

NodeRelay::Route NodeRelay::route(uint64_t buffer_id, int owner, size_t count) const {
  const auto o = static_cast<size_t>(owner);
  const int via = routes_.via[o];
  const bool relayed = std::any_of(relays_.begin(), relays_.end(),
                                   [&](const Relay& r) { return r.buffer_id == buffer_id; });
  // On this node (via is the owner itself), or an accumulator the budget had no room for.
  if (!relayed || via == owner) return {owner, buffer_id, 0};
  return {via, buffer_id | kRelayTargetBit, routes_.row[o] * count};
}

Status NodeRelay::forward_rows(uint64_t minibatch, const SendRow& send_row) {
  // Set before the first send: no chunk for the rows may arrive from here on (this node's ranks
  // all ended here), also while a send below waits for credit and folds meanwhile.
  forwarded_minibatch_ = minibatch;
  for (const Relay& relay : relays_) {
    for (size_t row = 0; row < routes_.my_owners.size(); ++row) {
      ODC_RETURN_IF_ERROR(send_row(routes_.my_owners[row], relay.buffer_id,
                                   relay.rows + row * relay.count, relay.count));
    }
  }
  return Status::Ok();
}

Status NodeRelay::check_fold(uint64_t target_id, uint64_t minibatch) const {
  if ((target_id & kRelayTargetBit) == 0 || minibatch != forwarded_minibatch_) return Status::Ok();
  return Status::InternalError(
      "a chunk for the relay rows of accumulator " + std::to_string(target_id & ~kRelayTargetBit) +
      " arrived after they were forwarded in minibatch " + std::to_string(minibatch) +
      "'s minibatch_end (its node's ranks had all ended there): it would never reach its owner");
}

}  // namespace odc
