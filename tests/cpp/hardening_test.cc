// Hardening of the communicator C API against hostile sizes (issue #18): every size product the
// runtime derives from a count must be checked, never wrapped.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdint>
#include <string>

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

}  // namespace
