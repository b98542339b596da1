// Renderings of a simulator sweep (sweep.h), as `odc simulate` prints them: the JSON document (also
// what the C API returns) and the tables with their verdict line, byte for byte the command's.
// Beside planner/plan_format.h, which renders plans; this one sits above the simulator it renders.
#pragma once

#include <string>

#include "simulate/sweep.h"

namespace odc::simulate {

// The document of `odc simulate --format json` (docs/simulate.md), without a trailing newline.
std::string sweep_to_json(const SweepResult& sweep);

// The step-time table, the memory table, the verdict line and, where splitting would pay, the
// hint: what `odc simulate` prints by default.
std::string sweep_to_table(const SweepResult& sweep);

// The one verdict line (no newline): the fastest arm that fits at each rank count, its speedup
// over collective + lb-micro, and the assumptions of the simulated time.
std::string sweep_verdict(const SweepResult& sweep);

}  // namespace odc::simulate
