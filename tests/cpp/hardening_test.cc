// Hardening of the communicator C API: every size product the runtime derives from a
// count must be checked, never wrapped; buffers of the same size allocated in a different order on
// different ranks are told apart by their names; a split member that leaves before the
// group met is named at once; a job killed mid-allocation or mid-split leaves nothing named.
#include <gtest/gtest.h>

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "multiprocess.h"
#include "odc/odc.h"

namespace {

std::string unique_key(const char* what) {
  return std::string("hard-") + what + "-" + std::to_string(getpid());
}

TEST(Hardening, AllocRejectsCountsWhoseByteSizeWraps) {
  odcComm_t comm = nullptr;
  ASSERT_EQ(odcCommInit(&comm, 0, 1, unique_key("alloc").c_str(), 5.0), odcSuccess)
      << odcGetLastError();
  odcBuffer_t buffer = nullptr;
  void* local = nullptr;
  // 2^62 + 1 float32 elements: count * 4 wraps to 4 bytes. Such a buffer used to be created and
  // the next scatter-accumulate wrote far past its mapping.
  const size_t wraps = (size_t{1} << 62) + 1;
  for (int accumulator : {0, 1}) {
    EXPECT_EQ(odcBufferAlloc(comm, wraps, odcFloat32, accumulator, &buffer, &local),
              odcInvalidArgument);
    EXPECT_EQ(buffer, nullptr);
    EXPECT_NE(std::string(odcGetLastError()).find("alloc: count 4611686018427387905 is too large"),
              std::string::npos)
        << odcGetLastError();
  }
  EXPECT_EQ(odcBufferAlloc(comm, SIZE_MAX, odcBfloat16, 0, &buffer, &local), odcInvalidArgument);
  EXPECT_EQ(odcBufferAlloc(comm, SIZE_MAX / 2 + 1, odcBfloat16, 0, &buffer, &local),
            odcInvalidArgument);
  // The communicator is still usable afterwards.
  ASSERT_EQ(odcBufferAlloc(comm, 16, odcFloat32, 1, &buffer, &local), odcSuccess)
      << odcGetLastError();
  EXPECT_EQ(odcBufferFree(comm, buffer), odcSuccess);
  EXPECT_EQ(odcCommDestroy(comm), odcSuccess);
}

TEST(Hardening, AllocKindIsChecked) {
  odcComm_t comm = nullptr;
  ASSERT_EQ(odcCommInit(&comm, 0, 1, unique_key("kind").c_str(), 5.0), odcSuccess)
      << odcGetLastError();
  odcBuffer_t buffer = nullptr;
  void* local = nullptr;
  EXPECT_EQ(odcBufferAllocKind(comm, 16, odcFloat32, static_cast<odcBufferKind_t>(3), nullptr,
                               &buffer, &local),
            odcInvalidArgument);
  EXPECT_NE(std::string(odcGetLastError()).find("unknown buffer kind 3"), std::string::npos)
      << odcGetLastError();
  EXPECT_EQ(
      odcBufferAllocKind(comm, 16, odcBfloat16, odcBufferAccumulator, nullptr, &buffer, &local),
      odcInvalidArgument);  // accumulators are float32, whichever function makes them
  // A published buffer is an ordinary buffer to gather, on any transport.
  ASSERT_EQ(odcBufferAllocKind(comm, 16, odcFloat32, odcBufferPublished, "params", &buffer, &local),
            odcSuccess)
      << odcGetLastError();
  static_cast<float*>(local)[3] = 7.0f;
  float gathered[16] = {};
  ASSERT_EQ(odcMinibatchBegin(comm, nullptr), odcSuccess) << odcGetLastError();
  ASSERT_EQ(odcGather(comm, gathered, 16, buffer, nullptr), odcSuccess) << odcGetLastError();
  ASSERT_EQ(odcMinibatchEnd(comm, nullptr), odcSuccess) << odcGetLastError();
  EXPECT_EQ(gathered[3], 7.0f);
  EXPECT_EQ(odcBufferFree(comm, buffer), odcSuccess);
  EXPECT_EQ(odcCommDestroy(comm), odcSuccess);
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Rank 0 allocates its parameters where rank 1 allocates its gradients, same size. Before
// names existed both calls succeeded and rank 0 gathered rank 1's gradients as weights.
TEST(Hardening, BufferNamesAreCheckedAcrossRanks) {
  const auto outcome = odc::testing::run_ranks(
      2,
      [](int rank, int world, const std::string& key) -> std::string {
        odcComm_t comm;
        RANK_CHECK(odcCommInit(&comm, rank, world, key.c_str(), 20.0));
        const std::string me = "this rank (" + std::to_string(rank) + ")";
        const std::string peer = "rank " + std::to_string(1 - rank);
        odcBuffer_t buffer = nullptr;
        void* local = nullptr;
        odcResult_t result = odcBufferAllocNamed(
            comm, 64, odcFloat32, 0, rank == 0 ? "layer0:params" : "layer0:grads", &buffer, &local);
        std::string message = odcCommGetLastError(comm);
        RANK_EXPECT(result == odcInvalidArgument, odcGetErrorString(result));
        RANK_EXPECT(buffer == nullptr && local == nullptr, "nothing is handed out");
        RANK_EXPECT(contains(message, "buffers differ across ranks: " + peer), message);
        RANK_EXPECT(contains(message, me), message);
        RANK_EXPECT(contains(message, "named \"layer0:params\""), message);
        RANK_EXPECT(contains(message, "named \"layer0:grads\""), message);
        RANK_EXPECT(contains(message, "64 float32"), message);
        // A named buffer never pairs with an unnamed one.
        result = rank == 0 ? odcBufferAllocNamed(comm, 8, odcFloat32, 1, "acc", &buffer, &local)
                           : odcBufferAlloc(comm, 8, odcFloat32, 1, &buffer, &local);
        message = odcCommGetLastError(comm);
        RANK_EXPECT(result == odcInvalidArgument, odcGetErrorString(result));
        RANK_EXPECT(contains(message, "unnamed") && contains(message, "named \"acc\""), message);
        // Names longer than the record carries are compared in full and shown cut.
        std::string long_name(200, 'x');
        long_name.back() = rank == 0 ? 'a' : 'b';
        result = odcBufferAllocNamed(comm, 8, odcFloat32, 0, long_name.c_str(), &buffer, &local);
        message = odcCommGetLastError(comm);
        RANK_EXPECT(result == odcInvalidArgument, odcGetErrorString(result));
        RANK_EXPECT(contains(message, "...\"") && contains(message, "differ after"), message);
        // Bad names are refused before any communication, naming the problem.
        RANK_EXPECT(
            odcBufferAllocNamed(comm, 8, odcFloat32, 0, "", &buffer, &local) == odcInvalidArgument,
            "an empty name");
        RANK_EXPECT(contains(odcGetLastError(), "name is empty"), odcGetLastError());
        RANK_EXPECT(odcBufferAllocNamed(comm, 8, odcFloat32, 0, "a\nb", &buffer, &local) ==
                        odcInvalidArgument,
                    "a control character");
        RANK_EXPECT(contains(odcGetLastError(), "printable ASCII"), odcGetLastError());
        const std::string too_long(257, 'n');
        RANK_EXPECT(odcBufferAllocNamed(comm, 8, odcFloat32, 0, too_long.c_str(), &buffer,
                                        &local) == odcInvalidArgument,
                    "a name of 257 characters");
        RANK_EXPECT(contains(odcGetLastError(), "at most 256"), odcGetLastError());
        // Matching names: allocated, and the communicator works as before.
        RANK_CHECK(odcBufferAllocNamed(comm, 64, odcFloat32, 0, "layer0:params", &buffer, &local));
        for (int i = 0; i < 64; ++i) static_cast<float*>(local)[i] = static_cast<float>(rank + 1);
        RANK_CHECK(odcBarrier(comm, nullptr));
        std::vector<float> full(static_cast<size_t>(world) * 64);
        RANK_CHECK(odcGather(comm, full.data(), full.size(), buffer, nullptr));
        for (size_t i = 0; i < full.size(); ++i) {
          RANK_EXPECT(full[i] == static_cast<float>(i / 64 + 1), "gathered " + std::to_string(i));
        }
        RANK_CHECK(odcBufferFree(comm, buffer));
        RANK_CHECK(odcCommDestroy(comm));
        return "";
      },
      std::chrono::seconds(60), "names");
  for (size_t rank = 0; rank < outcome.size(); ++rank) EXPECT_EQ(outcome[rank], "") << rank;
}

// A flag word shared by the forked ranks of a test (mapped before they fork).
std::atomic<int>* shared_flag() {
  void* memory = mmap(nullptr, sizeof(std::atomic<int>), PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  return new (memory) std::atomic<int>(0);
}

void wait_for_flag(const std::atomic<int>* flag, int value) {
  while (flag->load() < value) std::this_thread::sleep_for(std::chrono::milliseconds(2));
}

// A forked child that uses or destroys its parent's communicator (a Python
// child's finalizer runs odcCommDestroy) must not act as the parent's rank. Before, the child's
// destroy marked rank 0 closed in the shared control block and rank 1 failed with "rank 0
// destroyed its communicator".
TEST(Hardening, ForkedChildNeitherUsesNorDestroysItsParentsCommunicator) {
  const auto outcome = odc::testing::run_ranks(
      2,
      [](int rank, int world, const std::string& key) -> std::string {
        odcComm_t comm;
        RANK_CHECK(odcCommInit(&comm, rank, world, key.c_str(), 20.0));
        if (rank == 0) {
          std::fflush(nullptr);
          const pid_t child = fork();
          if (child == 0) {
            const bool refused = odcBarrier(comm, nullptr) == odcInvalidUsage &&
                                 contains(odcGetLastError(), "(a forked child?) cannot use it");
            const bool forgotten =
                odcCommDestroy(comm) == odcSuccess && odcCommDestroy(comm) == odcInvalidUsage;
            _exit(refused && forgotten ? 0 : 1);
          }
          int status = 0;
          waitpid(child, &status, 0);
          RANK_EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                      "the child's calls were refused and its destroy only forgot the handle");
        }
        RANK_CHECK(odcBarrier(comm, nullptr));  // rank 1 waits here while the child runs
        RANK_CHECK(odcBarrier(comm, nullptr));
        RANK_CHECK(odcCommDestroy(comm));
        return "";
      },
      std::chrono::seconds(60), "fork");
  for (size_t rank = 0; rank < outcome.size(); ++rank) EXPECT_EQ(outcome[rank], "") << rank;
}

// odcCommDestroy from another thread while a call waits on a peer (here with an
// infinite timeout) ends that wait and frees nothing before the call has returned; the peer then
// learns that this rank destroyed its communicator. It was a use-after-free.
TEST(Hardening, DestroyFromAnotherThreadEndsTheCallInFlight) {
  std::atomic<int>* destroyed = shared_flag();
  const auto outcome = odc::testing::run_ranks(
      2,
      [destroyed](int rank, int world, const std::string& key) -> std::string {
        odcComm_t comm;
        RANK_CHECK(odcCommInit(&comm, rank, world, key.c_str(), INFINITY));
        if (rank == 1) {
          wait_for_flag(destroyed, 1);
          // Rank 0 had arrived in the barrier it waited in: that one passes, the next fails.
          odcResult_t result = odcBarrier(comm, nullptr);
          if (result == odcSuccess) result = odcBarrier(comm, nullptr);
          RANK_EXPECT(result == odcRemoteError, odcGetLastError());
          RANK_EXPECT(
              contains(odcGetLastError(), "rank 0 ") && contains(odcGetLastError(), "destroyed"),
              odcGetLastError());
          RANK_CHECK(odcCommDestroy(comm));
          return "";
        }
        odcResult_t result = odcSuccess;
        std::string message;
        std::thread waiter([&] {
          result = odcBarrier(comm, nullptr);  // rank 1 never comes
          message = odcGetLastError();
        });
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        RANK_CHECK(odcCommDestroy(comm));
        waiter.join();
        destroyed->store(1);
        // Usually it was waiting (interrupted); a waiter slower than 100 ms finds it destroyed.
        RANK_EXPECT(result == odcInterrupted || result == odcInvalidUsage,
                    odcGetErrorString(result));
        RANK_EXPECT(contains(message, "destroy"), message);
        RANK_EXPECT(odcBarrier(comm, nullptr) == odcInvalidUsage, "the handle is invalid");
        return "";
      },
      std::chrono::seconds(60), "destroy-thread");
  for (size_t rank = 0; rank < outcome.size(); ++rank) EXPECT_EQ(outcome[rank], "") << rank;
}

// A communicator is used by one thread at a time. A call entering while another
// thread is inside one (here a barrier waiting for rank 1) is refused at once, naming both threads
// and the call in flight, and changes nothing: that call completes and the communicator stays
// usable. Before, the second thread ran into the first's sequence numbers (concurrent pushes
// timed out with a sequence no rank had sent).
TEST(Hardening, SecondThreadInsideACommunicatorIsRefusedNamingBoth) {
  std::atomic<int>* refused = shared_flag();
  const auto outcome = odc::testing::run_ranks(
      2,
      [refused](int rank, int world, const std::string& key) -> std::string {
        odcComm_t comm;
        RANK_CHECK(odcCommInit(&comm, rank, world, key.c_str(), 30.0));
        odcBuffer_t acc = nullptr;
        void* local = nullptr;
        RANK_CHECK(odcBufferAlloc(comm, 16, odcFloat32, 1, &acc, &local));
        if (rank == 1) {
          wait_for_flag(refused, 1);
          RANK_CHECK(odcBarrier(comm, nullptr));  // rank 0's waiter passes with this one
          RANK_CHECK(odcBarrier(comm, nullptr));
          RANK_CHECK(odcCommDestroy(comm));
          return "";
        }
        std::atomic<pid_t> waiter_id{0};
        odcResult_t waited = odcInternalError;
        std::thread waiter([&] {
          pthread_setname_np(pthread_self(), "odc-waiter");
          waiter_id = static_cast<pid_t>(syscall(SYS_gettid));
          waited = odcBarrier(comm, nullptr);  // rank 1 comes once the refusals are checked
        });
        // The waiter holds the communicator once this thread's calls are refused (bounded).
        odcResult_t result = odcSuccess;
        int rank_seen = -1;
        const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        while ((result = odcCommRank(comm, &rank_seen)) == odcSuccess &&
               std::chrono::steady_clock::now() < give_up) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        const std::string message = odcGetLastError();
        const std::string me = std::to_string(syscall(SYS_gettid));
        float src[32] = {};
        const odcResult_t pushed = odcScatterAccumulate(comm, src, 32, odcFloat32, acc, nullptr);
        const std::string push_message = odcGetLastError();
        const odcResult_t met = odcBarrier(comm, nullptr);
        // (Not odcCommGetLastError here: the waiter's call is in flight, and its message is valid
        // only between calls. The refusals set only this thread's error, read above.)
        refused->store(1);
        waiter.join();
        RANK_EXPECT(result == odcInvalidUsage, odcGetErrorString(result));
        RANK_EXPECT(contains(message, "rank 0: odcCommRank: refused: thread " + me) &&
                        contains(message, "while thread " + std::to_string(waiter_id.load()) +
                                              " (\"odc-waiter\") is inside odcBarrier") &&
                        contains(message, "used by one thread at a time"),
                    message);
        RANK_EXPECT(pushed == odcInvalidUsage && met == odcInvalidUsage, push_message);
        RANK_EXPECT(contains(push_message, "odcScatterAccumulate: refused"), push_message);
        // The waiter's barrier completed; the communicator is usable, with nothing pushed.
        RANK_EXPECT(waited == odcSuccess, odcGetErrorString(waited));
        RANK_CHECK(odcBarrier(comm, nullptr));
        RANK_EXPECT(odcCommRank(comm, &rank_seen) == odcSuccess && rank_seen == 0, "rank");
        RANK_CHECK(odcCommDestroy(comm));
        return "";
      },
      std::chrono::seconds(60), "threads");
  for (size_t rank = 0; rank < outcome.size(); ++rank) EXPECT_EQ(outcome[rank], "") << rank;
}

// Rank 0 waits in a sub-communicator's barrier while rank 1 waits in the
// parent's (a program's mistake); rank 0 times out first and destroys both. Rank 1 was told only
// "rank 0 destroyed its communicator"; it is told the sub-communicator's failure that led to it.
TEST(Hardening, PeerLearnsWhyARankDestroyedItsCommunicatorAfterASubCommunicatorFailed) {
  const auto outcome = odc::testing::run_ranks(
      2,
      [](int rank, int world, const std::string& key) -> std::string {
        odcComm_t comm;
        RANK_CHECK(odcCommInit(&comm, rank, world, key.c_str(), rank == 0 ? 0.5 : 30.0));
        odcComm_t child = nullptr;
        RANK_CHECK(odcCommSplit(comm, 0, rank, &child));
        if (rank == 0) {
          const odcResult_t result = odcBarrier(child, nullptr);
          RANK_EXPECT(result == odcTimeout, odcGetErrorString(result));
          RANK_CHECK(odcCommDestroy(child));
          RANK_CHECK(odcCommDestroy(comm));
          return "";
        }
        const odcResult_t result = odcBarrier(comm, nullptr);
        const std::string message = odcGetLastError();
        RANK_EXPECT(result == odcRemoteError, odcGetErrorString(result));
        RANK_EXPECT(contains(message,
                             "rank 1: barrier: rank 0 failed: rank 0: destroyed its communicator "
                             "after a sub-communicator failed there: split colour 0, parent ranks "
                             "0, 1: rank 0: barrier: timed out after 0.5 s waiting for rank 1"),
                    message);
        RANK_CHECK(odcCommDestroy(child));
        RANK_CHECK(odcCommDestroy(comm));
        return "";
      },
      std::chrono::seconds(60), "child-timeout");
  for (size_t rank = 0; rank < outcome.size(); ++rank) EXPECT_EQ(outcome[rank], "") << rank;
}

// The caller's interrupt check (Python: its signal handlers, so Ctrl-C) ends a
// wait on a missing peer even with an infinite timeout; the communicator is failed and the peer
// names this rank. Before, such a wait never returned.
TEST(Hardening, InterruptCheckEndsWaitsAndFailsTheCommunicator) {
  std::atomic<int>* interrupted = shared_flag();
  const auto outcome = odc::testing::run_ranks(
      2,
      [interrupted](int rank, int world, const std::string& key) -> std::string {
        odcComm_t comm;
        RANK_CHECK(odcCommInit(&comm, rank, world, key.c_str(), INFINITY));
        if (rank == 1) {
          wait_for_flag(interrupted, 1);
          // Rank 0 had entered the barrier it waited in: that one completes here (every rank
          // entered it), the next call fails naming rank 0 (docs/runtime.md, "Interrupts").
          RANK_CHECK(odcBarrier(comm, nullptr));
          const odcResult_t result = odcBarrier(comm, nullptr);
          RANK_EXPECT(result == odcRemoteError, odcGetLastError());
          RANK_EXPECT(contains(odcGetLastError(), "rank 0 failed") &&
                          contains(odcGetLastError(), "interrupted"),
                      odcGetLastError());
          RANK_CHECK(odcCommDestroy(comm));
          return "";
        }
        static int calls = 0;
        RANK_CHECK(odcSetInterruptCheck([](void*) { return ++calls >= 3 ? 1 : 0; }, nullptr));
        const odcResult_t result = odcBarrier(comm, nullptr);
        const std::string message = odcGetLastError();
        RANK_CHECK(odcSetInterruptCheck(nullptr, nullptr));
        interrupted->store(1);
        RANK_EXPECT(result == odcInterrupted, odcGetErrorString(result));
        RANK_EXPECT(contains(message, "rank 0: barrier: interrupted") &&
                        contains(message, "waiting for rank 1"),
                    message);
        RANK_EXPECT(std::string(odcGetErrorString(odcInterrupted)) == "interrupted", "its name");
        RANK_EXPECT(odcBarrier(comm, nullptr) == odcRemoteError, "the communicator failed");
        RANK_CHECK(odcCommDestroy(comm));
        return "";
      },
      std::chrono::seconds(60), "interrupt");
  for (size_t rank = 0; rank < outcome.size(); ++rank) EXPECT_EQ(outcome[rank], "") << rank;
}

// A buffer handle is validated before anything reads it. odcGather used to read
// the buffer's dtype first: a garbage handle was a SIGSEGV, a freed one a use-after-free. A freed
// handle also stays invalid once a new buffer of the same size takes its memory.
TEST(Hardening, BufferHandlesAreCheckedBeforeUse) {
  odcComm_t comm = nullptr;
  odcComm_t other = nullptr;
  ASSERT_EQ(odcCommInit(&comm, 0, 1, unique_key("handles").c_str(), 5.0), odcSuccess)
      << odcGetLastError();
  ASSERT_EQ(odcCommInit(&other, 0, 1, unique_key("handles2").c_str(), 5.0), odcSuccess)
      << odcGetLastError();
  const auto refused = [](odcResult_t result, const char* operation) {
    EXPECT_EQ(result, odcInvalidArgument) << operation;
    EXPECT_TRUE(contains(odcGetLastError(), std::string(operation) + ": buffer does not belong"))
        << odcGetLastError();
  };
  float out[16] = {};
  float src[16] = {};
  uint16_t narrow[16] = {};
  ASSERT_EQ(odcMinibatchBegin(comm, nullptr), odcSuccess) << odcGetLastError();
  for (uintptr_t bits : {uintptr_t{0x10}, uintptr_t{0xdeadbeef0}, ~uintptr_t{0}}) {
    const auto garbage = reinterpret_cast<odcBuffer_t>(bits);
    refused(odcGather(comm, out, 16, garbage, nullptr), "gather");
    refused(odcGatherAs(comm, narrow, 16, odcBfloat16, garbage, nullptr), "gather");
    refused(odcScatterAccumulate(comm, src, 16, odcFloat32, garbage, nullptr),
            "scatter_accumulate");
  }
  ASSERT_EQ(odcMinibatchEnd(comm, nullptr), odcSuccess) << odcGetLastError();
  refused(odcBufferFree(comm, reinterpret_cast<odcBuffer_t>(uintptr_t{0x10})), "free");

  odcBuffer_t freed = nullptr;
  odcBuffer_t live = nullptr;
  odcBuffer_t foreign = nullptr;
  void* local = nullptr;
  ASSERT_EQ(odcBufferAlloc(comm, 16, odcFloat32, 0, &freed, &local), odcSuccess);
  ASSERT_EQ(odcBufferFree(comm, freed), odcSuccess);
  ASSERT_EQ(odcBufferAlloc(comm, 16, odcFloat32, 0, &live, &local), odcSuccess);
  ASSERT_EQ(odcBufferAlloc(other, 16, odcFloat32, 0, &foreign, &local), odcSuccess);
  EXPECT_NE(live, freed);
  refused(odcGather(comm, out, 16, freed, nullptr), "gather");
  refused(odcBufferFree(comm, freed), "free");
  refused(odcGather(comm, out, 16, foreign, nullptr), "gather");
  EXPECT_EQ(odcGather(comm, out, 16, live, nullptr), odcSuccess) << odcGetLastError();
  EXPECT_EQ(odcCommDestroy(other), odcSuccess);
  EXPECT_EQ(odcCommDestroy(comm), odcSuccess);
}

// The same for plan handles and lengths arrays: a garbage or destroyed one is refused.
TEST(Hardening, PlanHandlesAreCheckedBeforeUse) {
  const auto garbage = reinterpret_cast<odcPlan_t>(uintptr_t{0x10});
  double collective = 0;
  double odc_bubble = 0;
  const char* json = nullptr;
  EXPECT_EQ(odcPlanGetBubble(garbage, &collective, &odc_bubble), odcInvalidArgument);
  EXPECT_TRUE(contains(odcGetLastError(), "not a live plan")) << odcGetLastError();
  EXPECT_EQ(odcPlanToJson(garbage, &json), odcInvalidArgument);
  EXPECT_EQ(odcPlanDestroy(garbage), odcInvalidArgument);
  odcPlanOptions_t options = ODC_PLAN_OPTIONS_INIT;
  ASSERT_EQ(odcPlanOptionsInit(&options), odcSuccess);
  options.max_tokens = 100;
  const int64_t lengths[] = {10, 20, 30};
  odcPlan_t plan = nullptr;
  ASSERT_EQ(odcPlanCreate(lengths, 3, &options, &plan), odcSuccess) << odcGetLastError();
  EXPECT_EQ(odcPlanGetBubble(plan, &collective, &odc_bubble), odcSuccess);
  EXPECT_EQ(odcPlanDestroy(plan), odcSuccess);
  EXPECT_EQ(odcPlanDestroy(plan), odcInvalidArgument);  // no double free
  EXPECT_EQ(odcPlanToJson(plan, &json), odcInvalidArgument);
  EXPECT_EQ(odcPlanDestroy(nullptr), odcSuccess);
  EXPECT_EQ(odcLengthsFree(const_cast<int64_t*>(lengths)), odcInvalidArgument);
  EXPECT_EQ(odcLengthsFree(nullptr), odcSuccess);
}

// A NaN timeout is refused naming the argument (it used to mean "the default").
TEST(Hardening, NanTimeoutIsRefusedNamingIt) {
  odcComm_t comm = nullptr;
  EXPECT_EQ(odcCommInit(&comm, 0, 1, unique_key("nan").c_str(), NAN), odcInvalidArgument);
  EXPECT_TRUE(contains(odcGetLastError(), "rank 0: init: timeout_seconds is NaN"))
      << odcGetLastError();
  EXPECT_EQ(comm, nullptr);
}

// How a member of a split leaves right after its colour record went out (it waits in the split's
// exchange for rank 0, which comes once the member's interrupt check says it waits there).
enum class Leaving { kInterrupted, kFailed, kAborted, kDied };

std::atomic<int>* member_waits = nullptr;  // set by the member's interrupt check
odcComm_t leaving_comm = nullptr;          // the forked member's communicator
Leaving leaving_how = Leaving::kInterrupted;
int leave_from_the_exchange(void*) {
  member_waits->store(1);
  switch (leaving_how) {
    case Leaving::kInterrupted:
      return 1;
    case Leaving::kAborted:
      (void)odcCommAbort(leaving_comm, "boom after the colour record");
      return 0;
    case Leaving::kDied:
      raise(SIGKILL);
      return 0;
    case Leaving::kFailed:  // it fails later, at its claim in the group
      return 0;
  }
  return 0;
}

// A member that is interrupted, fails (EMFILE: it cannot claim its slot of the
// group), aborts or dies once its colour record is out never makes its block of the new group.
// The other member used to wait for that block the whole timeout ("timed out ... waiting for rank
// 1 to join key 's...'"); it now sees the member's failure flag or pid in the parent and fails at
// once, naming it. (A timeout of 20 s: a wait that ran it out would be reported as such.)
TEST(Hardening, SplitMemberLeavingAfterItsColourRecordIsNamedNotWaitedFor) {
  member_waits = shared_flag();
  for (const Leaving leaving :
       {Leaving::kInterrupted, Leaving::kFailed, Leaving::kAborted, Leaving::kDied}) {
    member_waits->store(0);
    const auto outcome = odc::testing::run_ranks(
        2,
        [leaving](int rank, int world, const std::string& key) -> std::string {
          odcComm_t comm;
          RANK_CHECK(odcCommInit(&comm, rank, world, key.c_str(), 20.0));
          odcComm_t child = nullptr;
          if (rank == 0) {
            wait_for_flag(member_waits, 1);
            const odcResult_t result = odcCommSplit(comm, 0, 0, &child);
            const std::string message = odcGetLastError();
            RANK_EXPECT(result != odcSuccess && child == nullptr, "the split failed");
            RANK_EXPECT(!contains(message, "timed out"), message);
            RANK_EXPECT(contains(message, "rank 1 will not meet the other members"), message);
            RANK_EXPECT(contains(message, leaving == Leaving::kDied ? "died" : "rank 1 failed"),
                        message);
            (void)odcCommDestroy(comm);
            return "";
          }
          std::vector<int> filler;  // kFailed: every descriptor taken, so no socket for the claim
          rlimit limit{};
          getrlimit(RLIMIT_NOFILE, &limit);
          leaving_comm = comm;
          leaving_how = leaving;
          RANK_CHECK(odcSetInterruptCheck(leave_from_the_exchange, nullptr));
          if (leaving == Leaving::kFailed) {
            rlimit lowered = limit;
            lowered.rlim_cur = std::min<rlim_t>(limit.rlim_cur, 256);
            setrlimit(RLIMIT_NOFILE, &lowered);
            const int any = open("/dev/null", O_RDONLY);
            if (any >= 0) filler.push_back(any);
            for (int fd = dup(any); fd >= 0; fd = dup(any)) filler.push_back(fd);
          }
          const odcResult_t result = odcCommSplit(comm, 0, 0, &child);
          const std::string message = odcGetLastError();
          for (const int fd : filler) close(fd);
          setrlimit(RLIMIT_NOFILE, &limit);
          RANK_CHECK(odcSetInterruptCheck(nullptr, nullptr));
          if (leaving == Leaving::kFailed) {
            RANK_EXPECT(result != odcSuccess && contains(message, "socket"), message);
          }
          if (child != nullptr) (void)odcCommDestroy(child);
          (void)odcCommDestroy(comm);
          return "";
        },
        std::chrono::seconds(60), "split-leaving");
    EXPECT_EQ(outcome[0], "") << static_cast<int>(leaving);
    if (leaving == Leaving::kDied) {
      EXPECT_EQ(outcome[1], "killed by signal 9");
    } else {
      EXPECT_EQ(outcome[1], "") << static_cast<int>(leaving);
    }
  }
}

// The odc names in /dev/shm whose names contain `part`.
std::vector<std::string> shm_names_with(const std::string& part) {
  std::vector<std::string> names;
  if (DIR* directory = opendir("/dev/shm")) {
    while (const dirent* entry = readdir(directory)) {
      const std::string name = entry->d_name;
      if (name.rfind("odc.", 0) == 0 && contains(name, part)) names.push_back(name);
    }
    closedir(directory);
  }
  return names;
}

// What a whole job that is killed (SIGKILL, as schedulers, preemption and torchrun do) during
// an allocation or a split left named, once the next job on the host has started.
std::vector<std::string> names_left_by_a_job_killed_in(bool split) {
  // Rank 0 enters first and its interrupt check sleeps in its wait in the exchange; rank 1 then
  // passes the exchange, makes its name (its allocation segment, or its block of the split
  // group) and waits for rank 0, where its interrupt check stops it for good and tells the test,
  // which kills both.
  static std::atomic<int>* stopped = shared_flag();
  static std::atomic<int>* rank0_waits = shared_flag();
  stopped->store(0);
  rank0_waits->store(0);
  const std::string key = "hard-killed-" + std::to_string(getpid()) + (split ? "-s" : "-a");
  const std::vector<std::string> groups_before = shm_names_with("odc.s");
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < 2; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) {
      odcComm_t comm;
      if (odcCommInit(&comm, rank, 2, key.c_str(), 30.0) != odcSuccess) _exit(1);
      if (rank == 0) {
        odcSetInterruptCheck(
            [](void*) {
              rank0_waits->store(1);
              std::this_thread::sleep_for(std::chrono::seconds(5));
              return 0;
            },
            nullptr);
      } else {
        wait_for_flag(rank0_waits, 1);  // rank 0 waits in the exchange: rank 1 passes it
        odcSetInterruptCheck(
            [](void*) {
              stopped->store(1);
              while (true) pause();
              return 0;
            },
            nullptr);
      }
      odcComm_t child = nullptr;
      odcBuffer_t buffer = nullptr;
      void* local = nullptr;
      if (split) {
        (void)odcCommSplit(comm, 0, 0, &child);
      } else {
        (void)odcBufferAlloc(comm, 1 << 16, odcFloat32, 0, &buffer, &local);
      }
      _exit(2);  // never reached: the test kills it first
    }
    pids.push_back(pid);
  }
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (stopped->load() == 0 && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  std::vector<std::string> named;  // what the job had named when it was killed
  for (const std::string& name : shm_names_with(split ? "odc.s" : key)) {
    if (std::find(groups_before.begin(), groups_before.end(), name) == groups_before.end()) {
      named.push_back(name);
    }
  }
  for (const pid_t pid : pids) kill(pid, SIGKILL);
  for (const pid_t pid : pids) waitpid(pid, nullptr, 0);
  EXPECT_EQ(stopped->load(), 1) << "the job never reached the point where it had names";
  EXPECT_FALSE(named.empty()) << "the job had nothing named: the test tests nothing";
  // The next job on the host.
  odcComm_t next;
  EXPECT_EQ(odcCommInit(&next, 0, 1, (key + "-next").c_str(), 10.0), odcSuccess)
      << odcGetLastError();
  odcCommDestroy(next);
  std::vector<std::string> left;
  for (const std::string& name : named) {
    if (access(("/dev/shm/" + name).c_str(), F_OK) == 0) left.push_back(name);
  }
  return left;
}

// A job killed during an allocation or a split used to leave its names for good
// (allocation segments, and split groups' control blocks under random names no later run looks
// for): 9 of 20 such jobs left 32 names holding 67 MB. The next job on the host removes them.
TEST(Hardening, JobKilledDuringAnAllocationOrASplitLeavesNothingOnceTheNextJobStarts) {
  for (int trial = 0; trial < 3; ++trial) {
    for (const bool split : {false, true}) {
      const std::vector<std::string> left = names_left_by_a_job_killed_in(split);
      EXPECT_TRUE(left.empty()) << (split ? "split: " : "allocation: ") << left.front();
    }
  }
}

}  // namespace
