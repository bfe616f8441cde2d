// Option parsing and reporting shared by the verbs.
#include "cli.h"

#include <fmt/core.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string_view>

namespace modalities::cli {

namespace {
bool color(int fd) { return isatty(fd) != 0 && std::getenv("NO_COLOR") == nullptr; }

// LibTorch's c10::Error messages end in a C++ backtrace ("Exception raised from f at file:line
// (most recent call first):" and a line per frame), which buries the message a user needs; it is
// kept only with TORCH_SHOW_CPP_STACKTRACES=1, PyTorch's switch for the same thing.
std::string without_backtrace(const std::string& message) {
  const char* show = std::getenv("TORCH_SHOW_CPP_STACKTRACES");
  if (show != nullptr && std::string_view(show) == "1") return message;
  const std::size_t at = message.find("\nException raised from ");
  return at == std::string::npos ? message : message.substr(0, at);
}
}  // namespace

void print_error(const std::string& message) {
  std::cerr << (color(2) ? "\033[1;31merror:\033[0m " : "error: ") << without_backtrace(message) << "\n";
}

void print_warning(const std::string& message) {
  std::cerr << (color(2) ? "\033[1;33mwarning:\033[0m " : "warning: ") << message << "\n";
}

po::options_description plugin_options(core::PluginOptions& out) {
  po::options_description d("Plugin options");
  d.add_options()(
      "plugin-path",
      po::value<std::vector<std::string>>()->composing()->notifier([&out](const std::vector<std::string>& v) {
        for (const auto& p : v) out.extra_paths.emplace_back(p);
      }),
      "extra plugin directory or .so file (repeatable); searched after the bundled directory and "
      "MODALITIES_PLUGIN_PATH")("strict-plugins", po::bool_switch(&out.strict),
                                "treat any plugin that fails to load as a fatal error");
  return d;
}

bool load_plugins_or_report(core::PluginHost& host, const core::PluginOptions& options) {
  const auto problems = core::load_plugins(host, options);
  for (const auto& p : problems) print_warning(fmt::format("plugin {}: {}", p.file.string(), p.reason));
  if (!problems.empty() && options.strict) {
    print_error(fmt::format("{} plugin problem(s) and --strict-plugins is set", problems.size()));
    return false;
  }
  return true;
}

bool parse(const std::vector<std::string>& args, const po::options_description& desc,
           const po::positional_options_description& positional, po::variables_map& vm, const std::string& usage,
           int& status) {
  try {
    po::store(po::command_line_parser(args).options(desc).positional(positional).run(), vm);
    if (vm.count("help")) {
      std::cout << usage << "\n\n" << desc << "\n";
      status = kOk;
      return false;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    std::ostringstream options;
    options << desc;
    print_error(fmt::format("{}\n\n{}\n\n{}", e.what(), usage, options.str()));
    status = kUsage;
    return false;
  }
  return true;
}

}  // namespace modalities::cli
