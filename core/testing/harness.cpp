// Implementation of the test harness (see harness.h).
#include <modalities/testing/harness.h>

#include <fmt/core.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

namespace modalities::testing {

Harness::Harness(const std::filesystem::path& plugin_file, const std::filesystem::path& config_file) {
  load_plugin(plugin_file);
  if (!config_file.empty()) root_ = core::load_resolved(config_file, registry_, core::env_for_config(config_file));
}

void Harness::load_plugin(const std::filesystem::path& plugin_file) {
  if (auto problem = host_.load_file(plugin_file)) ADD_FAILURE() << "cannot load plugin: " << problem->str();
  built_.reset();
}

void Harness::set_config_text(const std::string& toml, const std::string& name) {
  root_ = core::load_toml_string(toml, name);
  core::resolve_interpolations(root_, core::resolvers_for(registry_, core::env_for_config(name)));
  built_.reset();
}

namespace {
core::ConfigNode* walk(core::ConfigNode& root, const std::string& dotted, bool create, std::string* last) {
  // Split "a.b[1].c" into steps; the last step is returned in *last (a key) or as index.
  std::vector<std::string> steps;
  std::string cur;
  for (char c : dotted) {
    if (c == '.' || c == '[') {
      if (!cur.empty()) steps.push_back(cur);
      cur = c == '[' ? "[" : "";
    } else if (c == ']') {
      steps.push_back(cur + "]");
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) steps.push_back(cur);
  core::ConfigNode* node = &root;
  for (std::size_t i = 0; i + 1 < steps.size(); ++i) {
    const std::string& s = steps[i];
    if (s.front() == '[') {
      node = &node->as_array().at(std::stoul(s.substr(1, s.size() - 2)));
    } else {
      core::ConfigNode* next = node->find(s);
      if (next == nullptr) {
        if (!create) return nullptr;
        node->as_table().emplace_back(s, core::ConfigNode(core::ConfigNode::Table{}, node->where()));
        next = &node->as_table().back().second;
      }
      node = next;
    }
  }
  *last = steps.back();
  return node;
}
}  // namespace

void Harness::set(const std::string& dotted_path, Value value) {
  std::string last;
  core::ConfigNode* parent = walk(root_, dotted_path, true, &last);
  core::ConfigNode v = core::ConfigNode::from_value(value, parent->where());
  if (last.front() == '[') {
    parent->as_array().at(std::stoul(last.substr(1, last.size() - 2))) = std::move(v);
  } else if (core::ConfigNode* existing = parent->find(last)) {
    v.set_where(existing->where());
    *existing = std::move(v);
  } else {
    parent->as_table().emplace_back(last, std::move(v));
  }
  built_.reset();
}

void Harness::erase(const std::string& dotted_path) {
  std::string last;
  core::ConfigNode* parent = walk(root_, dotted_path, false, &last);
  if (parent == nullptr || !parent->is_table()) return;
  std::erase_if(parent->as_table(), [&](const auto& e) { return e.first == last; });
  built_.reset();
}

Value Harness::value(const std::string& key) {
  if (!built_) {
    core::ComponentGraph graph(registry_, root_, nullptr);
    built_ = graph.build({});
  }
  const Value* v = built_->get(key);
  if (v == nullptr) throw Error(fmt::format("no top-level key '{}' in the test config", key));
  return *v;
}

std::string Harness::build_error() {
  try {
    core::ComponentGraph graph(registry_, root_, nullptr);
    built_ = graph.build({});
    return "";
  } catch (const std::exception& e) {
    built_.reset();
    return e.what();
  }
}

std::vector<core::Diagnostic> Harness::validate() {
  core::ComponentGraph graph(registry_, root_, nullptr);
  return graph.validate();
}

std::string read_file(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace modalities::testing
