// C API of the simulator: `odc simulate`'s options and its JSON document, without a process per
// call. The options are parsed by the command's own table (tools/cli_options.h) into the same
// typed request (simulate::Sweep), so a configuration means the same thing through both; the
// documents it hands out are recorded until odcSimulateFree.
#include <CLI/CLI.hpp>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "api/api_errors.h"
#include "odc/odc.h"
#include "simulate/sweep.h"
#include "simulate/sweep_format.h"
#include "tools/cli_options.h"

namespace {

using odc::Status;
using odc::api::guarded;
using odc::api::report;
using odc::api::success;

std::mutex documents_mutex;
std::set<const void*> live_documents;  // odcSimulate's, until odcSimulateFree

Status invalid(const std::string& message) {
  return Status::InvalidArgument("odcSimulate: " + message);
}

// Runs the sweep and hands out its document (with the newline `odc simulate --format json` prints).
odcResult_t run(const odc::simulate::Sweep& request, char** json) {
  auto sweep = odc::simulate::run_sweep(request);
  if (!sweep.ok()) return report(invalid(sweep.status().message()));
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
      return report(invalid(odc::tools::parse_error_message(error)));
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
    return run(request.value(), json);
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
