// Timeouts as callers give them (seconds, a double) turned into deadlines without overflow.
// An infinite timeout means "wait forever"; finite ones beyond kLongestTimeout are clamped to it
// (a converted time point must not wrap: `now + inf` as a clock duration is undefined).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>

namespace odc {

// 100 years: longer than any job, short enough that now + it fits every clock used here.
inline constexpr double kLongestTimeoutSeconds = 100.0 * 365 * 24 * 3600;

inline bool waits_forever(std::chrono::duration<double> timeout) {
  return std::isinf(timeout.count()) && timeout.count() > 0;
}

// `timeout` from now on the steady clock; the clock's maximum for "forever".
inline std::chrono::steady_clock::time_point deadline_after(std::chrono::duration<double> timeout) {
  using Clock = std::chrono::steady_clock;
  if (waits_forever(timeout)) return Clock::time_point::max();
  const double seconds = std::min(timeout.count(), kLongestTimeoutSeconds);
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// The same for device-side waits, which count nanoseconds in an int64 (INT64_MAX: forever).
inline int64_t timeout_nanoseconds(std::chrono::duration<double> timeout) {
  if (waits_forever(timeout)) return INT64_MAX;
  return static_cast<int64_t>(std::min(timeout.count(), kLongestTimeoutSeconds) * 1e9);
}

// "2.5 s" or "no timeout", for messages.
inline std::string timeout_text(std::chrono::duration<double> timeout) {
  if (waits_forever(timeout)) return "no timeout";
  std::ostringstream out;
  out << timeout.count() << " s";
  return out.str();
}

}  // namespace odc
