// C API of the simulator: a structured request (odcSimulateRequest_t) or `odc simulate`'s options,
// and its JSON document, without a process per call. Both become the typed simulate::Sweep (the
// options through the command's own table, tools/cli_options.h) and the document is the command's
// renderer's, so a configuration means the same thing through all three; the documents handed out
// are recorded until odcSimulateFree.
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "api/api_errors.h"
#include "odc/odc.h"
#include "simulate/sweep.h"
#include "simulate/sweep_format.h"
#include "tools/cli_options.h"

namespace {

using odc::Result;
using odc::Status;
using odc::api::guarded;
using odc::api::report;
using odc::api::success;

std::mutex documents_mutex;
// The documents of odcSimulateSweep and odcSimulate, until odcSimulateFree.
std::set<const void*> live_documents;

Status invalid(const std::string& message, const char* function = "odcSimulate") {
  return Status::InvalidArgument(std::string(function) + ": " + message);
}

odcSimulateRequest_t default_request() {
  const odc::simulate::Sweep sweep;
  odcSimulateRequest_t r{};
  r.size = sizeof(odcSimulateRequest_t);
  r.magic = ODC_SIMULATE_REQUEST_MAGIC;
  r.version = ODC_SIMULATE_REQUEST_VERSION;
  r.samples_per_rank = sweep.samples.samples_per_rank;
  r.max_tokens = r.max_length = r.layers = r.cost_calibrated_on = ODC_SIMULATE_UNSET;
  r.model = "1.5b";
  r.layer_params = r.other_params = r.cost_a = r.cost_b = r.cost_c = ODC_SIMULATE_UNSET;
  r.cost_floor = 0.0;
  r.minibatches = sweep.minibatches;
  r.task = odcSimulateSft;
  r.minibatches_per_step = sweep.minibatches_per_step;
  r.split = odcSplitOff;
  r.split_exchange = sweep.split_exchange;
  r.microbatch_memory = odcMicrobatchMemoryLbMicro;
  r.gpus_per_node = sweep.gpus_per_node;
  r.nvlink_gbytes = sweep.nvlink_gbytes;
  r.nvlink_collective_gbytes = sweep.nvlink_collective_gbytes;
  r.network_gbits = sweep.network_gbits;
  r.nvlink_latency_us = sweep.nvlink_latency_us;
  r.network_latency_us = sweep.network_latency_us;
  r.forward_fraction = sweep.forward_fraction;
  r.gpu_memory_gbytes = sweep.gpu_memory_gbytes;
  return r;
}

Status check_request_header(const odcSimulateRequest_t& r) {
  if (r.size == sizeof(odcSimulateRequest_t) && r.magic == ODC_SIMULATE_REQUEST_MAGIC &&
      r.version == ODC_SIMULATE_REQUEST_VERSION) {
    return Status::Ok();
  }
  return Status::InvalidArgument(
      "request has size " + std::to_string(r.size) + " and version " + std::to_string(r.version) +
      " (magic " + std::to_string(r.magic) + "); this library reads version " +
      std::to_string(ODC_SIMULATE_REQUEST_VERSION) + " of size " +
      std::to_string(sizeof(odcSimulateRequest_t)) + " (fill it with odcSimulateRequestInit)");
}

template <typename T>
std::optional<T> unless_unset(T value) {
  if (value == static_cast<T>(ODC_SIMULATE_UNSET)) return std::nullopt;
  return value;
}

// The samples, the model and its cost: the fields with an "unset" value.
Status samples_and_model(const odcSimulateRequest_t& r, odc::simulate::Sweep& sweep) {
  if (r.lengths == nullptr) return Status::InvalidArgument("lengths is NULL");
  for (size_t i = 0; i < r.num_samples; ++i) {
    if (r.lengths[i] < 1) {
      return Status::InvalidArgument("lengths[" + std::to_string(i) + "] is " +
                                     std::to_string(r.lengths[i]) + ": lengths are positive");
    }
  }
  sweep.samples.given_lengths.emplace(r.lengths, r.lengths + r.num_samples);
  sweep.samples.samples_per_rank = r.samples_per_rank;
  sweep.samples.max_tokens = unless_unset(r.max_tokens);
  sweep.samples.max_length = unless_unset(r.max_length);
  if (r.model == nullptr) return Status::InvalidArgument("model is NULL");
  sweep.model = r.model;
  sweep.layers = unless_unset(r.layers);
  sweep.layer_params = unless_unset(r.layer_params);
  sweep.other_params = unless_unset(r.other_params);
  if (r.cost_a != ODC_SIMULATE_UNSET) {
    for (double term : {r.cost_a, r.cost_b, r.cost_c, r.cost_floor}) {
      if (!(term >= 0) || !std::isfinite(term)) {
        return Status::InvalidArgument(
            "cost_a, cost_b, cost_c and cost_floor are finite numbers >= 0");
      }
    }
    sweep.cost = odc::planner::CostModel{r.cost_a, r.cost_b, r.cost_c};
    sweep.cost->floor = r.cost_floor;
  }
  sweep.cost_calibrated_on = unless_unset(r.cost_calibrated_on);
  return Status::Ok();
}

Result<odc::simulate::Sweep> to_sweep(const odcSimulateRequest_t& r) {
  odc::simulate::Sweep sweep;
  ODC_RETURN_IF_ERROR(samples_and_model(r, sweep));
  if (r.ranks != nullptr) sweep.ranks.assign(r.ranks, r.ranks + r.num_rank_counts);
  sweep.minibatches = r.minibatches;
  if (r.policies != nullptr) {
    auto policies = odc::simulate::parse_policy_list(r.policies);
    if (!policies.ok()) return policies.status();
    sweep.policies = std::move(policies).value();
  }
  if (r.modes != nullptr) {
    auto modes = odc::simulate::parse_mode_list(r.modes);
    if (!modes.ok()) return modes.status();
    sweep.modes = std::move(modes).value();
  }
  if (r.task != odcSimulateSft && r.task != odcSimulateGrpo)
    return Status::InvalidArgument("unknown task");
  sweep.task = r.task == odcSimulateGrpo ? odc::simulate::Task::kGrpo : odc::simulate::Task::kSft;
  sweep.minibatches_per_step = r.minibatches_per_step;
  if (r.split != odcSplitOff && r.split != odcSplitAuto)
    return Status::InvalidArgument("unknown split");
  sweep.split =
      r.split == odcSplitAuto ? odc::planner::SplitMode::kAuto : odc::planner::SplitMode::kOff;
  sweep.split_exchange = r.split_exchange;
  if (r.microbatch_memory != odcMicrobatchMemoryLbMicro &&
      r.microbatch_memory != odcMicrobatchMemoryCap) {
    return Status::InvalidArgument("unknown microbatch_memory");
  }
  sweep.microbatch_memory = r.microbatch_memory == odcMicrobatchMemoryCap
                                ? odc::planner::MicrobatchMemory::kCap
                                : odc::planner::MicrobatchMemory::kLbMicro;
  if (r.rank_speed != nullptr) {
    sweep.rank_speed.assign(r.rank_speed, r.rank_speed + r.num_rank_speeds);
    for (size_t i = 0; i < r.num_rank_speeds; ++i) {
      if (!(r.rank_speed[i] > 0) || !std::isfinite(r.rank_speed[i])) {
        return Status::InvalidArgument("rank_speed[" + std::to_string(i) +
                                       "] must be a finite number > 0");
      }
    }
  }
  sweep.gpus_per_node = r.gpus_per_node;
  sweep.nvlink_gbytes = r.nvlink_gbytes;
  sweep.nvlink_collective_gbytes = r.nvlink_collective_gbytes;
  sweep.network_gbits = r.network_gbits;
  sweep.nvlink_latency_us = r.nvlink_latency_us;
  sweep.network_latency_us = r.network_latency_us;
  sweep.forward_fraction = r.forward_fraction;
  if (r.transport_path != nullptr) sweep.transport_path = r.transport_path;
  sweep.gpu_memory_gbytes = r.gpu_memory_gbytes;
  return sweep;
}

// Runs the sweep and hands out its document (with the newline `odc simulate --format json` prints).
odcResult_t run(const odc::simulate::Sweep& request, char** json, const char* function) {
  auto sweep = odc::simulate::run_sweep(request);
  if (!sweep.ok()) return report(invalid(sweep.status().message(), function));
  const std::string text = odc::simulate::sweep_to_json(sweep.value()) + "\n";
  char* document = new char[text.size() + 1];
  std::memcpy(document, text.c_str(), text.size() + 1);
  {
    std::lock_guard<std::mutex> lock(documents_mutex);
    live_documents.insert(document);
  }
  *json = document;
  return success();
}

}  // namespace

extern "C" odcResult_t odcSimulate(const char* const* args, size_t num_args, const int64_t* lengths,
                                   size_t num_samples, char** json) {
  return guarded([&]() -> odcResult_t {
    if (json == nullptr) return report(invalid("json is NULL"));
    if (args == nullptr && num_args != 0) return report(invalid("args is NULL"));
    if (lengths == nullptr && num_samples != 0) return report(invalid("lengths is NULL"));
    // CLI11 parses argv from its second entry on; the first names the program.
    std::vector<const char*> argv{"odc simulate"};
    for (size_t i = 0; i < num_args; ++i) {
      if (args[i] == nullptr) return report(invalid("args[" + std::to_string(i) + "] is NULL"));
      argv.push_back(args[i]);
    }
    CLI::App command("odc simulate");
    odc::tools::SimulateArgs cli;
    odc::tools::add_simulate_options(command, cli);
    if (lengths != nullptr) {
      // The lengths come from the caller: --lengths may not name a file as well.
      command.get_option("--lengths")->required(false);
    }
    try {
      command.parse(static_cast<int>(argv.size()), argv.data());
    } catch (const CLI::ParseError& error) {
      return report(invalid(odc::tools::parse_error_message(
          error, command, std::vector<std::string>(argv.begin() + 1, argv.end()))));
    }
    if (lengths != nullptr) {
      if (command.count("--lengths") != 0) {
        return report(invalid("pass lengths or --lengths, not both"));
      }
      for (size_t i = 0; i < num_samples; ++i) {
        if (lengths[i] < 1) {
          return report(invalid("lengths[" + std::to_string(i) + "] is " +
                                std::to_string(lengths[i]) + ": lengths are positive"));
        }
      }
      cli.samples.given_lengths.emplace(lengths, lengths + num_samples);
    }
    if (command.count("--format") != 0 && cli.format != "json") {
      return report(invalid("--format " + cli.format + ": the document is always JSON"));
    }
    cli.format = "json";
    auto request = odc::tools::to_sweep(cli);
    if (!request.ok()) return report(invalid(request.status().message()));
    return run(request.value(), json, "odcSimulate");
  });
}

extern "C" odcResult_t odcSimulateRequestInit(odcSimulateRequest_t* request, size_t size) {
  return guarded([&]() -> odcResult_t {
    constexpr const char* kFunction = "odcSimulateRequestInit";
    if (request == nullptr) return report(invalid("request is NULL", kFunction));
    if (size != sizeof(odcSimulateRequest_t)) {
      return report(invalid("size " + std::to_string(size) +
                                ", but this library's request has size " +
                                std::to_string(sizeof(odcSimulateRequest_t)),
                            kFunction));
    }
    *request = default_request();
    return success();
  });
}

extern "C" odcResult_t odcSimulateSweep(const odcSimulateRequest_t* request, char** json) {
  return guarded([&]() -> odcResult_t {
    constexpr const char* kFunction = "odcSimulateSweep";
    if (json == nullptr) return report(invalid("json is NULL", kFunction));
    if (request == nullptr) return report(invalid("request is NULL", kFunction));
    if (Status header = check_request_header(*request); !header.ok()) {
      return report(invalid(header.message(), kFunction));
    }
    auto sweep = to_sweep(*request);
    if (!sweep.ok()) return report(invalid(sweep.status().message(), kFunction));
    return run(sweep.value(), json, kFunction);
  });
}

extern "C" odcResult_t odcSimulateFree(char* json) {
  return guarded([&]() -> odcResult_t {
    if (json == nullptr) return success();
    {
      std::lock_guard<std::mutex> lock(documents_mutex);
      if (live_documents.erase(json) == 0) {
        return report(Status::InvalidArgument(
            "odcSimulateFree: not a document from odcSimulate (freed, or not made by this "
            "library)"));
      }
    }
    delete[] json;
    return success();
  });
}
