// Renderings of a plan: the JSON contract of `odc plan` (also what the C API and Python return)
// and readable tables.
#pragma once

#include <string>
#include <vector>

#include "planner/plan.h"

namespace odc::planner {

// {"policy", "ranks", "max_tokens", "cost", "minibatches": [...], "bubble"} exactly as documented
// in docs/planner.md. Deterministic: the same plan gives the same bytes.
std::string plan_to_json(const Plan& plan);

// A summary of one plan: microbatch counts and predicted bubbles.
std::string plan_to_table(const Plan& plan);

// One row per plan (same lengths, different policies): the comparison the main job prints.
std::string compare_table(const std::vector<Plan>& plans);

}  // namespace odc::planner
