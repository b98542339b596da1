// Parsing of planner inputs. Strict: "12abc", "1e3" and "+5" are not lengths.
#include "planner/plan_io.h"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>

namespace odc::planner {
namespace {

std::string trim(const std::string& text) {
  const char* space = " \t\r\n";
  const size_t begin = text.find_first_not_of(space);
  if (begin == std::string::npos) return "";
  return text.substr(begin, text.find_last_not_of(space) - begin + 1);
}

// Parses a whole string as a finite double.
bool parse_double(const std::string& text, double& value) {
  const std::string item = trim(text);
  if (item.empty()) return false;
  char* end = nullptr;
  errno = 0;
  value = std::strtod(item.c_str(), &end);
  return errno == 0 && end == item.c_str() + item.size() && std::isfinite(value);
}

bool parse_double_list(const std::string& text, std::vector<double>& values) {
  std::stringstream stream(text);
  std::string item;
  values.clear();
  while (std::getline(stream, item, ',')) {
    double value = 0.0;
    if (!parse_double(item, value)) return false;
    values.push_back(value);
  }
  // getline drops a trailing empty field: "1,2," must still fail.
  return !text.empty() && text.back() != ',';
}

}  // namespace

Result<std::vector<int64_t>> read_lengths(std::istream& input, const std::string& source) {
  std::vector<int64_t> lengths;
  std::string line;
  int64_t line_number = 0;
  while (std::getline(input, line)) {
    ++line_number;
    const std::string item = trim(line);
    if (item.empty() || item.front() == '#') continue;
    int64_t value = 0;
    const auto [end, error] = std::from_chars(item.data(), item.data() + item.size(), value);
    if (error != std::errc() || end != item.data() + item.size() || value < 1) {
      return Status::InvalidArgument(source + " line " + std::to_string(line_number) +
                                     ": expected a positive integer length, got '" + item + "'");
    }
    lengths.push_back(value);
  }
  if (input.bad()) {
    return Status::SystemError("cannot read lengths from " + source + ": " + std::strerror(errno));
  }
  return lengths;
}

Result<std::vector<int64_t>> read_lengths_file(const std::string& path) {
  if (path == "-") return read_lengths(std::cin, "standard input");
  std::ifstream file(path);
  if (!file) {
    return Status::InvalidArgument("cannot read lengths file '" + path +
                                   "': " + std::strerror(errno));
  }
  return read_lengths(file, "'" + path + "'");
}

Result<CostModel> parse_cost(const std::string& text) {
  std::vector<double> values;
  if (!parse_double_list(text, values) || values.size() != 3) {
    return Status::InvalidArgument("malformed cost '" + text +
                                   "': expected three comma-separated non-negative numbers A,B,C");
  }
  return CostModel{values[0], values[1], values[2]};
}

Result<std::vector<double>> parse_rank_speed(const std::string& text) {
  std::vector<double> values;
  if (!parse_double_list(text, values)) {
    return Status::InvalidArgument("malformed rank_speed '" + text +
                                   "': expected comma-separated positive numbers S0,S1,...");
  }
  return values;
}

}  // namespace odc::planner
