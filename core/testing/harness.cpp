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
// The parent of the node at `path` (creating missing tables when `create`), or null.
core::ConfigNode* parent_of(core::ConfigNode& root, const core::ConfigPath& path, bool create) {
  core::ConfigNode* node = &root;
  const auto& segs = path.segments();
  for (std::size_t i = 0; i + 1 < segs.size(); ++i) {
    if (const auto* key = std::get_if<std::string>(&segs[i])) {
      core::ConfigNode* next = node->find(*key);
      if (next == nullptr) {
        if (!create) return nullptr;
        node->as_table().emplace_back(*key, core::ConfigNode(core::ConfigNode::Table{}, node->where()));
        next = &node->as_table().back().second;
      }
      node = next;
    } else {
      node = &node->as_array().at(std::get<std::size_t>(segs[i]));
    }
  }
  return node;
}
}  // namespace

void Harness::set(const std::string& dotted_path, Value value) {
  const core::ConfigPath path = core::ConfigPath::parse(dotted_path);
  core::ConfigNode* parent = parent_of(root_, path, /*create=*/true);
  core::ConfigNode v = core::ConfigNode::from_value(value, parent->where());
  const auto& last = path.segments().back();
  if (const auto* i = std::get_if<std::size_t>(&last)) {
    parent->as_array().at(*i) = std::move(v);
  } else if (core::ConfigNode* existing = parent->find(std::get<std::string>(last))) {
    v.set_where(existing->where());
    *existing = std::move(v);
  } else {
    parent->as_table().emplace_back(std::get<std::string>(last), std::move(v));
  }
  built_.reset();
}

void Harness::erase(const std::string& dotted_path) {
  const core::ConfigPath path = core::ConfigPath::parse(dotted_path);
  core::ConfigNode* parent = parent_of(root_, path, /*create=*/false);
  const auto* key = std::get_if<std::string>(&path.segments().back());
  if (parent == nullptr || key == nullptr || !parent->is_table()) return;
  std::erase_if(parent->as_table(), [&](const auto& e) { return e.first == *key; });
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
