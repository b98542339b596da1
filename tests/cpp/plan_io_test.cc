// Parsing of length files and option strings.
#include "planner/plan_io.h"

#include <gtest/gtest.h>

#include <istream>
#include <sstream>
#include <streambuf>
#include <string>
#include <vector>

namespace odc::planner {
namespace {

Result<std::vector<int64_t>> read(const std::string& text) {
  std::istringstream input(text);
  return read_lengths(input, "'test'");
}

TEST(ReadLengths, SkipsBlankAndCommentLines) {
  auto lengths = read("# header\n12\n\n  7 \n# more\n3\r\n");
  ASSERT_TRUE(lengths.ok()) << lengths.status().message();
  EXPECT_EQ(lengths.value(), (std::vector<int64_t>{12, 7, 3}));
}

TEST(ReadLengths, RejectsBadLinesWithLineNumber) {
  EXPECT_EQ(read("1\n2\nabc\n").status().message(),
            "'test' line 3: expected a positive integer length, got 'abc'");
  EXPECT_EQ(read("1\n-4\n").status().message(),
            "'test' line 2: expected a positive integer length, got '-4'");
  EXPECT_EQ(read("0\n").status().message(),
            "'test' line 1: expected a positive integer length, got '0'");
  EXPECT_EQ(read("2.5\n").status().message(),
            "'test' line 1: expected a positive integer length, got '2.5'");
  EXPECT_EQ(read("99999999999999999999\n").status().message(),
            "'test' line 1: expected a positive integer length, got '99999999999999999999'");
}

TEST(ReadLengths, EmptyInputIsEmpty) {
  auto lengths = read("# nothing\n\n");
  ASSERT_TRUE(lengths.ok());
  EXPECT_TRUE(lengths.value().empty());
}

TEST(ReadLengthsFile, MissingFileNamesPath) {
  auto lengths = read_lengths_file("/nonexistent/lengths.txt");
  ASSERT_FALSE(lengths.ok());
  EXPECT_EQ(lengths.status().message(),
            "cannot read lengths file '/nonexistent/lengths.txt': No such file or directory");
}

TEST(ParseCost, AcceptsThreeNumbers) {
  auto cost = parse_cost("0.00027401178,0.0000000042464424,0");
  ASSERT_TRUE(cost.ok());
  EXPECT_DOUBLE_EQ(cost.value().a, 0.00027401178);
  EXPECT_DOUBLE_EQ(cost.value().b, 4.2464424e-9);
  EXPECT_DOUBLE_EQ(cost.value().c, 0.0);
  EXPECT_DOUBLE_EQ(cost.value().floor, 0.0);
}

TEST(ParseCost, AcceptsAFourthNumberAsTheFloor) {
  auto cost = parse_cost("3e-05,1e-09,0.07,0.25");
  ASSERT_TRUE(cost.ok());
  EXPECT_DOUBLE_EQ(cost.value().c, 0.07);
  EXPECT_DOUBLE_EQ(cost.value().floor, 0.25);
  EXPECT_DOUBLE_EQ(cost.value().microbatch(0.1), 0.25);  // c + 0.1 = 0.17 < floor
  EXPECT_DOUBLE_EQ(cost.value().microbatch(1.0), 1.07);
}

TEST(ParseCost, RejectsMalformed) {
  for (const char* text :
       {"", "1,2", "1,2,3,4,5", "1,x,3", "1,,3", "1,2,", "nan,1,1", "1,2,inf", "1,2,3,nan"}) {
    auto cost = parse_cost(text);
    ASSERT_FALSE(cost.ok()) << text;
    EXPECT_EQ(cost.status().message(),
              std::string("malformed cost '") + text +
                  "': expected three comma-separated non-negative numbers A,B,C (and optionally "
                  "a floor F: A,B,C,F)");
  }
}

TEST(ParseRankSpeed, ParsesAndRejects) {
  auto speeds = parse_rank_speed("1,0.5,2");
  ASSERT_TRUE(speeds.ok());
  EXPECT_EQ(speeds.value(), (std::vector<double>{1, 0.5, 2}));
  EXPECT_FALSE(parse_rank_speed("1,fast").ok());
  EXPECT_FALSE(parse_rank_speed("").ok());
}

// An endless stream of one byte, like /dev/zero: reading must stop on its own.
class EndlessBytes : public std::streambuf {
 public:
  explicit EndlessBytes(char byte) : block_(4096, byte) {}

 protected:
  int_type underflow() override {
    setg(block_.data(), block_.data(), block_.data() + block_.size());
    return traits_type::to_int_type(block_[0]);
  }

 private:
  std::vector<char> block_;
};

TEST(ReadLengths, EndlessLineFailsWithoutGrowing) {
  EndlessBytes zeros('\0');
  std::istream input(&zeros);
  auto lengths = read_lengths(input, "'/dev/zero'");
  ASSERT_FALSE(lengths.ok());
  EXPECT_EQ(lengths.status().message(),
            "'/dev/zero' line 1 is longer than 65536 bytes (not a lengths file?)");
}

TEST(ReadLengths, LongLastLineWithoutNewlineIsRead) {
  // Up to the bound a line is fine, also the last one without '\n'.
  auto lengths = read("5\n" + std::string(60000, ' ') + "42");
  ASSERT_TRUE(lengths.ok()) << lengths.status().message();
  EXPECT_EQ(lengths.value(), (std::vector<int64_t>{5, 42}));
}

TEST(ReadLengths, EchoedTextIsEscapedAndShort) {
  // Raw control bytes (an escape sequence, a carriage return) must not reach the terminal, and
  // the message stays one line.
  EXPECT_EQ(read("1\n\x1b[2Jx\rboom\n").status().message(),
            "'test' line 2: expected a positive integer length, got '\\x1b[2Jx\\x0dboom'");
  const std::string garbage(1000, 'z');
  const std::string message = read(garbage + "\n").status().message();
  EXPECT_EQ(message, "'test' line 1: expected a positive integer length, got '" +
                         std::string(64, 'z') + "' (1000 bytes, first 64 shown)");
  EXPECT_EQ(quote_text("a\\b\xff\n"), "'a\\\\b\\xff\\x0a'");
  EXPECT_EQ(parse_cost("1,\x1b,3").status().message(),
            "malformed cost '1,\\x1b,3': expected three comma-separated non-negative numbers "
            "A,B,C (and optionally a floor F: A,B,C,F)");
}

}  // namespace
}  // namespace odc::planner
