// Test helpers for Hugging Face folders, shared by the gpt2 and moe plugins' tests: the run config
// that imports a folder, and a copy of a folder with one edit in its config.json.
#pragma once

#include <modalities/testing/harness.h>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace modalities::testing::hf {

/// `[model]` = model/huggingface_pretrained_model of `folder`, Modalities' keys, plus `extra`
/// (", key = value" pairs) in its config table.
inline std::string import_toml(const std::filesystem::path& folder, const std::string& extra = "") {
  return fmt::format(R"([model]
component_key = "model"
variant_key = "huggingface_pretrained_model"
config = {{ model_type = "AutoModelForCausalLM", model_name = "{}", prediction_key = "logits", huggingface_prediction_subscription_key = "logits", sample_key = "input_ids"{} }}
)",
                     folder.string(), extra);
}

/// Copies folder `from` to `to` with the first `old_text` of config.json replaced by `new_text`
/// (a test failure when config.json has no `old_text`).
inline void copy_with_config(const std::filesystem::path& from, const std::filesystem::path& to,
                             const std::string& old_text, const std::string& new_text) {
  std::filesystem::create_directories(to);
  for (const auto& e : std::filesystem::directory_iterator(from))
    std::filesystem::copy_file(e.path(), to / e.path().filename());
  std::string cfg = read_file(to / "config.json");
  const auto at = cfg.find(old_text);
  ASSERT_NE(at, std::string::npos) << old_text;
  cfg.replace(at, old_text.size(), new_text);
  std::ofstream(to / "config.json", std::ios::trunc) << cfg;
}

}  // namespace modalities::testing::hf
