// `gradient_clipper` variants for unsharded models (README.md):
//   fsdp1, fsdp1_logging_only  Modalities' FSDP1 clippers: on one process (or NO_SHARD) the
//                              norm of the fp32 per-gradient norms, gradients scaled by
//                              min(max_norm / (total + 1e-6), 1) (max_norm = inf for logging);
//                              over a model sharded by model/fsdp1_wrapped, the norm combined
//                              over the world (HYBRID_SHARD's replicas divided out)
//   norm, logging_only         torch.nn.utils.clip_grad_norm_ / get_total_norm on all parts
//   value                      torch.nn.utils.clip_grad_value_; returns the pre-clip L2 norm
//   fsdp2, fsdp2_logging_only  the same over a sharded model (model/fsdp2_wrapped): each rank's
//                              norm of its gradient shards, combined over the mesh's dp_shard
//                              group (sum of p-th powers, or max), so every rank clips with the
//                              norm of the whole gradient
// norm, logging_only and value refuse a sharded model on several ranks (their norm would be one
// rank's, and the ranks would scale their shards differently).
// Norms are computed with the same ATen calls as PyTorch (at::_foreach_norm, then the norm
// of the stacked norms), so they are bit-identical to PyTorch. Non-finite norms are returned.
#include <modalities/sdk/distributed.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/device_mesh.h>
#include <modalities/sdk/interfaces/gradient_clipper.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/model_parts.h>
#include <modalities/sdk/parallel.h>
#include <modalities/sdk/plugin.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace modalities::plugins::gradient_clippers {
namespace {

const std::vector<std::string> kNormTypes = {"P1_NORM", "P2_NORM", "MAX_NORM"};

double norm_order(const std::string& norm_type) {
  if (norm_type == "P1_NORM") return 1.0;
  if (norm_type == "P2_NORM") return 2.0;
  return std::numeric_limits<double>::infinity();  // MAX_NORM; the schema admits nothing else
}

// The defined gradients of all parts' parameters, in parameter order.
std::vector<at::Tensor> gradients(const std::vector<std::shared_ptr<Module>>& parts) {
  std::vector<at::Tensor> out;
  for (const auto& part : parts)
    for (const auto& [name, p] : part->named_parameters())
      if (p.grad().defined()) out.push_back(p.grad());
  return out;
}

// Buckets by (device, dtype) in first-appearance order: PyTorch's _group_tensors_by_device_and_dtype.
std::vector<std::vector<at::Tensor>> by_device_and_dtype(const std::vector<at::Tensor>& tensors) {
  std::vector<std::pair<std::pair<c10::Device, c10::ScalarType>, std::vector<at::Tensor>>> buckets;
  for (const at::Tensor& t : tensors) {
    const std::pair key{t.device(), t.scalar_type()};
    auto it = std::find_if(buckets.begin(), buckets.end(), [&](const auto& b) { return b.first == key; });
    if (it == buckets.end()) buckets.push_back({key, {t}});
    else it->second.push_back(t);
  }
  std::vector<std::vector<at::Tensor>> out;
  for (auto& b : buckets) out.push_back(std::move(b.second));
  return out;
}

// t on `device`; skips the (dispatched, if no-op) to() when it is there already.
at::Tensor on(const at::Tensor& t, const c10::Device& device) { return t.device() == device ? t : t.to(device); }

// at::stack of 0-dim norms. On the CPU with float32 norms (the common case) the values are
// copied into one new tensor directly: what stack computes, without its unsqueeze + cat
// (two dispatches per gradient, per step).
at::Tensor stack_norms(const std::vector<at::Tensor>& norms) {
  const bool host_f32 = !norms.empty() && std::all_of(norms.begin(), norms.end(), [](const at::Tensor& n) {
    return n.is_cpu() && n.scalar_type() == at::kFloat && n.dim() == 0;
  });
  if (!host_f32) return at::stack(norms);
  at::Tensor out = at::empty({static_cast<std::int64_t>(norms.size())}, at::kFloat);
  float* o = out.mutable_data_ptr<float>();
  for (const at::Tensor& n : norms) *o++ = *n.const_data_ptr<float>();
  return out;
}

// torch.nn.utils.get_total_norm (foreach path, as PyTorch takes it for CPU and CUDA tensors).
at::Tensor total_norm(const std::vector<at::Tensor>& grads, double order) {
  if (grads.empty()) return at::zeros({}, at::kFloat);  // torch.tensor(0.0)
  const c10::Device first = grads.front().device();
  std::vector<at::Tensor> norms;
  for (const auto& bucket : by_device_and_dtype(grads))
    for (at::Tensor& n : at::_foreach_norm(bucket, order)) norms.push_back(on(n, first));
  return at::linalg_vector_norm(stack_norms(norms), order);
}

// FSDP1's clip_grad_norm_ on one rank: fp32 norms of the gradients, then their fp32 norm.
// (FSDP1 sees its flattened parameters, one per wrapped unit; the value agrees to rounding.)
at::Tensor fsdp1_total_norm(const std::vector<at::Tensor>& grads, double order) {
  if (grads.empty()) return at::zeros({}, at::kFloat);
  const c10::Device first = grads.front().device();
  std::vector<at::Tensor> norms;
  const bool all_cpu = std::all_of(grads.begin(), grads.end(), [](const at::Tensor& g) { return g.is_cpu(); });
  if (all_cpu) {
    // On the CPU, _foreach_norm is this very loop of linalg_vector_norm calls inside ATen (the
    // same values), dispatched once instead of once per gradient. (On CUDA it is a multi-tensor
    // kernel whose summation order differs from FSDP1's per-tensor norms: not used there.)
    norms = at::_foreach_norm(grads, order, at::kFloat);
  } else {
    for (const at::Tensor& g : grads)
      norms.push_back(on(at::linalg_vector_norm(g, order, std::nullopt, false, at::kFloat), first));
  }
  return at::linalg_vector_norm(stack_norms(norms), order, std::nullopt, false, at::kFloat);
}

// Scales every gradient by min(max_norm / (total + 1e-6), 1), as torch.nn.utils and FSDP1 do
// (Python's `max_norm / tensor` is reciprocal() * max_norm). With `cast_coef` the factor is
// cast to each gradient's dtype first (FSDP1). A factor of exactly 1 changes no bit, so on the
// CPU the multiplication is skipped then; elsewhere reading it back would cost a sync.
void scale(const std::vector<at::Tensor>& grads, double max_norm, const at::Tensor& total, bool cast_coef) {
  if (grads.empty()) return;
  const at::Tensor coef = at::clamp((total + 1e-6).reciprocal() * max_norm, std::nullopt, 1.0);
  if (coef.is_cpu() && coef.item<double>() == 1.0) return;
  for (const auto& bucket : by_device_and_dtype(grads)) {
    const at::Tensor& g0 = bucket.front();
    const at::Tensor c = cast_coef ? coef.to(g0.device(), g0.scalar_type()) : coef.to(g0.device());
    at::_foreach_mul_(bucket, c);
  }
}

// The norm of the whole gradient from each rank's shards: ranks hold disjoint rows of every
// parameter (zero padding adds nothing), so the p-th powers add up and the maxima combine.
// Accumulated in float64: float32 norms of large tensors (a 50k x 128 embedding) carry errors
// of ~1e-5 relative that depend on how the rows are split, so float32 would log a norm that
// changes with the number of ranks (tests/distributed measures this). In float64 the norm of
// the same gradient is the same on 1, 2 or 4 ranks to ~1e-9.
//
// `replicas`: how many ranks of `group` hold each row (FSDP1's HYBRID_SHARD over the world: one
// per node); their p-th powers are counted that many times and divided out.
at::Tensor sharded_total_norm(const std::vector<at::Tensor>& grads, double order,
                              const c10::intrusive_ptr<c10d::ProcessGroup>& group, double replicas = 1.0) {
  const bool max = std::isinf(order);
  at::Tensor local = at::zeros({1}, at::kDouble);
  for (const auto& bucket : by_device_and_dtype(grads))
    for (const at::Tensor& n : at::_foreach_norm(bucket, order, at::kDouble)) {
      const at::Tensor v = n.cpu().reshape({1});
      if (max) local = at::maximum(local, v);
      else local.add_(v.pow(order));
    }
  if (group) {
    std::vector<at::Tensor> t = {local};
    c10d::AllreduceOptions o;
    o.reduceOp = max ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
    group->allreduce(t, o)->wait();
  }
  if (!max && replicas != 1.0) local.div_(replicas);
  if (!max) local.pow_(1.0 / order);
  const c10::Device device = grads.empty() ? c10::Device(c10::kCPU) : grads.front().device();
  return local.reshape({}).to(device, at::kFloat);
}

// The norm of the whole gradient when the parts' parameters are blocks of the full tensors that
// some ranks hold alike (a tensor-parallel model: its replicated norm weights sit on every tp rank,
// under FSDP sharded over dp_shard): every rank adds the p-th power of each gradient's norm divided
// by the number of ranks holding that block (ShardPlacement::replicas; a parameter without a
// placement is whole on every rank of its pipeline stage: `unplaced_replicas` = world / pp), and
// the sum over the world counts each element once. Pipeline stages hold different parameters, so
// the same sum covers the whole model. In float64, like sharded_total_norm.
at::Tensor world_total_norm(const std::vector<std::shared_ptr<Module>>& parts, double order, double unplaced_replicas) {
  const bool max = std::isinf(order);
  std::vector<at::Tensor> grads;
  std::vector<double> replicas;
  for (const auto& part : parts) {
    const auto placements = part->shard_placements();
    for (const auto& [name, p] : part->named_parameters()) {
      if (!p.grad().defined()) continue;
      grads.push_back(p.grad());
      const auto it = placements.find(name);
      replicas.push_back(it != placements.end() ? static_cast<double>(it->second.replicas) : unplaced_replicas);
    }
  }
  at::Tensor local = at::zeros({1}, at::kDouble);
  if (!grads.empty()) {
    std::vector<at::Tensor> norms;
    for (const at::Tensor& n : at::_foreach_norm(grads, order, at::kDouble)) norms.push_back(n.cpu().reshape({1}));
    const at::Tensor all = at::cat(norms);
    if (max) local = all.max().reshape({1});
    else local = (all.pow(order) / at::tensor(replicas, at::kDouble)).sum().reshape({1});
  }
  if (dist::world_size() > 1) {
    std::vector<at::Tensor> t = {local};
    c10d::AllreduceOptions o;
    o.reduceOp = max ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
    dist::world()->allreduce(t, o)->wait();
  }
  if (!max) local.pow_(1.0 / order);
  const c10::Device device = grads.empty() ? c10::Device(c10::kCPU) : grads.front().device();
  return local.reshape({}).to(device, at::kFloat);
}

// How the total norm is computed and what happens to the gradients.
enum class Mode {
  kFsdp1,
  kFsdp1Sharded,
  kTorch,
  kTorchLoggingOnly,
  kValue,
  kSharded,
  kShardedLoggingOnly,
  kWorld,
  kWorldLoggingOnly
};

// How many ranks of the world hold each row of the parts' sharded parameters: the rows all ranks
// hold of one sharded parameter, over its rows (1 for FULL_SHARD, the node count for HYBRID_SHARD).
// A collective (every rank calls it at the same point).
double replicas_in_world(const std::vector<std::shared_ptr<Module>>& parts) {
  for (const auto& part : parts) {
    const auto placements = part->shard_placements();
    for (const auto& [name, t] : part->named_parameters()) {
      const auto it = placements.find(name);
      if (it == placements.end() || it->second.global_shape.empty() || it->second.global_shape[0] == 0) continue;
      std::vector<at::Tensor> rows = {at::full({1}, static_cast<double>(t.size(0)), at::kDouble)};
      dist::world()->allreduce(rows)->wait();
      return rows.front().item<double>() / static_cast<double>(it->second.global_shape[0]);
    }
  }
  return 1.0;
}

bool any_sharded(const std::vector<std::shared_ptr<Module>>& parts) {
  return std::any_of(parts.begin(), parts.end(), [](const auto& p) { return !p->shard_placements().empty(); });
}

// A one-process variant must not see shards of a model trained on several ranks.
void refuse_shards(const std::vector<std::shared_ptr<Module>>& parts, const char* variant) {
  if (dist::world_size() <= 1) return;
  for (const auto& part : parts)
    if (!part->shard_placements().empty())
      throw ConfigError("wrapped_model", fmt::format("gradient_clipper/{} computes one rank's norm; the model is "
                                                     "sharded over {} ranks: use gradient_clipper/fsdp2 (or "
                                                     "fsdp2_logging_only) with the device_mesh",
                                                     variant, dist::world_size()));
}

class Clipper final : public GradientClipper {
 public:
  Clipper(Mode mode, std::vector<std::shared_ptr<Module>> parts, double order, double limit,
          c10::intrusive_ptr<c10d::ProcessGroup> group = {}, double unplaced_replicas = 1)
      : mode_(mode),
        parts_(std::move(parts)),
        order_(order),
        limit_(limit),
        group_(std::move(group)),
        unplaced_replicas_(unplaced_replicas) {}

  at::Tensor clip_gradients() override {
    at::NoGradGuard no_grad;
    const std::vector<at::Tensor> grads = gradients(parts_);
    switch (mode_) {
      case Mode::kFsdp1: {
        const at::Tensor total = fsdp1_total_norm(grads, order_);
        scale(grads, limit_, total, /*cast_coef=*/true);
        if (grads.empty()) return total;
        c10::ScalarType dtype = grads.front().scalar_type();  // FSDP1 returns the promoted gradient dtype
        for (const at::Tensor& g : grads) dtype = c10::promoteTypes(dtype, g.scalar_type());
        return total.to(dtype);
      }
      case Mode::kFsdp1Sharded: {  // FSDP1 wrapped over several ranks: the norm over the world
        if (replicas_ == 0) replicas_ = replicas_in_world(parts_);
        const at::Tensor total = sharded_total_norm(grads, order_, group_, replicas_);
        scale(grads, limit_, total, /*cast_coef=*/true);
        return total;
      }
      case Mode::kTorch: {
        const at::Tensor total = total_norm(grads, order_);
        scale(grads, limit_, total, /*cast_coef=*/false);
        return total;
      }
      case Mode::kTorchLoggingOnly: return total_norm(grads, order_);
      case Mode::kSharded: {
        const at::Tensor total = sharded_total_norm(grads, order_, group_);
        scale(grads, limit_, total, /*cast_coef=*/false);
        return total;
      }
      case Mode::kShardedLoggingOnly: return sharded_total_norm(grads, order_, group_);
      case Mode::kWorld: {
        const at::Tensor total = world_total_norm(parts_, order_, unplaced_replicas_);
        scale(grads, limit_, total, /*cast_coef=*/false);
        return total;
      }
      case Mode::kWorldLoggingOnly: return world_total_norm(parts_, order_, unplaced_replicas_);
      case Mode::kValue: {
        const at::Tensor total = total_norm(grads, 2.0);
        for (const auto& bucket : by_device_and_dtype(grads)) {
          at::_foreach_clamp_min_(bucket, -limit_);
          at::_foreach_clamp_max_(bucket, limit_);
        }
        return total;
      }
    }
    return {};
  }

 private:
  Mode mode_;
  std::vector<std::shared_ptr<Module>> parts_;
  double order_;
  double limit_;                                  // max_norm, or clip_value
  c10::intrusive_ptr<c10d::ProcessGroup> group_;  // sharded variants: the dp_shard group (null: one rank)
  double replicas_ = 0;                           // kFsdp1Sharded: found at the first call
  double unplaced_replicas_;                      // kWorld: ranks holding a parameter without a placement (world / pp)
};

// --- configs --------------------------------------------------------------------------------------

template <class C>
void norm_type_field(Schema<C>& s) {
  s.field("norm_type", &C::norm_type, "P1_NORM (sum of |g|), P2_NORM (Euclidean) or MAX_NORM (max |g|).")
      .required()
      .one_of(kNormTypes);
}

struct Fsdp1Config {
  ModelParts wrapped_model;
  double max_norm = 0;
  std::string norm_type;
  static void describe(Schema<Fsdp1Config>& s) {
    s.field("wrapped_model", &Fsdp1Config::wrapped_model, "The model whose gradients are clipped.").required();
    s.field("max_norm", &Fsdp1Config::max_norm, "Gradients are scaled down to this total norm.").required().positive();
    norm_type_field(s);
  }
};

struct Fsdp1LoggingConfig {
  ModelParts wrapped_model;
  std::string norm_type;
  static void describe(Schema<Fsdp1LoggingConfig>& s) {
    s.field("wrapped_model", &Fsdp1LoggingConfig::wrapped_model, "The model whose gradient norm is computed.")
        .required();
    norm_type_field(s);
  }
};

struct NormConfig {
  ModelParts model_parts;
  double max_norm = 0;
  std::string norm_type;
  static void describe(Schema<NormConfig>& s) {
    s.field("model_parts", &NormConfig::model_parts, "Model or list of model parts whose gradients are clipped.")
        .required()
        .alias("wrapped_model");
    s.field("max_norm", &NormConfig::max_norm, "Gradients are scaled down to this total norm.").required().positive();
    norm_type_field(s);
  }
};

struct LoggingOnlyConfig {
  ModelParts model_parts;
  std::string norm_type;
  static void describe(Schema<LoggingOnlyConfig>& s) {
    s.field("model_parts", &LoggingOnlyConfig::model_parts,
            "Model or list of model parts whose gradient norm is computed.")
        .required()
        .alias("wrapped_model");
    norm_type_field(s);
  }
};

struct ValueConfig {
  ModelParts model_parts;
  double clip_value = 0;
  static void describe(Schema<ValueConfig>& s) {
    s.field("model_parts", &ValueConfig::model_parts, "Model or list of model parts whose gradients are clamped.")
        .required()
        .alias("wrapped_model");
    s.field("clip_value", &ValueConfig::clip_value, "Every gradient element is clamped to [-clip_value, clip_value].")
        .required()
        .positive();
  }
};

struct Fsdp2Config {
  ModelParts model_parts;
  double max_norm = 0;
  std::string norm_type;
  Ref<DeviceMesh> device_mesh;
  static void describe(Schema<Fsdp2Config>& s) {
    s.field("model_parts", &Fsdp2Config::model_parts, "The sharded model (model/fsdp2_wrapped) or its parts.")
        .required()
        .alias("wrapped_model");
    s.field("max_norm", &Fsdp2Config::max_norm, "Gradients are scaled down to this total norm.").required().positive();
    norm_type_field(s);
    s.field("device_mesh", &Fsdp2Config::device_mesh, "The mesh the model is sharded over (its dp_shard dim).")
        .required();
  }
};

struct Fsdp2LoggingConfig {
  ModelParts model_parts;
  std::string norm_type;
  Ref<DeviceMesh> device_mesh;
  static void describe(Schema<Fsdp2LoggingConfig>& s) {
    s.field("model_parts", &Fsdp2LoggingConfig::model_parts, "The sharded model (model/fsdp2_wrapped) or its parts.")
        .required()
        .alias("wrapped_model");
    norm_type_field(s);
    s.field("device_mesh", &Fsdp2LoggingConfig::device_mesh, "The mesh the model is sharded over (its dp_shard dim).")
        .required();
  }
};

// gradient_clipper/fsdp2 and fsdp2_logging_only (`clip` false): the norm combined over dp_shard
// (x cp: ParallelDims::shard_group), the group whose ranks hold different shards (replicas along dp_replicate hold the same), or over
// the world (world_total_norm) when tensor or pipeline parallelism puts blocks on other ranks (a
// parameter without a placement is then held by the world / pp ranks of its stage).
std::shared_ptr<Clipper> mesh_clipper(bool clip, const ModelParts& parts, const std::string& norm_type, double limit,
                                      std::shared_ptr<const DeviceMesh> mesh) {
  const ParallelDims dims(std::move(mesh));
  if (!dims.has(MeshDim::dp_shard))
    throw ConfigError("device_mesh", fmt::format("needs a dp_shard dim; the mesh has {}", join_mesh_dims(dims.dims())));
  if (dims.has(MeshDim::tp) || dims.has(MeshDim::pp)) {
    const double unplaced = static_cast<double>(dist::world_size()) / static_cast<double>(dims.degree(MeshDim::pp));
    return std::make_shared<Clipper>(clip ? Mode::kWorld : Mode::kWorldLoggingOnly, parts.shared(),
                                     norm_order(norm_type), limit, nullptr, unplaced);
  }
  return std::make_shared<Clipper>(clip ? Mode::kSharded : Mode::kShardedLoggingOnly, parts.shared(),
                                   norm_order(norm_type), limit, dims.shard_group());
}

}  // namespace

void register_components(Registrar& r) {
  r.add<GradientClipper, Fsdp2Config>(
      "fsdp2", "Clips a sharded model's gradients to max_norm of the whole gradient (norm combined over dp_shard).",
      [](const Fsdp2Config& c) {
        return mesh_clipper(true, c.model_parts, c.norm_type, c.max_norm, c.device_mesh.shared());
      });
  r.add<GradientClipper, Fsdp2LoggingConfig>(
      "fsdp2_logging_only", "The whole gradient's norm of a sharded model (combined over dp_shard); no clipping.",
      [](const Fsdp2LoggingConfig& c) {
        return mesh_clipper(false, c.model_parts, c.norm_type, 0.0, c.device_mesh.shared());
      });
  r.add<GradientClipper, Fsdp1Config>(
      "fsdp1", "FSDP1 clip_grad_norm_: clips to max_norm, returns the total norm (over all ranks for a sharded model).",
      [](const Fsdp1Config& c) {
        if (dist::world_size() > 1 && any_sharded(c.wrapped_model.shared()))
          return std::make_shared<Clipper>(Mode::kFsdp1Sharded, c.wrapped_model.shared(), norm_order(c.norm_type),
                                           c.max_norm, dist::world());
        return std::make_shared<Clipper>(Mode::kFsdp1, c.wrapped_model.shared(), norm_order(c.norm_type), c.max_norm);
      });
  r.add<GradientClipper, Fsdp1LoggingConfig>(
      "fsdp1_logging_only",
      "FSDP1 clip_grad_norm_ with max_norm = inf: the total norm (over all ranks when sharded), no clipping.",
      [](const Fsdp1LoggingConfig& c) {
        if (dist::world_size() > 1 && any_sharded(c.wrapped_model.shared()))
          return std::make_shared<Clipper>(Mode::kFsdp1Sharded, c.wrapped_model.shared(), norm_order(c.norm_type),
                                           std::numeric_limits<double>::infinity(), dist::world());
        return std::make_shared<Clipper>(Mode::kFsdp1, c.wrapped_model.shared(), norm_order(c.norm_type),
                                         std::numeric_limits<double>::infinity());
      });
  r.add<GradientClipper, NormConfig>(
      "norm", "torch.nn.utils.clip_grad_norm_ over all parts: clips to max_norm, returns the total norm.",
      [](const NormConfig& c) {
        refuse_shards(c.model_parts.shared(), "norm");
        return std::make_shared<Clipper>(Mode::kTorch, c.model_parts.shared(), norm_order(c.norm_type), c.max_norm);
      });
  r.add<GradientClipper, LoggingOnlyConfig>(
      "logging_only", "The total gradient norm over all parts (torch.nn.utils.get_total_norm); gradients untouched.",
      [](const LoggingOnlyConfig& c) {
        refuse_shards(c.model_parts.shared(), "logging_only");
        return std::make_shared<Clipper>(Mode::kTorchLoggingOnly, c.model_parts.shared(), norm_order(c.norm_type), 0.0);
      });
  r.add<GradientClipper, ValueConfig>(
      "value", "torch.nn.utils.clip_grad_value_: clamps every gradient element; returns the pre-clip L2 norm.",
      [](const ValueConfig& c) {
        refuse_shards(c.model_parts.shared(), "value");
        return std::make_shared<Clipper>(Mode::kValue, c.model_parts.shared(), 2.0, c.clip_value);
      });
}

}  // namespace modalities::plugins::gradient_clippers

MODALITIES_PLUGIN(gradient_clippers, MODALITIES_PLUGIN_VERSION,
                  modalities::plugins::gradient_clippers::register_components)
