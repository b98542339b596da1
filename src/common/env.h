// Environment knobs. Each is declared where it is used with ODC_ENV_DOUBLE, read once and cached;
// docs/env.md lists them all.
#pragma once

#include <cctype>
#include <cerrno>
#include <cstdint>
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

// `text` as a positive integer of at most `max` (digits only; with `size_suffix`, optionally
// followed by K, M or G for KiB, MiB, GiB), or 0 when it is not one: knobs that count ranks or
// bytes, refused by their callers with a message naming them.
inline uint64_t positive_integer(const std::string& text, uint64_t max, bool size_suffix = false) {
  if (text.empty() || !std::isdigit(static_cast<unsigned char>(text[0]))) return 0;
  char* end = nullptr;
  errno = 0;
  const unsigned long long value = std::strtoull(text.c_str(), &end, 10);
  int shift = 0;
  if (size_suffix && *end != '\0' && end[1] == '\0') {
    switch (std::toupper(static_cast<unsigned char>(*end))) {
      case 'K':
        shift = 10;
        break;
      case 'M':
        shift = 20;
        break;
      case 'G':
        shift = 30;
        break;
      default:
        return 0;
    }
    ++end;
  }
  if (*end != '\0' || errno == ERANGE || value == 0 || value > (max >> shift)) return 0;
  return static_cast<uint64_t>(value) << shift;
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
