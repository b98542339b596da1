// Text inputs of the planner: length files and the "A,B,C" / "S0,S1,..." option strings.
// Every parse error names the source and the offending text.
#pragma once

#include <cstdint>
#include <istream>
#include <string>
#include <vector>

#include "common/status.h"
#include "planner/cost_model.h"

namespace odc::planner {

// One positive integer per line; blank lines and lines starting with '#' are skipped. `source`
// names the input in messages.
Result<std::vector<int64_t>> read_lengths(std::istream& input, const std::string& source);

// `path` "-" reads standard input.
Result<std::vector<int64_t>> read_lengths_file(const std::string& path);

// "A,B,C": three finite numbers (their signs are checked with the other plan inputs).
Result<CostModel> parse_cost(const std::string& text);

// "S0,S1,...": finite numbers (positivity and count are checked with the other plan inputs).
Result<std::vector<double>> parse_rank_speed(const std::string& text);

}  // namespace odc::planner
