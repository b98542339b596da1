// The option tables of `odc` (cli_options.h). Integer options check their text (int64_range);
// every other check is the library's, so the C API and the command refuse the same things in the
// same words.
#include "tools/cli_options.h"

#include <charconv>
#include <climits>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <utility>
#include <vector>

#include "planner/plan_io.h"

namespace odc::tools {
namespace {

// The type name of the options that take a list (--ranks of simulate, --cost, ...): shown by
// --help, and how parse_error_message knows to suggest joining stray values with commas.
constexpr const char* kListForm = "LIST";

// "RANK:FACTOR" of --rank-slowdown; whether the rank exists is the sweep's to check.
Result<std::pair<int64_t, double>> parse_rank_slowdown(const std::string& text) {
  const std::string usage = "--rank-slowdown " + planner::quote_text(text) +
                            ": expected RANK:FACTOR, e.g. 3:1.3 (rank 3 runs 1.3x slower)";
  const size_t colon = text.find(':');
  if (colon == std::string::npos) return Status::InvalidArgument(usage);
  int64_t rank = 0;
  const char* begin = text.data();
  const auto parsed_rank = std::from_chars(begin, begin + colon, rank);
  if (parsed_rank.ec != std::errc() || parsed_rank.ptr != begin + colon) {
    return Status::InvalidArgument(usage);
  }
  const std::string factor_text = text.substr(colon + 1);
  char* end = nullptr;
  const double factor = factor_text.empty() ? 0.0 : std::strtod(factor_text.c_str(), &end);
  if (factor_text.empty() || end != factor_text.c_str() + factor_text.size()) {
    return Status::InvalidArgument(usage);
  }
  return std::pair<int64_t, double>{rank, factor};
}

Result<std::vector<int64_t>> parse_int_list(const std::string& text, const std::string& what) {
  std::vector<int64_t> values;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    try {
      size_t used = 0;
      const long long value = std::stoll(item, &used);
      if (used != item.size() || value < 1) throw std::invalid_argument(item);
      values.push_back(value);
    } catch (const std::exception&) {
      return Status::InvalidArgument(what + ": '" + item + "' is not a positive integer");
    }
  }
  if (values.empty()) return Status::InvalidArgument(what + " is empty");
  return values;
}

// The model and cost options of `odc simulate`.
void add_model_options(CLI::App& command, SimulateArgs& args) {
  command.add_option("--model", args.model, "preset: tiny, 0.5b, 1.5b or 7b")
      ->capture_default_str();
  command.add_option("--layers", args.layers, "custom model: transformer layers");
  command.add_option("--layer-params", args.layer_params, "custom model: parameters per layer");
  command.add_option("--other-params", args.other_params,
                     "custom model: parameters outside the layers (embeddings, head)");
  add_cost_option(command, args.planner.cost,
                  "microbatch cost in seconds, C + sum(A*L + B*L^2), as A,B,C, or A,B,C,F with "
                  "a floor F per microbatch (default: the preset's fit on H200, from odc.train)");
  command.add_option("--cost-calibrated-on", args.cost_calibrated_on,
                     "GPUs of one node the cost was fitted on under FSDP2 (odc.train's fit): its "
                     "exposed collective time is removed from the cost (default: 4 with the "
                     "preset's cost, else 0 = the cost is compute alone)");
}

// What to sweep: rank counts, minibatches, policies, modes, the task and the split.
void add_arm_options(CLI::App& command, SimulateArgs& args) {
  command.add_option("--ranks", args.ranks, "rank counts, comma-separated")
      ->capture_default_str()
      ->type_name(kListForm);
  command
      .add_option("--minibatches", args.minibatches,
                  "minibatches per configuration (the file is repeated, reshuffled, when it "
                  "has too few samples)")
      ->capture_default_str();
  command
      .add_option("--policies", args.policies,
                  "local-sort, lb-micro, lb-mini, lb-mini-padded (LB-Mini padded to equal "
                  "microbatch counts with empty microbatches), comma-separated")
      ->capture_default_str()
      ->type_name(kListForm);
  add_microbatch_memory_option(
      command, args.planner.microbatch_memory,
      "lb-mini's microbatch bound: lb-micro (no larger than lb-micro's) or cap");
  command
      .add_option("--modes", args.modes,
                  "collective, fsdp2-deferred, fsdp2-unsharded, odc, odc-hybrid, comma-separated")
      ->capture_default_str()
      ->type_name(kListForm);
  add_task_option(command, args.task,
                  "sft, or grpo: GRPO's training phase, per RL step of ranks x samples-per-rank "
                  "rollouts two forward-only minibatches (old and reference log-probs) and "
                  "--minibatches-per-step updates; --minibatches then counts RL steps");
  add_minibatches_per_step_option(command, args.task);
  add_split_options(command, args.planner,
                    "auto: also simulate lb-micro+split and lb-mini+split (a sample above the "
                    "minibatch's per-rank share runs on a group of ranks); off");
  add_rank_speed_option(command, args.planner.rank_speed,
                        "relative speed of each rank, S0,S1,... (default: all equal; one rank "
                        "count in --ranks, with as many ranks)");
  command.add_flag("--steal", args.steal,
                   "also simulate each unpadded arm with work stealing (+steal; odc modes): a "
                   "rank out of microbatches takes another's");
  // One value per occurrence (a stray word after it is not a second slowdown); repeatable.
  command
      .add_option("--rank-slowdown", args.rank_slowdown,
                  "RANK:FACTOR: that rank runs FACTOR times slower than planned, in every arm "
                  "(unlike --rank-speed, the planner does not know); repeatable")
      ->allow_extra_args(false);
}

// The machine: links, GPUs per node, GPU memory.
void add_machine_options(CLI::App& command, SimulateArgs& args) {
  command.add_option("--gpus-per-node", args.gpus_per_node)->capture_default_str();
  command
      .add_option("--nvlink-gbytes", args.nvlink_gbytes,
                  "ODC pull/push bandwidth per GPU within a node, GB/s")
      ->capture_default_str();
  command
      .add_option("--nvlink-collective-gbytes", args.nvlink_collective_gbytes,
                  "NCCL all-gather / reduce-scatter bus bandwidth within a node, GB/s")
      ->capture_default_str();
  command.add_option("--network-gbits", args.network_gbits, "NIC bandwidth per GPU, Gb/s")
      ->capture_default_str();
  command.add_option("--nvlink-latency-us", args.nvlink_latency_us)->capture_default_str();
  command.add_option("--network-latency-us", args.network_latency_us)->capture_default_str();
  add_forward_fraction_option(command, args.task,
                              "share of a microbatch's cost in the forward pass, and what a "
                              "forward-only microbatch costs (--task grpo): 1/4 with activation "
                              "checkpointing (odc.train on GPUs), 1/3 without");
  command.add_option("--transport", args.transport_path,
                     "measured curves within a node (JSON; python -m odc.simulate --curves "
                     "converts odc_bench output): they replace the NVLink constants");
  command
      .add_option("--gpu-memory-gbytes", args.gpu_memory_gbytes,
                  "GPU memory, GB: the memory table says whether each layout's state fits")
      ->capture_default_str();
}

}  // namespace

CLI::Validator int64_range() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const char* begin = text.data();
        const char* end = begin + text.size();
        if (begin != end && *begin == '+') ++begin;
        int64_t value = 0;
        if (std::from_chars(begin, end, value).ec == std::errc::result_out_of_range) {
          return "'" + text + "' is out of range: integers here lie within +-" +
                 std::to_string(INT64_MAX);
        }
        return "";  // anything else is CLI11's to convert or refuse
      },
      "");
}

void add_sample_options(CLI::App& command, simulate::SampleSelection& samples,
                        bool deprecated_minibatch_size) {
  command
      .add_option("--lengths", samples.lengths_path,
                  "file with one sample length (tokens) per line; '-' reads stdin")
      ->required();
  CLI::Option* per_rank =
      command
          .add_option("--samples-per-rank", samples.samples_per_rank,
                      "samples per rank per minibatch: a minibatch is ranks x this many "
                      "consecutive samples")
          ->capture_default_str()
          ->check(int64_range());
  if (deprecated_minibatch_size) {
    command
        .add_option("--minibatch-size", samples.minibatch_size,
                    "deprecated: samples per minibatch (use --samples-per-rank)")
        ->excludes(per_rank)
        ->check(int64_range());
  }
  command
      .add_option("--max-tokens", samples.max_tokens,
                  "token cap per microbatch (default: the longest sample)")
      ->check(int64_range());
  command.add_option("--max-length", samples.max_length, "drop samples longer than this")
      ->check(int64_range());
}

void add_cost_option(CLI::App& command, std::string& cost, const std::string& help) {
  CLI::Option* option = command.add_option("--cost", cost, help)->type_name(kListForm);
  if (!cost.empty()) option->capture_default_str();
}

void add_rank_speed_option(CLI::App& command, std::string& rank_speed, const std::string& help) {
  command.add_option("--rank-speed", rank_speed, help)->type_name(kListForm);
}

void add_split_options(CLI::App& command, PlannerArgs& args, const std::string& split_help) {
  command.add_option("--split", args.split, split_help)->capture_default_str();
  command
      .add_option("--split-exchange", args.split_exchange,
                  "K/V exchange cost of a split chunk per token received, as a fraction of A")
      ->capture_default_str();
}

void add_microbatch_memory_option(CLI::App& command, std::string& microbatch_memory,
                                  const std::string& help) {
  command.add_option("--microbatch-memory", microbatch_memory, help)->capture_default_str();
}

void add_task_option(CLI::App& command, TaskArgs& args, const std::string& help) {
  command.add_option("--task", args.task, help)->capture_default_str();
}

void add_minibatches_per_step_option(CLI::App& command, TaskArgs& args) {
  command
      .add_option("--minibatches-per-step", args.minibatches_per_step,
                  "--task grpo: update minibatches per RL step")
      ->capture_default_str()
      ->check(int64_range());
}

void add_forward_fraction_option(CLI::App& command, TaskArgs& args, const std::string& help) {
  command.add_option("--forward-fraction", args.forward_fraction, help)->capture_default_str();
}

void add_simulate_options(CLI::App& command, SimulateArgs& args) {
  add_sample_options(command, args.samples, /*deprecated_minibatch_size=*/false);
  add_model_options(command, args);
  add_arm_options(command, args);
  add_machine_options(command, args);
  command.add_option("--format", args.format, "table or json")->capture_default_str();
  for (const char* name :
       {"--layers", "--cost-calibrated-on", "--minibatches", "--gpus-per-node"}) {
    command.get_option(name)->check(int64_range());
  }
}

Result<simulate::Sweep> to_sweep(const SimulateArgs& args) {
  if (args.format != "table" && args.format != "json") {
    return Status::InvalidArgument("unknown format '" + args.format + "': expected table or json");
  }
  simulate::Sweep sweep;
  auto task = simulate::parse_task(args.task.task);
  if (!task.ok()) return task.status();
  sweep.task = task.value();
  sweep.minibatches_per_step = args.task.minibatches_per_step;
  sweep.forward_fraction = args.task.forward_fraction;
  sweep.samples = args.samples;
  sweep.model = args.model;
  sweep.layers = args.layers;
  sweep.layer_params = args.layer_params;
  sweep.other_params = args.other_params;
  sweep.cost_calibrated_on = args.cost_calibrated_on;
  if (!args.planner.cost.empty()) {
    auto cost = planner::parse_cost(args.planner.cost);
    if (!cost.ok()) return cost.status();
    sweep.cost = cost.value();
  }
  auto ranks = parse_int_list(args.ranks, "--ranks");
  if (!ranks.ok()) return ranks.status();
  sweep.ranks = std::move(ranks).value();
  sweep.minibatches = args.minibatches;
  auto policies = simulate::parse_policy_list(args.policies);
  if (!policies.ok()) return policies.status();
  sweep.policies = std::move(policies).value();
  auto modes = simulate::parse_mode_list(args.modes);
  if (!modes.ok()) return modes.status();
  sweep.modes = std::move(modes).value();
  auto split = planner::parse_split_mode(args.planner.split);
  if (!split.ok()) return split.status();
  sweep.split = split.value();
  sweep.split_exchange = args.planner.split_exchange;
  if (!args.planner.rank_speed.empty()) {
    auto speeds = planner::parse_rank_speed(args.planner.rank_speed);
    if (!speeds.ok()) return speeds.status();
    sweep.rank_speed = std::move(speeds).value();
  }
  auto memory = planner::parse_microbatch_memory(args.planner.microbatch_memory);
  if (!memory.ok()) return memory.status();
  sweep.microbatch_memory = memory.value();
  sweep.steal = args.steal;
  for (const std::string& text : args.rank_slowdown) {
    auto slowdown = parse_rank_slowdown(text);
    if (!slowdown.ok()) return slowdown.status();
    sweep.rank_slowdown.push_back(slowdown.value());
  }
  sweep.gpus_per_node = args.gpus_per_node;
  sweep.nvlink_gbytes = args.nvlink_gbytes;
  sweep.nvlink_collective_gbytes = args.nvlink_collective_gbytes;
  sweep.network_gbits = args.network_gbits;
  sweep.nvlink_latency_us = args.nvlink_latency_us;
  sweep.network_latency_us = args.network_latency_us;
  sweep.transport_path = args.transport_path;
  sweep.gpu_memory_gbytes = args.gpu_memory_gbytes;
  return sweep;
}

namespace {

// How an option's value is written, from its CLI11 type name.
std::string accepted_form(const CLI::Option& option) {
  const std::string type = option.get_type_name();
  if (type == kListForm) return "a comma-separated list without spaces";
  if (type == "INT") return "one integer";
  if (type == "FLOAT") return "one number";
  // A short description is the accepted values themselves ("table, json or csv").
  constexpr size_t kShortDescription = 40;
  const std::string& description = option.get_description();
  if (!description.empty() && description.size() <= kShortDescription) {
    return "one value (" + description + ")";
  }
  return "one value";
}

// `odc compare --ranks 8,16`: compare plans one rank count, simulate sweeps several.
std::string ranks_note(const CLI::Option& option) {
  if (option.get_name() != "--ranks" || option.get_type_name() == kListForm) return "";
  return " (compare plans one rank count; odc simulate --ranks 8,16 compares several)";
}

std::string join(const std::vector<std::string>& words, const char* separator) {
  std::string text;
  for (const std::string& word : words) text += (text.empty() ? "" : separator) + word;
  return text;
}

// "--ranks 8 16 32": the option before the first stray value and every value given to it.
std::string stray_values_message(const CLI::App& command, const std::vector<std::string>& args,
                                 const std::string& first_stray) {
  for (size_t i = 1; i < args.size(); ++i) {
    // A stray value follows another value (or --option=value), never the option itself.
    const std::string& before = args[i - 1];
    const bool after_value = before.rfind("-", 0) != 0 || before.find('=') != std::string::npos;
    if (args[i] != first_stray || !after_value) continue;
    size_t j = i;  // back to the option the values follow
    while (j > 0 && args[j - 1].rfind("-", 0) != 0) --j;
    if (j == 0) return "";
    std::string name = args[j - 1];
    std::vector<std::string> values;
    if (const size_t equals = name.find('='); equals != std::string::npos) {
      values.push_back(name.substr(equals + 1));
      name = name.substr(0, equals);
    }
    const CLI::Option* option = command.get_option_no_throw(name);
    if (option == nullptr) return "";
    for (size_t k = j; k < args.size() && args[k].rfind("-", 0) != 0; ++k) {
      values.push_back(args[k]);
    }
    std::string message =
        name + " takes " + accepted_form(*option) + ", got '" + join(values, " ") + "'";
    if (option->get_type_name() == kListForm) {
      message += ": " + name + " " + join(values, ",");
    }
    return message + ranks_note(*option);
  }
  return "";
}

}  // namespace

std::string parse_error_message(const CLI::ParseError& error, const CLI::App& command,
                                const std::vector<std::string>& args) {
  const std::string message = error.what();
  const int code = error.get_exit_code();
  // "Could not convert: --ranks = 8,16".
  const std::string unconvertible = "Could not convert: ";
  if (code == static_cast<int>(CLI::ExitCodes::ConversionError) &&
      message.rfind(unconvertible, 0) == 0) {
    const size_t equals = message.find(" = ");
    if (equals != std::string::npos) {
      const std::string name = message.substr(unconvertible.size(), equals - unconvertible.size());
      if (const CLI::Option* option = command.get_option_no_throw(name)) {
        return name + " takes " + accepted_form(*option) + ", got '" + message.substr(equals + 3) +
               "'" + ranks_note(*option);
      }
    }
  }
  // "--ranks: At Most 1 required but received 2": the option given more than once.
  const std::string at_most = ": At Most 1 required but received ";
  if (const size_t at = message.find(at_most); at != std::string::npos) {
    const std::string name = message.substr(0, at);
    if (const CLI::Option* option = command.get_option_no_throw(name)) {
      std::vector<std::string> values;
      for (size_t i = 0; i < args.size(); ++i) {
        if (args[i].rfind(name + "=", 0) == 0) values.push_back(args[i].substr(name.size() + 1));
        if (args[i] == name && i + 1 < args.size()) values.push_back(args[i + 1]);
      }
      std::string words = name + " was given " + std::to_string(values.size()) + " times ('" +
                          join(values, "', '") + "'): give it once, as " + accepted_form(*option);
      if (option->get_type_name() == kListForm) words += ": " + name + " " + join(values, ",");
      return words + ranks_note(*option);
    }
  }
  if (code != static_cast<int>(CLI::ExitCodes::ExtrasError)) return message;
  // "The following argument(s) were not expected: 16 32": stray values, unless one is an option
  // (CLI11 names an unknown option well enough).
  const size_t colon = message.find(": ");
  if (colon == std::string::npos) return message;
  std::istringstream words(message.substr(colon + 2));
  std::string first;
  for (std::string word; words >> word;) {
    if (word[0] == '-') return message;
    if (first.empty()) first = word;
  }
  const std::string named = stray_values_message(command, args, first);
  if (!named.empty()) return named;
  return message +
         " (each option takes one value; lists are comma-separated without spaces, e.g. odc "
         "simulate --ranks 8,16,32)";
}

}  // namespace odc::tools
