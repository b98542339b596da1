// The data kernels' grid rules on the CPU (kernels/grid_size.h): how many blocks per peer a
// gather (reads of peer memory) and a push or copy (writes) launch, for the SM budget, the
// number of peers and the bytes per peer.
#include <gtest/gtest.h>

#include "kernels/grid_size.h"

namespace odc::kernels {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

TEST(GridSize, WritesUseTwoBlocksPerSmSharedByThePeers) {
  EXPECT_EQ(write_blocks_per_job(132, 0, 4, 256 * kMiB), 66);
  EXPECT_EQ(write_blocks_per_job(132, 0, 2, 256 * kMiB), 132);
  EXPECT_EQ(write_blocks_per_job(16, 0, 4, 256 * kMiB), 8);  // ODC_CUDA_SMS=16
}

TEST(GridSize, ReadsKeepAboutTwentyFourBlocksOnRemoteOwners) {
  // 8 per owner on 4 ranks (3 remote owners), 24 on 2, 3 on 8, where writes take every SM.
  EXPECT_EQ(read_blocks_per_job(132, 0, 4, 256 * kMiB), 8);
  EXPECT_EQ(read_blocks_per_job(132, 0, 2, 256 * kMiB), 24);
  EXPECT_EQ(read_blocks_per_job(132, 0, 8, 256 * kMiB), 3);  // 24 / 7 rounds down
  EXPECT_EQ(read_blocks_per_job(132, 0, 4, 256 * kMiB) * 3, kRemoteReadBlocks);
  EXPECT_EQ(read_blocks_per_job(132, 0, 1, 256 * kMiB), 264);  // one rank: a local copy
  EXPECT_EQ(read_blocks_per_job(132, 0, 32, 256 * kMiB), 1);   // at least one per owner
}

TEST(GridSize, ReadsStayWithinASmallerSmBudget) {
  EXPECT_EQ(read_blocks_per_job(8, 0, 4, 256 * kMiB), 4);    // ODC_CUDA_SMS=8: 16 blocks in all
  EXPECT_EQ(read_blocks_per_job(32, 0, 2, 256 * kMiB), 24);  // odc.train's budget of 32 SMs
  EXPECT_EQ(read_blocks_per_job(1, 0, 8, 256 * kMiB), 1);    // never zero
}

TEST(GridSize, SmallTransfersTakeOneBlockPer16KiB) {
  EXPECT_EQ(write_blocks_per_job(132, 0, 4, 64 << 10), 4);
  EXPECT_EQ(read_blocks_per_job(132, 0, 4, 64 << 10), 4);
  EXPECT_EQ(read_blocks_per_job(132, 0, 4, 100), 1);
  EXPECT_EQ(write_blocks_per_job(132, 0, 4, 0), 1);
}

TEST(GridSize, AnExplicitBlockCountIsSharedByThePeers) {
  EXPECT_EQ(read_blocks_per_job(132, 264, 4, 256 * kMiB), 66);  // the lab's sweeps
  EXPECT_EQ(write_blocks_per_job(132, 2, 4, 256 * kMiB), 1);
}

}  // namespace
}  // namespace odc::kernels
