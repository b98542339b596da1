// Environment knobs. Each is declared where it is used with ODC_ENV_DOUBLE, read once and cached;
// docs/env.md lists them all.
#pragma once

#include <cstdlib>
#include <string>

namespace odc {

// The value of `name` as a double, or `fallback` when unset or not a number.
inline double env_double(const char* name, double fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const double value = std::strtod(text, &end);
  return (end != nullptr && *end == '\0') ? value : fallback;
}

}  // namespace odc

// Declares `double function()` returning the cached value of environment variable `name`.
#define ODC_ENV_DOUBLE(function, name, fallback)                          \
  inline double function() {                                              \
    static const double cached_value = ::odc::env_double(name, fallback); \
    return cached_value;                                                  \
  }
