// Parsing of planner inputs. Strict: "12abc", "1e3" and "+5" are not lengths.
#include "planner/plan_io.h"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>

#include "planner/plan.h"

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

std::string number_text(double value) {
  std::ostringstream out;
  out << value;
  return out.str();
}

std::string quote_text(std::string_view text) {
  constexpr size_t kMaxShown = 64;
  std::string out = "'";
  for (size_t i = 0; i < text.size() && i < kMaxShown; ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    if (byte == '\\') {
      out += "\\\\";
    } else if (byte < 0x20 || byte >= 0x7f) {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\x%02x", byte);
      out += escaped;
    } else {
      out += static_cast<char>(byte);
    }
  }
  out += '\'';
  if (text.size() > kMaxShown)
    out += " (" + std::to_string(text.size()) + " bytes, first " + std::to_string(kMaxShown) +
           " shown)";
  return out;
}

Result<std::vector<int64_t>> read_lengths(std::istream& input, const std::string& source) {
  std::vector<int64_t> lengths;
  std::string line;  // the current line, never longer than kMaxLineBytes
  int64_t line_number = 0;
  auto parse_line = [&]() -> Status {
    ++line_number;
    const std::string item = trim(line);
    if (item.empty() || item.front() == '#') return Status::Ok();
    int64_t value = 0;
    const auto [end, error] = std::from_chars(item.data(), item.data() + item.size(), value);
    if (error != std::errc() || end != item.data() + item.size() || value < 1) {
      return Status::InvalidArgument(source + " line " + std::to_string(line_number) +
                                     ": expected a positive integer length, got " +
                                     quote_text(item));
    }
    if (lengths.size() >= static_cast<size_t>(kMaxSamples)) {
      return Status::InvalidArgument(source + ": more than " + std::to_string(kMaxSamples) +
                                     " sample lengths");
    }
    lengths.push_back(value);
    return Status::Ok();
  };
  // Read in blocks and split on '\n' by hand: getline() would grow a line without bound (a
  // stream of NUL bytes such as /dev/zero never ends one).
  std::vector<char> block(size_t{1} << 16);
  while (input) {
    input.read(block.data(), static_cast<std::streamsize>(block.size()));
    const size_t size = static_cast<size_t>(input.gcount());
    size_t begin = 0;
    while (begin < size) {
      const char* newline =
          static_cast<const char*>(std::memchr(block.data() + begin, '\n', size - begin));
      const size_t end = newline ? static_cast<size_t>(newline - block.data()) : size;
      if (line.size() + (end - begin) > kMaxLineBytes) {
        return Status::InvalidArgument(source + " line " + std::to_string(line_number + 1) +
                                       " is longer than " + std::to_string(kMaxLineBytes) +
                                       " bytes (not a lengths file?)");
      }
      line.append(block.data() + begin, end - begin);
      if (!newline) break;
      ODC_RETURN_IF_ERROR(parse_line());
      line.clear();
      begin = end + 1;
    }
  }
  if (input.bad()) {
    return Status::SystemError("cannot read lengths from " + source + ": " + std::strerror(errno));
  }
  if (!line.empty()) ODC_RETURN_IF_ERROR(parse_line());
  return lengths;
}

Result<std::vector<int64_t>> read_lengths_file(const std::string& path) {
  if (path == "-") return read_lengths(std::cin, "standard input");
  std::ifstream file(path);
  if (!file) {
    return Status::InvalidArgument("cannot read lengths file " + quote_text(path) + ": " +
                                   std::strerror(errno));
  }
  return read_lengths(file, quote_text(path));
}

Result<CostModel> parse_cost(const std::string& text) {
  std::vector<double> values;
  if (!parse_double_list(text, values) || (values.size() != 3 && values.size() != 4)) {
    return Status::InvalidArgument("malformed cost " + quote_text(text) +
                                   ": expected three comma-separated non-negative numbers A,B,C"
                                   " (and optionally a floor F: A,B,C,F)");
  }
  return CostModel{values[0], values[1], values[2], values.size() == 4 ? values[3] : 0.0};
}

Result<std::vector<double>> parse_rank_speed(const std::string& text) {
  std::vector<double> values;
  if (!parse_double_list(text, values)) {
    return Status::InvalidArgument("malformed rank_speed " + quote_text(text) +
                                   ": expected comma-separated positive numbers S0,S1,...");
  }
  return values;
}

}  // namespace odc::planner
