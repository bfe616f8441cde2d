// The subscriber interface of the logging broker: receives progress updates
// and evaluation results as the run publishes them, plus a one-off dictionary
// of run facts (the parameter count). Console progress bars, the JSONL results
// file and experiment trackers implement it. Maps Modalities'
// MessageSubscriberIF (`progress_subscriber/*`, `results_subscriber/*`).
#pragma once

#include <modalities/sdk/export.h>
#include <modalities/sdk/interfaces/batch.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <variant>

namespace modalities {

/// A value passed to MessageSubscriber::consume_dict.
using DictValue = std::variant<bool, std::int64_t, double, std::string>;

/// Receives the messages of the types it was subscribed to.
///
/// Built once per run, on every rank; subscribers on ranks other than 0 are
/// usually no-ops. The publisher calls consume_message synchronously on the
/// publishing (gym) thread, once per published message, so it should be
/// cheap. consume_dict is called once after setup with run facts such as
/// {"No. parameters": 124'000'000}.
///
/// \code
///   void consume_message(const Message& m) override {
///     if (const auto* r = std::get_if<EvaluationResultBatch>(&m.payload))
///       append_json_line(*r);
///   }
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr); messages are only
/// borrowed for the duration of the call (copy what you keep).
/// Errors: throw modalities::Error (it ends the run); never exit().
/// Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API MessageSubscriber {
 public:
  static constexpr std::string_view kInterface = "MessageSubscriber";
  /// Also produced by `progress_subscriber/*`.
  static constexpr std::string_view kComponentKey = "results_subscriber";

  MessageSubscriber() = default;
  MessageSubscriber(const MessageSubscriber&) = delete;
  MessageSubscriber& operator=(const MessageSubscriber&) = delete;
  virtual ~MessageSubscriber();  // defined in the SDK library: one vtable, one typeinfo

  /// Handles one message (see Message::message_type for its payload).
  virtual void consume_message(const Message& message) = 0;

  /// Handles run facts; subscribers without use for them ignore them (never
  /// "not implemented", unlike Modalities' rich results subscriber).
  virtual void consume_dict(const std::map<std::string, DictValue>& values) = 0;
};

}  // namespace modalities
