// Check macros for external calls: a failing syscall becomes a SystemError Status carrying the
// call, errno text and file:line. The library never exits or aborts on such a failure.
#pragma once

#include <cerrno>
#include <cstring>
#include <string>

#include "common/status.h"

namespace odc {

inline Status errno_status(const char* what, const char* file, int line) {
  const int saved = errno;
  return Status::SystemError(std::string(what) + " failed: " + std::strerror(saved) + " (" + file +
                             ":" + std::to_string(line) + ")");
}

}  // namespace odc

// Evaluates `expr` (a syscall returning -1 on failure) and returns a SystemError from the
// enclosing function when it fails.
#define ODC_SYSCHECK(expr, what)                                            \
  do {                                                                      \
    if ((expr) == -1) return ::odc::errno_status(what, __FILE__, __LINE__); \
  } while (0)
