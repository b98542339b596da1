// C API of the planner: validates handles and pointers, then delegates to odc::planner. Plans and
// lengths arrays it hands out are recorded, so a garbage, destroyed or foreign pointer is refused
// before anything reads or frees it.
#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "api/api_errors.h"
#include "odc/odc.h"
#include "planner/plan.h"
#include "planner/plan_format.h"
#include "planner/plan_io.h"
#include "planner/steal.h"

struct odcPlan {
  odc::planner::Plan plan;
  std::string json;  // rendered on first request
};

namespace {

using odc::Status;
using odc::api::guarded;
using odc::api::report;
using odc::api::success;

Status null_argument(const char* function, const char* name) {
  return Status::InvalidArgument(std::string(function) + ": " + name + " is NULL");
}

std::mutex handed_out_mutex;
std::set<const void*> live_plans;    // odcPlanCreate's, until odcPlanDestroy
std::set<const void*> live_lengths;  // odcLengthsRead's, until odcLengthsFree

void hand_out(std::set<const void*>& live, const void* pointer) {
  std::lock_guard<std::mutex> lock(handed_out_mutex);
  live.insert(pointer);
}

// Ok when `pointer` is live in `live` (and, with `take`, no longer from now on).
Status check_live(std::set<const void*>& live, const void* pointer, const char* function,
                  const char* what, bool take = false) {
  std::lock_guard<std::mutex> lock(handed_out_mutex);
  const auto found = live.find(pointer);
  if (found == live.end()) {
    return Status::InvalidArgument(std::string(function) + ": " + what +
                                   " (destroyed, freed, or not made by this library)");
  }
  if (take) live.erase(found);
  return Status::Ok();
}

// The defaults live in the public header (ODC_PLAN_OPTIONS_INIT) only; odcPlanOptionsInit copies
// them. The header documents the size of version 1 and the planner's split exchange default.
constexpr odcPlanOptions_t kDefaultOptions = ODC_PLAN_OPTIONS_INIT;
static_assert(sizeof(odcPlanOptions_t) == 128, "odc.h documents version 2 as 128 bytes");
// Version 1 ended after cost_floor; a caller built against it passes that size and version.
constexpr size_t kVersion1Size = offsetof(odcPlanOptions_t, cost_floor) + sizeof(double);
static_assert(kVersion1Size == 120, "odc.h documents version 1 as 120 bytes");
static_assert(kDefaultOptions.split_exchange == odc::planner::kDefaultSplitExchange);

// The caller's options header: Ok when it is one this library reads (odc.h, "Compatibility").
// Reads the first 16 bytes only, which every layout of odcPlanOptions_t has (the unversioned one
// held num_ranks and max_tokens there): nothing else is read or written before this passes.
Status check_header(const odcPlanOptions_t* options, const char* function) {
  if (options->magic == ODC_PLAN_OPTIONS_MAGIC &&
      ((options->version == ODC_PLAN_OPTIONS_VERSION &&
        options->size == sizeof(odcPlanOptions_t)) ||
       (options->version == 1 && options->size == kVersion1Size))) {
    return Status::Ok();
  }
  char magic[16];
  std::snprintf(magic, sizeof(magic), "0x%08x", options->magic);
  return Status::InvalidArgument(
      std::string(function) + ": options have size " + std::to_string(options->size) + ", magic " +
      magic + " and version " + std::to_string(options->version) + "; this library reads version " +
      std::to_string(ODC_PLAN_OPTIONS_VERSION) + " (size " +
      std::to_string(sizeof(odcPlanOptions_t)) + ") or 1 (size " + std::to_string(kVersion1Size) +
      "): declare them with ODC_PLAN_OPTIONS_INIT (a caller built against an odc header without "
      "it must be rebuilt)");
}

}  // namespace

extern "C" odcResult_t odcPlanOptionsInit(odcPlanOptions_t* options) {
  if (options == nullptr) return report(null_argument("odcPlanOptionsInit", "options"));
  if (Status header = check_header(options, "odcPlanOptionsInit"); !header.ok()) {
    return report(header);
  }
  // The header's defaults, past the header, up to the caller's size (check_header accepted it:
  // version 1's 120 bytes or version 2's whole struct), so an older caller's fields only.
  constexpr size_t header_bytes = offsetof(odcPlanOptions_t, num_ranks);
  std::memcpy(reinterpret_cast<char*>(options) + header_bytes,
              reinterpret_cast<const char*>(&kDefaultOptions) + header_bytes,
              options->size - header_bytes);
  return success();
}

extern "C" odcResult_t odcPolicyFromName(const char* name, odcPolicy_t* policy) {
  if (name == nullptr) return report(null_argument("odcPolicyFromName", "name"));
  if (policy == nullptr) return report(null_argument("odcPolicyFromName", "policy"));
  auto parsed = odc::planner::parse_policy(name);
  if (!parsed.ok()) return report(parsed.status());
  *policy = static_cast<odcPolicy_t>(parsed.value());
  return success();
}

extern "C" odcResult_t odcPlanCreate(const int64_t* lengths, size_t num_samples,
                                     const odcPlanOptions_t* options, odcPlan_t* plan) {
  return guarded([&]() -> odcResult_t {
    if (lengths == nullptr && num_samples > 0) {
      return report(null_argument("odcPlanCreate", "lengths"));
    }
    if (options == nullptr) return report(null_argument("odcPlanCreate", "options"));
    if (plan == nullptr) return report(null_argument("odcPlanCreate", "plan"));
    if (Status header = check_header(options, "odcPlanCreate"); !header.ok()) return report(header);
    const int policy = odc::api::raw_enum_value(options->policy);
    if (policy < odcPolicyLocalSort || policy > odcPolicyLbMini) {
      return report(
          Status::InvalidArgument("odcPlanCreate: unknown policy value " + std::to_string(policy)));
    }
    const int split = odc::api::raw_enum_value(options->split);
    if (split != odcSplitOff && split != odcSplitAuto) {
      return report(
          Status::InvalidArgument("odcPlanCreate: unknown split value " + std::to_string(split)));
    }
    const int memory = odc::api::raw_enum_value(options->microbatch_memory);
    if (memory != odcMicrobatchMemoryLbMicro && memory != odcMicrobatchMemoryCap) {
      return report(Status::InvalidArgument("odcPlanCreate: unknown microbatch_memory value " +
                                            std::to_string(memory)));
    }
    odc::planner::PlanOptions plan_options;
    plan_options.num_ranks = options->num_ranks;
    plan_options.max_tokens = options->max_tokens;
    plan_options.policy = static_cast<odc::planner::Policy>(policy);
    plan_options.minibatch_size = options->minibatch_size;
    plan_options.cost = {options->cost_a, options->cost_b, options->cost_c, options->cost_floor};
    plan_options.split =
        split == odcSplitAuto ? odc::planner::SplitMode::kAuto : odc::planner::SplitMode::kOff;
    plan_options.split_exchange = options->split_exchange;
    plan_options.steal = options->version >= 2 && options->steal != 0;  // version 2's field
    plan_options.microbatch_memory = memory == odcMicrobatchMemoryCap
                                         ? odc::planner::MicrobatchMemory::kCap
                                         : odc::planner::MicrobatchMemory::kLbMicro;
    if (options->rank_speed != nullptr) {
      // The header's contract: one speed per rank, checked by the planner (with this message).
      // A count of 0 would reach it as no speeds at all, which it plans as uniform: refused here.
      if (options->num_rank_speeds == 0) {
        return report(Status::InvalidArgument(
            "rank_speed must have one entry per rank: got 0 for " +
            std::to_string(options->num_ranks) + " ranks (rank_speed NULL: uniform speeds)"));
      }
      plan_options.rank_speed.assign(options->rank_speed,
                                     options->rank_speed + options->num_rank_speeds);
    } else if (options->num_rank_speeds != 0) {
      return report(null_argument("odcPlanCreate", "options->rank_speed"));
    }
    auto result = odc::planner::make_plan(
        std::span<const int64_t>(lengths, lengths ? num_samples : 0), plan_options);
    if (!result.ok()) return report(result.status());
    *plan = new odcPlan{std::move(result).value(), {}};
    hand_out(live_plans, *plan);
    return success();
  });
}

extern "C" odcResult_t odcPlanGetBubble(odcPlan_t plan, double* collective, double* odc) {
  return guarded([&]() -> odcResult_t {
    if (plan == nullptr) return report(null_argument("odcPlanGetBubble", "plan"));
    if (collective == nullptr) return report(null_argument("odcPlanGetBubble", "collective"));
    if (odc == nullptr) return report(null_argument("odcPlanGetBubble", "odc"));
    if (Status live = check_live(live_plans, plan, "odcPlanGetBubble", "not a live plan");
        !live.ok()) {
      return report(live);
    }
    *collective = plan->plan.bubble.collective;
    *odc = plan->plan.bubble.odc;
    return success();
  });
}

extern "C" odcResult_t odcPlanToJson(odcPlan_t plan, const char** json) {
  return guarded([&]() -> odcResult_t {
    if (plan == nullptr) return report(null_argument("odcPlanToJson", "plan"));
    if (json == nullptr) return report(null_argument("odcPlanToJson", "json"));
    if (Status live = check_live(live_plans, plan, "odcPlanToJson", "not a live plan");
        !live.ok()) {
      return report(live);
    }
    if (plan->json.empty()) plan->json = odc::planner::plan_to_json(plan->plan);
    *json = plan->json.c_str();
    return success();
  });
}

extern "C" odcResult_t odcPlanDestroy(odcPlan_t plan) {
  return guarded([&]() -> odcResult_t {
    if (plan == nullptr) return success();
    if (Status live = check_live(live_plans, plan, "odcPlanDestroy", "not a live plan", true);
        !live.ok()) {
      return report(live);
    }
    delete plan;
    return success();
  });
}

extern "C" odcResult_t odcStealSimulate(int num_ranks, const int64_t* counts,
                                        const double* predicted, const double* actual,
                                        const double* rank_speed, const double* rank_start,
                                        double* span, double* finish, double* busy, int64_t* runner,
                                        int64_t* num_moved) {
  return guarded([&]() -> odcResult_t {
    if (num_ranks < 0) {
      return report(Status::InvalidArgument("odcStealSimulate: num_ranks must be >= 0, got " +
                                            std::to_string(num_ranks)));
    }
    const auto ranks = static_cast<size_t>(num_ranks);
    if (counts == nullptr && ranks > 0) return report(null_argument("odcStealSimulate", "counts"));
    const std::span<const int64_t> count_span(counts, counts ? ranks : 0);
    size_t num_items = 0;
    for (int64_t count : count_span) num_items += count > 0 ? static_cast<size_t>(count) : 0;
    if (predicted == nullptr && num_items > 0) {
      return report(null_argument("odcStealSimulate", "predicted"));
    }
    auto rank_values = [&](const double* values) {
      return std::span<const double>(values, values ? ranks : 0);
    };
    odc::planner::StealInput input;
    input.counts = count_span;
    input.predicted = std::span<const double>(predicted, predicted ? num_items : 0);
    input.actual = std::span<const double>(actual, actual ? num_items : 0);
    input.rank_speed = rank_values(rank_speed);
    input.rank_start = rank_values(rank_start);
    auto result = odc::planner::simulate_stealing(input);  // checks the counts first
    if (!result.ok()) return report(result.status());
    const odc::planner::StealResult& played = result.value();
    if (span != nullptr) *span = played.span;
    if (finish != nullptr) std::copy(played.finish.begin(), played.finish.end(), finish);
    if (busy != nullptr) std::copy(played.busy.begin(), played.busy.end(), busy);
    if (runner != nullptr) std::copy(played.runner.begin(), played.runner.end(), runner);
    if (num_moved != nullptr) *num_moved = played.num_moved;
    return success();
  });
}

extern "C" odcResult_t odcLengthsRead(const char* path, int64_t** lengths, size_t* num_samples) {
  return guarded([&]() -> odcResult_t {
    if (path == nullptr) return report(null_argument("odcLengthsRead", "path"));
    if (lengths == nullptr) return report(null_argument("odcLengthsRead", "lengths"));
    if (num_samples == nullptr) return report(null_argument("odcLengthsRead", "num_samples"));
    auto read = odc::planner::read_lengths_file(path);
    if (!read.ok()) return report(read.status());
    const std::vector<int64_t>& values = read.value();
    auto* out = new int64_t[values.empty() ? 1 : values.size()];
    std::copy(values.begin(), values.end(), out);
    *lengths = out;
    *num_samples = values.size();
    hand_out(live_lengths, out);
    return success();
  });
}

extern "C" odcResult_t odcLengthsFree(int64_t* lengths) {
  return guarded([&]() -> odcResult_t {
    if (lengths == nullptr) return success();
    if (Status live = check_live(live_lengths, lengths, "odcLengthsFree",
                                 "not an array from odcLengthsRead", true);
        !live.ok()) {
      return report(live);
    }
    delete[] lengths;
    return success();
  });
}
