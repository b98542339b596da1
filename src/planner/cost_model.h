// The cost model of design.md: a microbatch costs c + sum over its samples of (a*L + b*L^2).
// Costs are in arbitrary units (seconds when a, b, c come from a timing fit).
#pragma once

#include <cstdint>

namespace odc::planner {

struct CostModel {
  double a = 1.0;  // per token
  double b = 0.0;  // per token squared (attention)
  double c = 0.0;  // per microbatch (launch and fixed overhead)

  double sample_cost(int64_t num_tokens) const {
    const double length = static_cast<double>(num_tokens);
    return a * length + b * length * length;
  }
};

}  // namespace odc::planner
