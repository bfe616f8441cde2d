// Runs a program as a subprocess for the CLI tests (tests/cli and
// tests/plugin_loader): the command goes through /bin/sh with stdout and
// stderr redirected to temporary files, so a test can assert the exit status
// and the content of both streams separately. A child killed by a signal
// (a crash) is reported as such, never as an ordinary exit status.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace modalities::testing {

struct CommandResult {
  std::string command;
  int exit_code = -1;  // -1 when the child did not exit normally
  int signal = 0;      // the signal that killed it, if one did
  std::string out, err;
};

inline std::ostream& operator<<(std::ostream& os, const CommandResult& r) {
  os << "command: " << r.command << "\n";
  if (r.signal != 0) os << "killed by signal " << r.signal << "\n";
  else os << "exit status " << r.exit_code << "\n";
  return os << "--- stdout ---\n" << r.out << "--- stderr ---\n" << r.err;
}

/// Single-quotes `s` for /bin/sh.
inline std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

/// Runs `argv` with extra environment variables `env` (NAME, value) set for the child only.
inline CommandResult run_command(const std::vector<std::string>& argv,
                                 const std::vector<std::pair<std::string, std::string>>& env = {}) {
  namespace fs = std::filesystem;
  static int counter = 0;
  const std::string base =
      (fs::temp_directory_path() / ("modalities_cmd_" + std::to_string(::getpid()) + "_" + std::to_string(counter++)))
          .string();
  const std::string out_file = base + ".out", err_file = base + ".err";

  CommandResult r;
  // `exec env ...` replaces the shell, so a signal reaches std::system as a signal.
  r.command = "exec env";
  for (const auto& [name, value] : env) r.command += " " + name + "=" + shell_quote(value);
  for (const auto& a : argv) r.command += " " + shell_quote(a);
  const std::string full = r.command + " </dev/null >" + shell_quote(out_file) + " 2>" + shell_quote(err_file);

  const int status = std::system(full.c_str());
  if (status != -1 && WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  if (status != -1 && WIFSIGNALED(status)) r.signal = WTERMSIG(status);
  auto slurp = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  r.out = slurp(out_file);
  r.err = slurp(err_file);
  std::error_code ec;
  fs::remove(out_file, ec);
  fs::remove(err_file, ec);
  return r;
}

}  // namespace modalities::testing
