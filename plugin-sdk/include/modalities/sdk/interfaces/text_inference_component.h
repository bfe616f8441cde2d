// The text-inference interface: the interactive generation loop of
// `modalities generate_text` (ask for prompt fields, sample tokens until the
// end-of-document token or the length limit, print the text). Maps Modalities'
// TextInferenceComponent (`inference_component/text`, registered at runtime).
#pragma once

#include <modalities/sdk/export.h>

#include <iosfwd>
#include <string_view>

namespace modalities {

/// Runs interactive text generation.
///
/// Built by the generate_text command; run() is called once from the main
/// thread and returns when `in` reaches end of input. Streams are parameters
/// (Modalities uses stdin/stdout directly) so tests can script a session.
///
/// \code
///   component->run(std::cin, std::cout);
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr); the streams are
/// borrowed for the call.
/// Errors: throw modalities::Error; never exit().  Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API TextInferenceComponent {
 public:
  static constexpr std::string_view kInterface = "TextInferenceComponent";
  static constexpr std::string_view kComponentKey = "inference_component";

  TextInferenceComponent() = default;
  TextInferenceComponent(const TextInferenceComponent&) = delete;
  TextInferenceComponent& operator=(const TextInferenceComponent&) = delete;
  virtual ~TextInferenceComponent();  // defined in the SDK library: one vtable, one typeinfo

  /// Prompts on `out`, reads answers from `in`, writes generated text to `out`.
  virtual void run(std::istream& in, std::ostream& out) = 0;
};

}  // namespace modalities
