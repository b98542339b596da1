// The shared-memory bootstrap on its own: ranks are forked processes (as launchers start them).
// allgather of records larger than a control-block slot, named barriers that detect a mismatch,
// and a key whose rank slots stay claimed while its job lives (a second claimant fails; so does
// the holder's job while its ranks are still joining, never once they all met), and launches
// told apart by their whole identity.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "bootstrap/shm_bootstrap.h"
#include "multiprocess.h"

namespace odc {
namespace {

using testing::run_ranks;

std::string expect_text(const Status& status, const std::string& needle) {
  if (status.ok()) return "expected an error containing '" + needle + "', got success";
  if (status.message().find(needle) == std::string::npos) {
    return "expected '" + needle + "' in: " + status.message();
  }
  return "";
}

TEST(ShmBootstrap, AllgatherOfAnySizeReturnsEveryRanksRecordInOrder) {
  const auto outcome = run_ranks(3, [](int rank, int world, const std::string& key) {
    auto made = shm::ShmBootstrap::create(rank, world, key, std::chrono::seconds(20));
    if (!made.ok()) return made.status().message();
    auto& bootstrap = *made.value();
    for (size_t bytes : {size_t{0}, size_t{1}, size_t{256}, size_t{1000}}) {
      std::vector<unsigned char> mine(bytes), all(bytes * static_cast<size_t>(world), 0xee);
      for (size_t i = 0; i < bytes; ++i) mine[i] = static_cast<unsigned char>(rank * 31 + i);
      if (Status s = bootstrap.allgather(mine.data(), all.data(), bytes, "test"); !s.ok()) {
        return s.message();
      }
      for (int r = 0; r < world; ++r) {
        for (size_t i = 0; i < bytes; ++i) {
          if (all[r * bytes + i] != static_cast<unsigned char>(r * 31 + i)) {
            return "wrong byte " + std::to_string(i) + " of rank " + std::to_string(r) + " (" +
                   std::to_string(bytes) + " bytes)";
          }
        }
      }
    }
    return std::string();
  });
  for (const auto& message : outcome) EXPECT_EQ(message, "");
}

TEST(ShmBootstrap, DifferentlyNamedBarriersAreAMismatchNamingBoth) {
  const auto outcome = run_ranks(2, [](int rank, int world, const std::string& key) {
    auto made = shm::ShmBootstrap::create(rank, world, key, std::chrono::seconds(20));
    if (!made.ok()) return made.status().message();
    const Status status = made.value()->barrier(rank == 0 ? "alloc" : "free");
    return expect_text(status, rank == 0 ? "rank 1 called free where this rank called alloc"
                                         : "rank 0 called alloc where this rank called free");
  });
  for (const auto& message : outcome) EXPECT_EQ(message, "");
}

TEST(ShmBootstrap, KeyStaysReservedAfterInitAndIsFreedOnClose) {
  const std::string key = testing::unique_key("reserved");
  auto first = shm::ShmBootstrap::create(0, 1, key, std::chrono::seconds(5));
  ASSERT_TRUE(first.ok()) << first.status().message();
  // Past init nothing of the key is named in /dev/shm, yet a second job with the key is refused
  // at once, every time (the claim outlives the names). The first job goes on: its ranks had all
  // met, so the second job's cannot be among them (it used to fail too).
  EXPECT_NE(::access(("/dev/shm/odc." + key + ".r0").c_str(), F_OK), 0);
  for (int attempt = 0; attempt < 3; ++attempt) {
    auto second = shm::ShmBootstrap::create(0, 1, key, std::chrono::seconds(5));
    ASSERT_FALSE(second.ok());
    EXPECT_NE(second.status().message().find("is in use"), std::string::npos)
        << second.status().message();
    // The message says what happens: this job alone is refused, the first one goes on.
    EXPECT_NE(second.status().message().find("this rank is refused"), std::string::npos)
        << second.status().message();
    EXPECT_EQ(second.status().message().find("both jobs fail"), std::string::npos)
        << second.status().message();
    EXPECT_NE(second.status().message().find("another job is using key '" + key + "'"),
              std::string::npos)
        << second.status().message();
  }
  EXPECT_TRUE(first.value()->barrier("after").ok());
  EXPECT_TRUE(first.value()->barrier("after again").ok());
  first.value().reset();
  auto again = shm::ShmBootstrap::create(0, 1, key, std::chrono::seconds(5));
  EXPECT_TRUE(again.ok()) << again.status().message();
}

// A second claimant while the holder's job is still joining: both fail (ranks of two jobs
// started together may have paired, and nothing in them tells them apart). Rank 1 plays the
// second job's rank 0; the first job's rank 1 never comes.
TEST(ShmBootstrap, SecondClaimantWhileTheHolderStillJoinsFailsBothJobs) {
  const auto outcome = run_ranks(2, [](int rank, int, const std::string& key) {
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    auto made = shm::ShmBootstrap::create(0, 2, key, std::chrono::seconds(20));
    // The holder's message says why it fails although it came first: it was still joining.
    return expect_text(made.status(), rank == 1 ? "is in use" : "had not all met yet, so both");
  });
  for (const auto& message : outcome) EXPECT_EQ(message, "");
}

// Launch identities used to be cut at 159 bytes, so two launches whose
// identities differ only past that (a long ODC_JOB_ID) counted as one and paired.
TEST(ShmBootstrap, LaunchesDifferingAnywhereInTheirIdentityNeverPair) {
  const auto outcome = run_ranks(2, [](int rank, int world, const std::string& key) {
    std::string job(300, 'j');
    job.back() = rank == 0 ? 'a' : 'b';
    // As core/comm_config.cc resolves ODC_JOB_ID (given here: threads share one environment).
    auto made = shm::ShmBootstrap::create(rank, world, key, std::chrono::seconds(20), nullptr,
                                          nullptr, "ODC_JOB_ID=" + job);
    return expect_text(made.status(), "was started by another launch");
  });
  for (const auto& message : outcome) EXPECT_EQ(message, "");
}

TEST(ShmBootstrap, InfiniteTimeoutIsAcceptedAndZeroIsNot) {
  const std::string key = testing::unique_key("timeouts");
  auto forever = shm::ShmBootstrap::create(
      0, 1, key, std::chrono::duration<double>(std::numeric_limits<double>::infinity()));
  ASSERT_TRUE(forever.ok()) << forever.status().message();
  EXPECT_TRUE(forever.value()->barrier("forever").ok());
  auto zero = shm::ShmBootstrap::create(0, 1, key + "z", std::chrono::duration<double>(0));
  ASSERT_FALSE(zero.ok());
  EXPECT_NE(zero.status().message().find("timeout must be positive"), std::string::npos);
}

}  // namespace
}  // namespace odc
