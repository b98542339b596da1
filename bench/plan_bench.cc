// Planner throughput: plans N samples in minibatches of M for R ranks and prints a table.
// Usage: odc_plan_bench [num_samples] [minibatch_size] [ranks] [policy]
// Defaults match the target: 1,000,000 samples, M = 512, 64 ranks, lb-mini.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "planner/plan.h"

int main(int argc, char** argv) {
  const int64_t num_samples = argc > 1 ? std::atoll(argv[1]) : 1000000;
  const int64_t minibatch_size = argc > 2 ? std::atoll(argv[2]) : 512;
  const int64_t ranks = argc > 3 ? std::atoll(argv[3]) : 64;
  const std::string policy_name = argc > 4 ? argv[4] : "lb-mini";
  auto policy = odc::planner::parse_policy(policy_name);
  if (!policy.ok()) {
    std::fprintf(stderr, "%s\n", policy.status().message().c_str());
    return 2;
  }
  // Long-tailed lengths like long-context SFT: log-normal, capped at 64K.
  std::mt19937_64 rng(2026);
  std::lognormal_distribution<double> dist(9.2, 1.0);
  std::vector<int64_t> lengths(static_cast<size_t>(num_samples));
  for (auto& length : lengths)
    length = std::clamp<int64_t>(static_cast<int64_t>(dist(rng)), 1, 65536);

  odc::planner::PlanOptions options;
  options.num_ranks = ranks;
  options.max_tokens = 65536;
  options.minibatch_size = minibatch_size;
  options.policy = policy.value();
  options.cost = {2.7401178e-4, 4.2464424e-9, 0.0};

  std::printf("%-10s %10s %8s %6s %10s %12s %10s\n", "policy", "samples", "mb_size", "ranks",
              "seconds", "samples/s", "odc bubble");
  for (int repeat = 0; repeat < 3; ++repeat) {
    const auto start = std::chrono::steady_clock::now();
    auto plan = odc::planner::make_plan(lengths, options);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!plan.ok()) {
      std::fprintf(stderr, "%s\n", plan.status().message().c_str());
      return 1;
    }
    std::printf("%-10s %10lld %8lld %6lld %10.3f %12.0f %9.2f%%\n", policy_name.c_str(),
                static_cast<long long>(num_samples), static_cast<long long>(minibatch_size),
                static_cast<long long>(ranks), seconds, num_samples / seconds,
                100.0 * plan.value().bubble.odc);
  }
  return 0;
}
