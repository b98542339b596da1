// The cost model of docs/design.md ("Load balancing: exact definitions"): a microbatch costs
// max(floor, c + sum over its samples of (a*L + b*L^2)). Costs are in arbitrary units (seconds
// when a, b, c come from a timing fit).
// The floor is the least time any microbatch takes: launching a training step's kernels from
// the host (framework hooks, autograd, per-layer communication calls) takes a fixed time however
// few tokens it carries, and a short microbatch runs at the host's pace (4 H200s, 1.5b preset:
// microbatches under ~8K tokens took 0.26-0.34 s, against 0.1-0.2 s from c + a L + b L^2;
// docs/benchmarks-archive.md, seventh round). 0 (the default) leaves the model additive.
#pragma once

#include <algorithm>
#include <cstdint>

namespace odc::planner {

struct CostModel {
  double a = 1.0;      // per token
  double b = 0.0;      // per token squared (attention)
  double c = 0.0;      // per microbatch (launch and fixed overhead)
  double floor = 0.0;  // least cost of any microbatch (host-bound launch time); 0: none

  double sample_cost(int64_t num_tokens) const {
    const double length = static_cast<double>(num_tokens);
    return a * length + b * length * length;
  }

  // A microbatch whose samples cost `samples` in total.
  double microbatch(double samples) const { return std::max(floor, c + samples); }
};

}  // namespace odc::planner
