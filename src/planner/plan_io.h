// Text inputs of the planner: length files and the "A,B,C" / "S0,S1,..." option strings.
// Every parse error names the source and the offending text.
#pragma once

#include <cstdint>
#include <istream>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "planner/cost_model.h"

namespace odc::planner {

// Longest line read_lengths() accepts (a length needs 20 bytes; comments get room to spare).
inline constexpr size_t kMaxLineBytes = 65536;

// `text` in single quotes for an error message: control and non-ASCII bytes as \xNN, a backslash
// doubled, at most 64 bytes shown (then the total length), so a message stays one readable line.
std::string quote_text(std::string_view text);

// `value` as error messages show a number the user gave (shortest stream form: 0.3, 1e-09).
std::string number_text(double value);

// One positive integer per line; blank lines and lines starting with '#' are skipped. `source`
// names the input in messages. A line longer than kMaxLineBytes, or more than kMaxSamples lengths,
// is an error (a stream such as /dev/zero fails at once instead of growing without bound).
Result<std::vector<int64_t>> read_lengths(std::istream& input, const std::string& source);

// `path` "-" reads standard input.
Result<std::vector<int64_t>> read_lengths_file(const std::string& path);

// "A,B,C": three finite numbers (their signs are checked with the other plan inputs).
Result<CostModel> parse_cost(const std::string& text);

// "S0,S1,...": finite numbers (positivity and count are checked with the other plan inputs).
Result<std::vector<double>> parse_rank_speed(const std::string& text);

}  // namespace odc::planner
