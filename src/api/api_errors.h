// Glue between internal Status values and the C API's result codes and last-error text.
#pragma once

#include <cstring>

#include "common/status.h"
#include "odc/odc.h"

namespace odc::api {

// The integer value of a C enum received from a caller, read without assuming it is one of the
// enumerators (a C caller may pass any int; loading it as the enum type would be undefined).
template <typename Enum>
int raw_enum_value(const Enum& value) {
  static_assert(sizeof(Enum) == sizeof(int), "C enums are int-sized");
  int raw;
  std::memcpy(&raw, &value, sizeof(raw));
  return raw;
}

// Records `status` as the calling thread's last error and returns its result code.
odcResult_t report(const Status& status);

// Clears the last error and returns odcSuccess.
odcResult_t success();

// Runs `body` (returning odcResult_t), turning escaped C++ exceptions into result codes: no
// exception ever crosses the C boundary.
template <typename Body>
odcResult_t guarded(Body&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return report(Status::SystemError("out of host memory"));
  } catch (const std::exception& error) {
    return report(Status::InternalError(std::string("unexpected exception: ") + error.what()));
  } catch (...) {
    return report(Status::InternalError("unexpected non-standard exception"));
  }
}

}  // namespace odc::api
