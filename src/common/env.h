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

// Declares `const std::string& function()` returning the cached text of environment variable `name`
// ("" when unset), for knobs whose value is checked where it is used (with an error naming it).
#define ODC_ENV_TEXT(function, name)                   \
  inline const std::string& function() {               \
    static const std::string cached_text = [] {        \
      const char* text = std::getenv(name);            \
      return std::string(text != nullptr ? text : ""); \
    }();                                               \
    return cached_text;                                \
  }

// Declares `double function()` returning the cached value of environment variable `name`.
#define ODC_ENV_DOUBLE(function, name, fallback)                          \
  inline double function() {                                              \
    static const double cached_value = ::odc::env_double(name, fallback); \
    return cached_value;                                                  \
  }
