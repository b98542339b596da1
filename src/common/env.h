// The parsers of the knobs that count ranks or bytes. The variables themselves are read in one
// place, core/comm_config.cc (docs/env.md lists them all).
#pragma once

#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

namespace odc {

// `text` as a count of at most `max`: ASCII digits only (leading zeros allowed: "00" is 0), with
// `size_suffix` optionally followed by one K, M or G for KiB, MiB, GiB; nullopt when it is not
// one (empty, a sign, spaces, another suffix, or above `max`). The one parser of the knobs that
// count ranks or bytes, so that they all read a number the same way.
inline std::optional<uint64_t> parse_count(const std::string& text, uint64_t max,
                                           bool size_suffix = false) {
  if (text.empty() || !std::isdigit(static_cast<unsigned char>(text[0]))) return std::nullopt;
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
        return std::nullopt;
    }
    ++end;
  }
  if (*end != '\0' || errno == ERANGE || value > (max >> shift)) return std::nullopt;
  return static_cast<uint64_t>(value) << shift;
}

// `text` as a positive integer of at most `max` (parse_count's syntax), or 0 when it is not one
// or is zero: knobs that count ranks or bytes and must be positive, refused by their callers with
// a message naming them.
inline uint64_t positive_integer(const std::string& text, uint64_t max, bool size_suffix = false) {
  return parse_count(text, max, size_suffix).value_or(0);
}

}  // namespace odc
