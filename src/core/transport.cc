// Names of collectives, for error messages.
#include "core/transport.h"

namespace odc {

const char* collective_op_name(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kInit:
      return "init";
    case CollectiveOp::kExchange:
      return "exchange";
    case CollectiveOp::kAllocate:
      return "alloc";
    case CollectiveOp::kRelease:
      return "free";
    case CollectiveOp::kMinibatchBegin:
      return "minibatch_begin";
    case CollectiveOp::kMinibatchEnd:
      return "minibatch_end";
    case CollectiveOp::kMinibatchApplied:
      return "minibatch_end (apply)";
    case CollectiveOp::kBarrier:
      return "barrier";
  }
  return "unknown collective";
}

}  // namespace odc
