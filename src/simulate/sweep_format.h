// Renderings of a simulator sweep (sweep.h), as `odc simulate` prints them: the JSON document (also
// what the C API returns) and the tables with their decision, byte for byte the command's.
// Beside planner/plan_format.h, which renders plans; this one sits above the simulator it renders.
#pragma once

#include <string>

#include "simulate/decision.h"
#include "simulate/sweep.h"

namespace odc::simulate {

// The document of `odc simulate --format json` (docs/simulate.md), without a trailing newline.
std::string sweep_to_json(const SweepResult& sweep);

// The step-time table, the memory table, the decision line and its line of why: what `odc
// simulate` prints by default.
std::string sweep_to_table(const SweepResult& sweep);

// The decision (decision.h) over the sweep's arms at each rank count, against the GPU memory of
// the memory table; lines without newlines.
DecisionText sweep_decision(const SweepResult& sweep);

}  // namespace odc::simulate
