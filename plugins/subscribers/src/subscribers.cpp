// The logging-broker subscribers of Modalities (see
// README.md): `progress_subscriber/{dummy,rich}` and
// `results_subscriber/{dummy,to_disc,rich}`.
//   progress rich  a live progress bar on rank 0 (stderr): step/target, the
//                  latest train loss, lr, tokens/s and ETA; one line per eval pass
//   results to_disc  Modalities' JSONL results file, byte for byte
//   results rich   Modalities' console line "<time> | step: n | k: v | ... | "
//   results wandb  records the W&B run for scripts/wandb_replay.py (no C++ W&B client)
//   results tensorboard  TensorBoard event files (our addition)
#include <modalities/sdk/human_format.h>
#include <modalities/sdk/interfaces/data_loader.h>
#include <modalities/sdk/interfaces/message_subscriber.h>
#include <modalities/sdk/plugin.h>
#include <modalities/sdk/python_format.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace modalities::plugins::subscribers {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// dummy (both components)

struct EmptyConfig {
  static void describe(Schema<EmptyConfig>&) {}
};

class DummySubscriber final : public MessageSubscriber {
 public:
  void consume_message(const Message&) override {}
  void consume_dict(const std::map<std::string, DictValue>&) override {}
};

// ---------------------------------------------------------------------------
// Text form of a result (Modalities' batch.py EvaluationResultBatch.__str__)

// datetime.now().isoformat(timespec="seconds"): local time, no zone.
std::string iso_timestamp() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &local);
  return buf;
}

// str() of a run fact as Python would print it.
std::string dict_value_text(const DictValue& v) {
  if (const auto* b = std::get_if<bool>(&v)) return *b ? "True" : "False";
  if (const auto* i = std::get_if<std::int64_t>(&v)) return fmt::format("{}", *i);
  if (const auto* d = std::get_if<double>(&v)) return py::float_repr(*d);
  return std::get<std::string>(v);
}

// Note [Sharing the terminal]
// The progress bar redraws its line on stderr in place. A results line printed
// to the same terminal would land after the bar's text, so the console printer
// first clears the current line ("\r\033[K") when stdout is a terminal; the bar
// redraws itself on the next line at its next update.
void print_line(const std::string& line) {
  static const bool tty = ::isatty(1) != 0;
  std::string out = tty ? "\r\033[K" : "";
  out += line;
  out += '\n';
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::fflush(stdout);
}

// ---------------------------------------------------------------------------
// results_subscriber/rich

struct RichResultsConfig {
  std::int64_t num_ranks = 0;
  std::int64_t global_rank = 0;
  bool show_dataloader_tag = false;

  static void describe(Schema<RichResultsConfig>& s) {
    s.field("num_ranks", &RichResultsConfig::num_ranks,
            "Number of ranks (Modalities shows steps x ranks in its panel title; unused by the line format).")
        .required()
        .at_least(1);
    s.field("global_rank", &RichResultsConfig::global_rank, "This process's rank; only rank 0 prints.")
        .required()
        .non_negative();
    s.field("show_dataloader_tag", &RichResultsConfig::show_dataloader_tag,
            "Start each line with 'Dataloader: <tag> | ' (Modalities builds that prefix and drops it). Our addition.");
  }
};

class RichResultsSubscriber final : public MessageSubscriber {
 public:
  explicit RichResultsSubscriber(bool show_tag) : show_tag_(show_tag) {}

  void consume_message(const Message& m) override {
    const auto* r = std::get_if<EvaluationResultBatch>(&m.payload);
    if (r == nullptr) return;
    std::string line = iso_timestamp() + " | ";
    if (show_tag_) line += "Dataloader: " + r->dataloader_tag + " | ";
    print_line(line + result_line(*r));
  }

  // Modalities raises NotImplementedError here, which ends every training
  // run on rank 0 (quirk 12); we print the facts instead.
  void consume_dict(const std::map<std::string, DictValue>& values) override {
    if (values.empty()) return;
    std::string line = iso_timestamp() + " | ";
    for (const auto& [key, value] : values) line += key + ": " + dict_value_text(value) + " | ";
    print_line(line);
  }

 private:
  bool show_tag_;
};

// ---------------------------------------------------------------------------
// results_subscriber/to_disc

struct ToDiscConfig {
  fs::path output_file_path;

  static void describe(Schema<ToDiscConfig>& s) {
    s.field("output_file_path", &ToDiscConfig::output_file_path,
            "JSONL file that rank 0 appends one line per result to (parent folders are created).")
        .required()
        .non_empty();
  }
};

class ToDiscSubscriber final : public MessageSubscriber {
 public:
  explicit ToDiscSubscriber(fs::path file) : file_(std::move(file)) {
    const fs::path parent = file_.parent_path();
    std::error_code ec;
    if (!parent.empty()) fs::create_directories(parent, ec);
    if (ec)
      throw Error(fmt::format("cannot create the folder '{}' for output_file_path: {}", parent.string(), ec.message()));
  }

  // One line per result on rank 0 (Modalities asks torch.distributed for the
  // rank; the publisher stamps it on every message).
  void consume_message(const Message& m) override {
    const auto* r = std::get_if<EvaluationResultBatch>(&m.payload);
    if (r == nullptr || m.global_rank != 0) return;
    const std::string line = json_line(*r);
    std::FILE* f = std::fopen(file_.c_str(), "ab");
    if (f == nullptr)
      throw Error(fmt::format("cannot open '{}' for appending: {}", file_.string(), std::strerror(errno)));
    const bool written = std::fwrite(line.data(), 1, line.size(), f) == line.size();
    const bool closed = std::fclose(f) == 0;  // flushes: every line is on disk when the call returns
    if (!written || !closed)
      throw Error(fmt::format("cannot write a result line to '{}': {}", file_.string(), std::strerror(errno)));
  }

  void consume_dict(const std::map<std::string, DictValue>&) override {}

  // json.dumps(record) + "\n" with the dataclass fields in declaration order
  // and the metric dicts in insertion order.
  static std::string json_line(const EvaluationResultBatch& r) {
    auto dict = [](const ResultItems& items) {
      std::string s = "{";
      for (std::size_t i = 0; i < items.size(); ++i) {
        if (i > 0) s += ", ";
        s += py::json_string(items[i].first) + ": " + py::json_tensor(items[i].second.value);
      }
      return s + "}";
    };
    return fmt::format(
        "{{\"dataloader_tag\": {}, \"num_train_steps_done\": {}, \"losses\": {}, \"metrics\": {}, "
        "\"throughput_metrics\": {}}}\n",
        py::json_string(r.dataloader_tag), r.num_train_steps_done, dict(r.losses), dict(r.metrics),
        dict(r.throughput_metrics));
  }

 private:
  fs::path file_;
};

// ---------------------------------------------------------------------------
// progress_subscriber/rich

struct RichProgressConfig {
  std::vector<Ref<DataLoader>> eval_dataloaders;
  std::string train_dataloader_tag;
  std::int64_t num_seen_steps = 0;
  std::int64_t num_target_steps = 0;
  std::int64_t global_rank = 0;
  double log_every_percent = 10.0;
  double log_interval_s = 30.0;

  static void describe(Schema<RichProgressConfig>& s) {
    s.field("eval_dataloaders", &RichProgressConfig::eval_dataloaders,
            "Evaluation loaders; each gets a bar whose total is its number of batches.");
    s.field("train_dataloader_tag", &RichProgressConfig::train_dataloader_tag,
            "Tag of the training loader (results with this tag feed loss, lr and tokens/s).")
        .required();
    s.field("num_seen_steps", &RichProgressConfig::num_seen_steps, "Steps done before this run (warm start).")
        .required()
        .non_negative();
    s.field("num_target_steps", &RichProgressConfig::num_target_steps, "Total steps of the run (the bar's 100%).")
        .required()
        .positive();
    s.field("global_rank", &RichProgressConfig::global_rank, "This process's rank; only rank 0 shows bars.")
        .required()
        .non_negative();
    s.field("log_every_percent", &RichProgressConfig::log_every_percent,
            "Without a terminal: print a training line whenever this share of the steps has passed. Our addition.")
        .in_closed(0.01, 100.0);
    s.field("log_interval_s", &RichProgressConfig::log_interval_s,
            "Without a terminal: also print a line after this many seconds without one. Our addition.")
        .positive();
  }
};

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

const at::Tensor* find_item(const ResultItems& items, std::string_view key) {
  for (const auto& [k, item] : items)
    if (k == key) return &item.value;
  return nullptr;
}

/// One bar (the training run, or one pass over an eval loader) on stderr.
/// Terminal: one line redrawn in place, at most 10 times a second. Otherwise
/// (CI logs, files): plain lines, see should_log().
class RichProgressSubscriber final : public MessageSubscriber {
 public:
  enum class Mode { kTerminal, kPlain, kOff };

  explicit RichProgressSubscriber(const RichProgressConfig& c)
      : every_percent_(c.log_every_percent), interval_s_(c.log_interval_s), mode_(mode_from_environment()) {
    train_.tag = c.train_dataloader_tag;
    train_.total = c.num_target_steps;
    train_.done = c.num_seen_steps;
    for (const auto& loader : c.eval_dataloaders) eval_sizes_[loader->tag()] = loader->size();
  }

  ~RichProgressSubscriber() override {
    if (mode_ == Mode::kTerminal && line_open_) std::fputs("\n", stderr);
  }

  void consume_message(const Message& m) override {
    if (mode_ == Mode::kOff) return;
    if (const auto* p = std::get_if<ProgressUpdate>(&m.payload)) {
      if (p->experiment_status == ExperimentStatus::kTrain) on_train(p->num_steps_done);
      else on_eval(p->dataloader_tag, p->num_steps_done);
    } else if (const auto* r = std::get_if<EvaluationResultBatch>(&m.payload)) {
      on_result(*r);
    }
  }

  void consume_dict(const std::map<std::string, DictValue>&) override {}

 private:
  struct Bar {
    bool train = true;
    std::string tag;
    std::int64_t total = 0;  // 0: unknown
    std::int64_t done = 0;
    std::int64_t first_done = 0;  // the rate counts from here (a warm start's steps do not count)
    Clock::time_point start, last_draw;
    bool finished = false;
  };

  static Mode mode_from_environment() {
    const char* env = std::getenv("MODALITIES_PROGRESS");
    const std::string v = env ? env : "";
    if (v == "0") return Mode::kOff;
    if (v == "tty") return Mode::kTerminal;
    if (v == "plain") return Mode::kPlain;
    return ::isatty(2) != 0 ? Mode::kTerminal : Mode::kPlain;
  }

  void on_train(std::int64_t step) {
    if (eval_) end_eval();
    const auto now = Clock::now();
    if (!train_started_) {
      train_started_ = true;
      train_.start = train_.last_draw = now;
      train_.first_done = step;
    }
    if (!train_active_) {
      train_active_ = true;
      line_drawn_ = false;
    }
    train_.done = step;
    const bool last = step >= train_.total;
    if (mode_ == Mode::kTerminal) {
      if (last || !line_drawn_ || seconds_between(train_.last_draw, now) >= 0.1) draw(train_, now, last);
    } else {
      const auto bucket = static_cast<std::int64_t>(
          std::floor(100.0 * static_cast<double>(step) / static_cast<double>(train_.total) / every_percent_));
      if (bucket > last_bucket_ || seconds_between(train_.last_draw, now) >= interval_s_ ||
          (last && !train_.finished)) {
        last_bucket_ = bucket;
        draw(train_, now, last);
      }
    }
    train_.finished = last;
  }

  void on_eval(const std::string& tag, std::int64_t n) {
    const auto now = Clock::now();
    if (train_active_) {  // the training line stays on screen as it was
      end_line();
      train_active_ = false;
    }
    if (eval_ && (eval_->tag != tag || n == 0)) end_eval();
    if (!eval_) {
      auto it = eval_sizes_.find(tag);
      eval_ = Bar{.train = false,
                  .tag = tag,
                  .total = it != eval_sizes_.end() ? it->second : 0,
                  .done = n,
                  .first_done = n,
                  .start = now,
                  .last_draw = now};
      line_drawn_ = false;
    }
    eval_->done = n;
    const bool last = eval_->total > 0 && n >= eval_->total;
    if (mode_ == Mode::kTerminal) {
      if (last || !line_drawn_ || seconds_between(eval_->last_draw, now) >= 0.1) draw(*eval_, now, last);
    } else if (last || seconds_between(eval_->last_draw, now) >= interval_s_) {
      draw(*eval_, now, last);  // one line per pass (plus one per interval for long passes)
    }
    if (last) {
      eval_->finished = true;
      end_eval();
    }
  }

  void on_result(const EvaluationResultBatch& r) {
    if (r.dataloader_tag != train_.tag) return;
    const auto now = Clock::now();
    const at::Tensor* loss = find_item(r.losses, "train loss avg");
    if (loss == nullptr && !r.losses.empty()) loss = &r.losses.front().second.value;
    if (loss != nullptr) loss_ = py::mean_as_float(*loss);
    if (const at::Tensor* lr = find_item(r.throughput_metrics, "lr mean")) lr_ = py::mean_as_float(*lr);
    if (const at::Tensor* tokens = find_item(r.metrics, "consumed tokens")) {
      const double t = tokens->detach().to(at::kDouble).mean().item<double>();
      if (last_tokens_ && t > *last_tokens_ && now > last_tokens_at_)
        tokens_per_s_ = (t - *last_tokens_) / seconds_between(last_tokens_at_, now);
      last_tokens_ = t;
      last_tokens_at_ = now;
    }
    // Terminal: show the new numbers at once. Plain lines pick them up at their next line.
    if (mode_ == Mode::kTerminal && train_active_ && !train_.finished) draw(train_, now, false);
  }

  // Leaves the eval bar: its last state stays on screen (terminal); a pass of
  // unknown length gets its one line now (plain).
  void end_eval() {
    if (!eval_->finished && (mode_ == Mode::kTerminal || eval_->total == 0)) draw(*eval_, Clock::now(), true);
    end_line();
    eval_.reset();
  }

  void end_line() {
    if (mode_ == Mode::kTerminal && line_open_) std::fputs("\n", stderr);
    std::fflush(stderr);
    line_open_ = false;
  }

  void draw(Bar& b, Clock::time_point now, bool final) {
    b.last_draw = now;
    line_drawn_ = true;
    const char* unit = b.train ? "steps" : "batches";
    std::string line = b.tag;
    if (b.total > 0) {
      const double frac = std::clamp(static_cast<double>(b.done) / static_cast<double>(b.total), 0.0, 1.0);
      constexpr int kWidth = 24;
      const int filled = static_cast<int>(frac * kWidth);
      line += fmt::format(" [{}{}] {:3.0f}% {}/{} {}", std::string(filled, '#'), std::string(kWidth - filled, '-'),
                          frac * 100, b.done, b.total, unit);
    } else {
      line += fmt::format(" {} {}", b.done, unit);
    }
    if (b.train) {
      if (loss_) line += fmt::format(" | loss {:.4f}", *loss_);
      if (lr_) line += fmt::format(" | lr {:.2e}", *lr_);
      if (tokens_per_s_) line += fmt::format(" | {} tok/s", human_count(*tokens_per_s_));
    }
    const double elapsed = seconds_between(b.start, now);
    const double rate = elapsed > 0 ? static_cast<double>(b.done - b.first_done) / elapsed : 0.0;
    if (rate > 0) line += fmt::format(" | {:.2f} {}/s", rate, unit);
    if (final) {
      line += fmt::format(" | {} elapsed", human_duration(elapsed));
    } else if (b.total > 0 && rate > 0) {
      const double left = static_cast<double>(std::max<std::int64_t>(b.total - b.done, 0));
      line += fmt::format(" | ETA {}", human_duration(left / rate));
    }
    if (mode_ == Mode::kTerminal) {
      std::fprintf(stderr, "\r\033[K%s", line.c_str());
      line_open_ = true;
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
    std::fflush(stderr);
  }

  double every_percent_, interval_s_;
  Mode mode_;
  std::map<std::string, std::int64_t> eval_sizes_;

  Bar train_;
  bool train_started_ = false;  // a training update has arrived
  bool train_active_ = false;   // the training bar is the current line
  std::int64_t last_bucket_ = -1;
  std::optional<Bar> eval_;
  bool line_open_ = false;   // terminal: the cursor is at the end of a bar's line
  bool line_drawn_ = false;  // the current line has been drawn since it became current

  std::optional<double> loss_, lr_, tokens_per_s_, last_tokens_;
  Clock::time_point last_tokens_at_;
};

// ---------------------------------------------------------------------------
// results_subscriber/wandb
//
// Note [W&B without a W&B client]
// Modalities calls the Python `wandb` client (wandb.init / wandb.log). There is
// no C++ client, and the service is often unreachable from training nodes
// anyway. So rank 0 records exactly what Modalities would send — the run's name,
// project and config file, every wandb.log call (three per result: losses,
// metrics, throughput metrics, at step num_train_steps_done, keys
// "<dataloader_tag> <name>") and the consume_dict run-config entries — into
// <directory>/modalities-offline-run-<experiment_id>/, one line per call,
// flushed. scripts/wandb_replay.py replays such a folder through the official
// client (an offline W&B run, then `wandb sync`, or straight online).
// DISABLED and ranks other than 0 do nothing; ONLINE records the same way and
// says how to upload.

struct WandbConfig {
  std::int64_t global_rank = 0;
  std::string project, experiment_id, mode;
  fs::path directory, config_file_path;
  std::optional<std::string> entity;

  static void describe(Schema<WandbConfig>& s) {
    s.field("global_rank", &WandbConfig::global_rank, "This process's rank; only rank 0 records.")
        .required()
        .non_negative();
    s.field("project", &WandbConfig::project, "W&B project of the run.").required().non_empty();
    s.field("experiment_id", &WandbConfig::experiment_id, "Run name (Modalities passes the experiment id).")
        .required()
        .non_empty();
    s.field("mode", &WandbConfig::mode,
            "ONLINE / OFFLINE record the run for scripts/wandb_replay.py (ONLINE also prints the upload command); "
            "DISABLED does nothing.")
        .required()
        .one_of({"ONLINE", "OFFLINE", "DISABLED"});
    s.field("directory", &WandbConfig::directory,
            "Folder for W&B data; the run is recorded in <directory>/modalities-offline-run-<experiment_id>.")
        .required()
        .non_empty();
    s.field("config_file_path", &WandbConfig::config_file_path,
            "The run's config file; copied into the run folder (W&B's run config and config artifact).")
        .required()
        .non_empty();
    s.field("entity", &WandbConfig::entity, "W&B entity (team or user), passed on by the replay. Our addition.");
  }
};

// A JSON number for one result value (scalars as numbers, tensors as nested lists; NaN/Inf as
// Python's json writes them, which W&B reads).
std::string wandb_value(const at::Tensor& v) { return py::json_tensor(v); }

std::string json_dict_value(const DictValue& v) {
  if (const auto* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  if (const auto* i = std::get_if<std::int64_t>(&v)) return fmt::format("{}", *i);
  if (const auto* d = std::get_if<double>(&v)) return py::float_repr(*d);
  return py::json_string(std::get<std::string>(v));
}

void write_file_atomically(const fs::path& file, const std::string& text) {
  const fs::path tmp = file.string() + ".tmp";
  {
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    if (f == nullptr) throw Error(fmt::format("cannot write '{}': {}", tmp.string(), std::strerror(errno)));
    const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
    if (std::fclose(f) != 0 || !ok)
      throw Error(fmt::format("cannot write '{}': {}", tmp.string(), std::strerror(errno)));
  }
  std::error_code ec;
  fs::rename(tmp, file, ec);
  if (ec) throw Error(fmt::format("cannot rename '{}' to '{}': {}", tmp.string(), file.string(), ec.message()));
}

void append_line(const fs::path& file, const std::string& line) {
  std::FILE* f = std::fopen(file.c_str(), "ab");
  if (f == nullptr) throw Error(fmt::format("cannot open '{}' for appending: {}", file.string(), std::strerror(errno)));
  const bool written = std::fwrite(line.data(), 1, line.size(), f) == line.size();
  if (std::fclose(f) != 0 || !written)
    throw Error(fmt::format("cannot write to '{}': {}", file.string(), std::strerror(errno)));
}

class WandbRecorder final : public MessageSubscriber {
 public:
  explicit WandbRecorder(const WandbConfig& c) {
    std::error_code ec;
    if (!fs::is_regular_file(c.config_file_path, ec))
      throw ConfigError("config_file_path", fmt::format("'{}' is not a file", c.config_file_path.string()));
    fs::create_directories(c.directory, ec);
    if (ec)
      throw ConfigError("directory",
                        fmt::format("cannot create the folder '{}': {}", c.directory.string(), ec.message()));
    // A new folder per run: an existing one (a warm start with the same experiment id) is kept.
    const std::string base = "modalities-offline-run-" + c.experiment_id;
    dir_ = c.directory / base;
    for (int n = 2; fs::exists(dir_, ec); ++n) dir_ = c.directory / fmt::format("{}-{}", base, n);
    fs::create_directories(dir_, ec);
    if (ec) throw ConfigError("directory", fmt::format("cannot create '{}': {}", dir_.string(), ec.message()));
    const std::string ext = c.config_file_path.extension().string();
    const std::string config_name = "config" + (ext.empty() ? std::string(".toml") : ext);
    std::ifstream in(c.config_file_path, std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    if (!in.good() && !in.eof())
      throw ConfigError("config_file_path", fmt::format("cannot read '{}'", c.config_file_path.string()));
    write_file_atomically(dir_ / config_name, text.str());
    std::string run = fmt::format(
        "{{\"format\": 1, \"project\": {}, \"name\": {}, \"mode\": {}, \"config_file\": {}, \"created\": {}",
        py::json_string(c.project), py::json_string(c.experiment_id), py::json_string(c.mode),
        py::json_string(config_name), py::json_string(iso_timestamp()));
    if (c.entity) run += fmt::format(", \"entity\": {}", py::json_string(*c.entity));
    write_file_atomically(dir_ / "run.json", run + "}\n");
    const std::string replay =
        fmt::format("python3 scripts/wandb_replay.py {}{}", dir_.string(), c.mode == "ONLINE" ? " --mode online" : "");
    if (c.mode == "ONLINE")
      std::fprintf(stderr,
                   "results_subscriber/wandb: mode ONLINE, but this program has no W&B client; the run is recorded "
                   "in %s. Upload it (during or after the run) with the official client: %s\n",
                   dir_.c_str(), replay.c_str());
    else
      std::fprintf(stderr, "results_subscriber/wandb: recording the run in %s (replay through W&B: %s)\n", dir_.c_str(),
                   replay.c_str());
  }

  void consume_message(const Message& m) override {
    const auto* r = std::get_if<EvaluationResultBatch>(&m.payload);
    if (r == nullptr) return;
    // Modalities' three wandb.log calls, each at step num_train_steps_done.
    for (const ResultItems* items : {&r->losses, &r->metrics, &r->throughput_metrics}) {
      std::string data;
      for (const auto& [key, item] : *items) {
        if (!data.empty()) data += ", ";
        data += py::json_string(r->dataloader_tag + " " + key) + ": " + wandb_value(item.value);
      }
      append_line(dir_ / "history.jsonl",
                  fmt::format("{{\"step\": {}, \"data\": {{{}}}}}\n", r->num_train_steps_done, data));
    }
  }

  void consume_dict(const std::map<std::string, DictValue>& values) override {
    if (values.empty()) return;
    std::string line;
    for (const auto& [key, value] : values)
      line += (line.empty() ? "" : ", ") + py::json_string(key) + ": " + json_dict_value(value);
    append_line(dir_ / "config_updates.jsonl", "{" + line + "}\n");
  }

  const fs::path& folder() const { return dir_; }

 private:
  fs::path dir_;
};

// ---------------------------------------------------------------------------
// results_subscriber/tensorboard (our addition)
//
// Note [Writing TensorBoard event files by hand]
// An event file is a TFRecord stream of `Event` protocol buffers: per record a
// little-endian u64 length, the masked CRC-32C of those 8 bytes, the bytes, and
// their masked CRC-32C. We write three message types with five fields between
// them (Event.wall_time/step/file_version/summary, Summary.Value.tag/
// simple_value), so the encoding is spelled out here rather than pulling in
// protobuf and TensorFlow's .proto files; Debian 12 has no CRC-32C library,
// and the table-driven CRC below is the standard algorithm (polynomial
// 0x82F63B78, reflected). The tensorboard package reads these files
// (scripts/check_tensorboard.py).

std::uint32_t crc32c(std::string_view data) {
  static const std::array<std::uint32_t, 256> table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  std::uint32_t c = 0xFFFFFFFFu;
  for (unsigned char b : data) c = table[(c ^ b) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

std::uint32_t masked_crc32c(std::string_view data) {
  const std::uint32_t c = crc32c(data);
  return ((c >> 15) | (c << 17)) + 0xA282EAD8u;
}

void put_varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7F) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}

template <class T>
void put_fixed(std::string& out, T v) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
  out.append(bytes, sizeof(T));
}

void put_bytes_field(std::string& out, int field, std::string_view bytes) {
  put_varint(out, static_cast<std::uint64_t>(field) << 3 | 2);
  put_varint(out, bytes.size());
  out += bytes;
}

// Event{wall_time = 1 (double), step = 2 (int64), file_version = 3 | summary = 5}.
std::string event_header(double wall_time, std::int64_t step) {
  std::string e;
  e += static_cast<char>(1 << 3 | 1);
  put_fixed(e, wall_time);
  e += static_cast<char>(2 << 3 | 0);
  put_varint(e, static_cast<std::uint64_t>(step));
  return e;
}

// Summary.Value{tag = 1, simple_value = 2 (float)}.
std::string scalar_value(std::string_view tag, float value) {
  std::string v;
  put_bytes_field(v, 1, tag);
  v += static_cast<char>(2 << 3 | 5);
  put_fixed(v, value);
  return v;
}

std::string tfrecord(std::string_view data) {
  std::string r, len;
  put_fixed(len, static_cast<std::uint64_t>(data.size()));
  r += len;
  put_fixed(r, masked_crc32c(len));
  r += data;
  put_fixed(r, masked_crc32c(data));
  return r;
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

struct TensorboardConfig {
  std::int64_t global_rank = 0;
  fs::path log_dir;

  static void describe(Schema<TensorboardConfig>& s) {
    s.field("global_rank", &TensorboardConfig::global_rank, "This process's rank; only rank 0 writes.")
        .required()
        .non_negative();
    s.field("log_dir", &TensorboardConfig::log_dir,
            "Folder of the event file (`tensorboard --logdir` it, or its parent for several runs).")
        .required()
        .non_empty();
  }
};

class TensorboardSubscriber final : public MessageSubscriber {
 public:
  explicit TensorboardSubscriber(const fs::path& dir) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw ConfigError("log_dir", fmt::format("cannot create the folder '{}': {}", dir.string(), ec.message()));
    char host[256] = "localhost";
    ::gethostname(host, sizeof host - 1);
    static std::atomic<int> instances{0};  // several subscribers in one process and second: distinct files
    file_ = dir / fmt::format("events.out.tfevents.{}.{}.{}.{}.modalities", static_cast<std::int64_t>(unix_seconds()),
                              host, ::getpid(), instances++);
    std::string first = event_header(unix_seconds(), 0);
    put_bytes_field(first, 3, "brain.Event:2");
    write(first);
  }

  void consume_message(const Message& m) override {
    const auto* r = std::get_if<EvaluationResultBatch>(&m.payload);
    if (r == nullptr) return;
    std::string summary;
    for (const ResultItems* items : {&r->losses, &r->metrics, &r->throughput_metrics})
      for (const auto& [key, item] : *items)
        if (item.value.numel() == 1)
          put_bytes_field(summary, 1,
                          scalar_value(r->dataloader_tag + "/" + key, item.value.to(at::kDouble).item<double>()));
    if (summary.empty()) return;
    std::string e = event_header(unix_seconds(), r->num_train_steps_done);
    put_bytes_field(e, 5, summary);
    write(e);
  }

  // Numeric run facts ("No. parameters") as scalars at step 0 under "run/".
  void consume_dict(const std::map<std::string, DictValue>& values) override {
    std::string summary;
    for (const auto& [key, value] : values) {
      if (const auto* i = std::get_if<std::int64_t>(&value))
        put_bytes_field(summary, 1, scalar_value("run/" + key, static_cast<float>(*i)));
      else if (const auto* d = std::get_if<double>(&value))
        put_bytes_field(summary, 1, scalar_value("run/" + key, static_cast<float>(*d)));
    }
    if (summary.empty()) return;
    std::string e = event_header(unix_seconds(), 0);
    put_bytes_field(e, 5, summary);
    write(e);
  }

 private:
  // One record per event, appended and flushed: a crashed run keeps every event written so far.
  void write(std::string_view event) {
    const std::string record = tfrecord(event);
    append_line(file_, record);
  }
  fs::path file_;
};

}  // namespace

void register_components(Registrar& r) {
  constexpr std::string_view kProgress = "progress_subscriber";
  constexpr std::string_view kResults = "results_subscriber";
  r.add<MessageSubscriber, EmptyConfig>(kProgress, "dummy", "Ignores every progress update.",
                                        [](const EmptyConfig&) { return std::make_shared<DummySubscriber>(); });
  r.add<MessageSubscriber, RichProgressConfig>(
      kProgress, "rich",
      "Rank 0: a live progress bar on stderr (step/target, loss, lr, tokens/s, ETA; one bar per eval pass). "
      "Other ranks: dummy.",
      [](const RichProgressConfig& c) -> std::shared_ptr<MessageSubscriber> {
        if (c.global_rank != 0) return std::make_shared<DummySubscriber>();
        return std::make_shared<RichProgressSubscriber>(c);
      });
  r.add<MessageSubscriber, EmptyConfig>(kResults, "dummy", "Ignores every result.",
                                        [](const EmptyConfig&) { return std::make_shared<DummySubscriber>(); });
  r.add<MessageSubscriber, ToDiscConfig>(
      kResults, "to_disc", "Rank 0 appends each result as one JSON line (Modalities' evaluation_results.jsonl layout).",
      [](const ToDiscConfig& c) { return std::make_shared<ToDiscSubscriber>(c.output_file_path); });
  r.add<MessageSubscriber, RichResultsConfig>(
      kResults, "rich",
      "Rank 0 prints each result as Modalities' log line '<time> | step: n | k: v | ... | ' and the run facts. "
      "Other ranks: dummy.",
      [](const RichResultsConfig& c) -> std::shared_ptr<MessageSubscriber> {
        if (c.global_rank != 0) return std::make_shared<DummySubscriber>();
        return std::make_shared<RichResultsSubscriber>(c.show_dataloader_tag);
      });
  r.add<MessageSubscriber, WandbConfig>(
      kResults, "wandb",
      "Rank 0, mode OFFLINE or ONLINE: records the W&B run Modalities would log (config file, every wandb.log call, "
      "run-config entries) for scripts/wandb_replay.py; DISABLED and other ranks: dummy.",
      [](const WandbConfig& c) -> std::shared_ptr<MessageSubscriber> {
        if (c.global_rank != 0 || c.mode == "DISABLED") return std::make_shared<DummySubscriber>();
        return std::make_shared<WandbRecorder>(c);
      });
  r.add<MessageSubscriber, TensorboardConfig>(
      kResults, "tensorboard",
      "Rank 0 writes every scalar result (tag '<dataloader_tag>/<name>', step num_train_steps_done) to a TensorBoard "
      "event file in log_dir. Our addition.",
      [](const TensorboardConfig& c) -> std::shared_ptr<MessageSubscriber> {
        if (c.global_rank != 0) return std::make_shared<DummySubscriber>();
        return std::make_shared<TensorboardSubscriber>(c.log_dir);
      });
}

}  // namespace modalities::plugins::subscribers

MODALITIES_PLUGIN(subscribers, MODALITIES_PLUGIN_VERSION, modalities::plugins::subscribers::register_components)
