// Thread-local last-error text, as in NCCL's ncclGetLastError.
#include "api/api_errors.h"

#include <string>

namespace odc::api {
namespace {

thread_local std::string last_error;

odcResult_t to_result(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return odcSuccess;
    case StatusCode::kInvalidArgument:
      return odcInvalidArgument;
    case StatusCode::kSystemError:
      return odcSystemError;
    case StatusCode::kInternalError:
      return odcInternalError;
    case StatusCode::kInvalidUsage:
      return odcInvalidUsage;
    case StatusCode::kTimeout:
      return odcTimeout;
    case StatusCode::kRemoteError:
      return odcRemoteError;
    case StatusCode::kInterrupted:
      return odcInterrupted;
  }
  return odcInternalError;
}

}  // namespace

odcResult_t report(const Status& status) {
  last_error = status.message();
  return to_result(status.code());
}

odcResult_t success() {
  last_error.clear();
  return odcSuccess;
}

}  // namespace odc::api

extern "C" const char* odcGetErrorString(odcResult_t result) {
  switch (result) {
    case odcSuccess:
      return "success";
    case odcInvalidArgument:
      return "invalid argument";
    case odcSystemError:
      return "system error";
    case odcInternalError:
      return "internal error";
    case odcInvalidUsage:
      return "invalid usage";
    case odcTimeout:
      return "timeout";
    case odcRemoteError:
      return "remote error";
    case odcInterrupted:
      return "interrupted";
    case odcNumResults:
      break;
  }
  return "unknown result code";
}

extern "C" const char* odcGetLastError(void) {
  return odc::api::last_error.c_str();
}

extern "C" int odcGetVersion(void) {
  return ODC_VERSION_MAJOR * 10000 + ODC_VERSION_MINOR * 100 + ODC_VERSION_PATCH;
}
