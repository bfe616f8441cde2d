// The fused autograd ops of the GPT-2 model (src/fused_ops.h) against the eager composites
// they replace: outputs and every gradient must be bit-identical (at::equal), including
// where an input fans out to several consumers, so that the engine's accumulation order
// is the composite's too.
#include "../src/fused_ops.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace {

namespace g = modalities::plugins::gpt2;

// Runs `f` on fresh leaf copies of `inputs`, backpropagates `seed` (same shape as the
// output) and returns {output, grads...}.
std::vector<at::Tensor> run(const std::function<at::Tensor(const std::vector<at::Tensor>&)>& f,
                            const std::vector<at::Tensor>& inputs, const at::Tensor& seed) {
  std::vector<at::Tensor> leaves;
  for (const at::Tensor& t : inputs) leaves.push_back(t.detach().clone().requires_grad_(true));
  const at::Tensor y = f(leaves);
  y.backward(seed);
  std::vector<at::Tensor> out{y.detach()};
  for (const at::Tensor& l : leaves) out.push_back(l.grad());
  return out;
}

void expect_bit_identical(const std::vector<at::Tensor>& fused, const std::vector<at::Tensor>& composite,
                          const std::string& what) {
  ASSERT_EQ(fused.size(), composite.size()) << what;
  for (std::size_t i = 0; i < fused.size(); ++i) {
    const std::string name = i == 0 ? "output" : "gradient of input " + std::to_string(i - 1);
    ASSERT_TRUE(fused[i].defined()) << what << ": " << name << " undefined (fused)";
    ASSERT_TRUE(composite[i].defined()) << what << ": " << name << " undefined (composite)";
    EXPECT_EQ(fused[i].scalar_type(), composite[i].scalar_type()) << what << ": " << name;
    EXPECT_EQ(fused[i].sizes(), composite[i].sizes()) << what << ": " << name;
    EXPECT_TRUE(at::equal(fused[i], composite[i]))
        << what << ": " << name << " differs, max |diff| "
        << (fused[i].to(at::kDouble) - composite[i].to(at::kDouble)).abs().max().item<double>();
  }
}

std::optional<at::Tensor> optional(const at::Tensor& t) { return t.defined() ? std::optional(t) : std::nullopt; }

at::Tensor rotate_half(const at::Tensor& x) {
  const auto halves = x.chunk(2, -1);
  return at::cat({-halves[1], halves[0]}, -1);
}

// cos/sin tables [1, 1, T, hd] as the model builds them.
std::pair<at::Tensor, at::Tensor> rope_tables(std::int64_t T, std::int64_t hd, at::ScalarType dt) {
  const at::Tensor inv = 1.0 / at::pow(10000.0, at::arange(0, hd, 2, at::kFloat) / hd);
  const at::Tensor freqs = at::arange(T, at::kFloat).unsqueeze(1) * inv.unsqueeze(0);
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos().view({1, 1, T, hd}).to(dt), emb.sin().view({1, 1, T, hd}).to(dt)};
}

class FusedOpsTest : public ::testing::TestWithParam<at::ScalarType> {
 protected:
  void SetUp() override { at::manual_seed(1234); }
  at::Tensor randn(at::IntArrayRef shape) const { return at::randn(shape, at::kFloat).to(GetParam()); }
};

TEST_P(FusedOpsTest, LinearEqualsAtLinear) {
  for (const bool bias : {false, true}) {
    const at::Tensor x = randn({12, 16}), w = randn({24, 16}), b = randn({24}), seed = randn({12, 24});
    // x fans out: a linear and a residual-like use, as activations in the model do.
    auto body = [&](auto linear) {
      return [=](const std::vector<at::Tensor>& in) {
        const at::Tensor h = in[0] * 2;
        return linear(h, in[1], bias ? in[2] : at::Tensor()) + h.narrow(1, 0, 1);
      };
    };
    const auto fused = run(body([](auto x, auto w, auto b) { return g::fused_linear(x, w, b); }), {x, w, b}, seed);
    const auto composite = run(body([](auto x, auto w, auto b) { return at::linear(x, w, b); }), {x, w, b}, seed);
    if (!bias) {  // b unused: no gradient on either side
      EXPECT_FALSE(fused[3].defined());
      EXPECT_FALSE(composite[3].defined());
      expect_bit_identical({fused.begin(), fused.end() - 1}, {composite.begin(), composite.end() - 1}, "linear");
    } else {
      expect_bit_identical(fused, composite, "linear with bias");
    }
  }
}

TEST_P(FusedOpsTest, RmsNormEqualsAtRmsNormWithResidualFanOut) {
  for (const bool weight : {true, false}) {
    for (const std::vector<std::int64_t>& shape : {std::vector<std::int64_t>{10, 32}, {2, 3, 5, 32}}) {
      const at::Tensor x = randn(shape), w = randn({32}) + 1, seed = randn(shape);
      // Pre-norm block shape: h = x * 3; out = h + f(norm(h)) — h's gradient sums three
      // contributions (residual, the norm's mul and pow branches) in the engine's order.
      auto body = [&](auto norm) {
        return [=](const std::vector<at::Tensor>& in) {
          const at::Tensor h = in[0] * 3;
          return h + norm(h, weight ? in[1] : at::Tensor()).mul(0.5);
        };
      };
      const auto fused = run(body([](auto x, auto w) { return g::fused_rms_norm(x, w, 1e-5); }), {x, w}, seed);
      const auto composite =
          run(body([](auto x, auto w) { return at::rms_norm(x, {x.size(-1)}, optional(w), 1e-5); }), {x, w}, seed);
      const std::string what =
          "rms_norm " + std::string(weight ? "with" : "without") + " weight, " + std::to_string(shape.size()) + "-d";
      if (weight) {
        expect_bit_identical(fused, composite, what);
      } else {
        expect_bit_identical({fused.begin(), fused.end() - 1}, {composite.begin(), composite.end() - 1}, what);
      }
    }
  }
}

// The attention front of a block: shared normalised input -> q, k, v projections -> heads,
// RoPE on q and k, GQA expansion of k and v -> SDPA -> heads merged -> output projection.
TEST_P(FusedOpsTest, AttentionHeadsEqualTheCompositeChain) {
  const std::int64_t B = 2, T = 6, hq = 4, hkv = 2, hd = 8, d = hq * hd, r = hq / hkv;
  const auto [cos, sin] = rope_tables(T, hd, GetParam());
  // Per-sample tables [B, 1, T, hd] (positions restarting at each document): sample 1 restarts at 3.
  const at::Tensor positions = at::tensor({0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2}, at::kLong);
  const at::Tensor cos_per_sample = cos.view({T, hd}).index_select(0, positions).view({B, 1, T, hd});
  const at::Tensor sin_per_sample = sin.view({T, hd}).index_select(0, positions).view({B, 1, T, hd});
  for (const int tables : {1, 0, 2}) {  // shared, none, per sample
    const bool rotary = tables > 0;
    for (const std::int64_t kv_heads : {hkv, hq}) {
      const std::int64_t rep = hq / kv_heads;
      const at::Tensor x = randn({B * T, d}), wq = randn({d, d}), wk = randn({kv_heads * hd, d}),
                       wv = randn({kv_heads * hd, d}), wo = randn({d, d}), seed = randn({B * T, d});
      const at::Tensor c = tables == 1 ? cos : tables == 2 ? cos_per_sample : at::Tensor();
      const at::Tensor s = tables == 1 ? sin : tables == 2 ? sin_per_sample : at::Tensor();
      auto fused_f = [&](const std::vector<at::Tensor>& in) {
        const g::HeadsSpec sq{hq, c, s, 1}, sk{kv_heads, c, s, rep}, sv{kv_heads, {}, {}, rep};
        const g::Qkv h = g::fused_qkv(in[0], in[1], {}, in[2], {}, in[3], {}, B, T, hd, sq, sk, sv);
        const at::Tensor y = at::scaled_dot_product_attention(h.q, h.k, h.v, {}, 0.0, /*is_causal=*/true);
        return in[0] + g::fused_linear(g::fused_merge_heads(y), in[4], {});
      };
      auto composite_f = [&](const std::vector<at::Tensor>& in) {
        at::Tensor q = at::linear(in[0], in[1]).view({B, T, hq, hd}).transpose(1, 2).contiguous();
        at::Tensor k = at::linear(in[0], in[2]).view({B, T, -1, hd}).transpose(1, 2).contiguous();
        at::Tensor v = at::linear(in[0], in[3]).view({B, T, -1, hd}).transpose(1, 2).contiguous();
        if (rotary) {
          q = q * c + rotate_half(q) * s;
          k = k * c + rotate_half(k) * s;
        }
        if (rep > 1) {
          k = k.unsqueeze(2).expand({B, kv_heads, rep, T, hd}).reshape({B, hq, T, hd});
          v = v.unsqueeze(2).expand({B, kv_heads, rep, T, hd}).reshape({B, hq, T, hd});
        }
        const at::Tensor y = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
        return in[0] + at::linear(y.transpose(1, 2).contiguous().view({B * T, -1}), in[4]);
      };
      const std::vector<at::Tensor> inputs{x, wq, wk, wv, wo};
      expect_bit_identical(run(fused_f, inputs, seed), run(composite_f, inputs, seed),
                           std::string("attention, rotary tables ") +
                               (tables == 2 ? "per sample"
                                : rotary    ? "shared"
                                            : "off") +
                               ", repeat " + std::to_string(rep));
    }
  }
  (void)r;
}

TEST_P(FusedOpsTest, AttentionWithBiasAndUnusedValueGradient) {
  // Biases on the projections; only q and k reach the loss (v's gradient is absent).
  const std::int64_t B = 1, T = 4, H = 2, hd = 4, d = H * hd;
  const auto [cos, sin] = rope_tables(T, hd, GetParam());
  const at::Tensor x = randn({B * T, d}), w = randn({d, d}), b = randn({d}), seed = randn({B, H, T, T});
  auto fused_f = [&](const std::vector<at::Tensor>& in) {
    const g::HeadsSpec sq{H, cos, sin, 1}, sk{H, cos, sin, 1}, sv{H, {}, {}, 1};
    const g::Qkv h = g::fused_qkv(in[0], in[1], in[2], in[3], in[4], in[5], in[6], B, T, hd, sq, sk, sv);
    return at::matmul(h.q, h.k.transpose(-2, -1));
  };
  auto composite_f = [&](const std::vector<at::Tensor>& in) {
    at::Tensor q = at::linear(in[0], in[1], in[2]).view({B, T, H, hd}).transpose(1, 2).contiguous();
    at::Tensor k = at::linear(in[0], in[3], in[4]).view({B, T, H, hd}).transpose(1, 2).contiguous();
    (void)at::linear(in[0], in[5], in[6]).view({B, T, H, hd}).transpose(1, 2).contiguous();
    q = q * cos + rotate_half(q) * sin;
    k = k * cos + rotate_half(k) * sin;
    return at::matmul(q, k.transpose(-2, -1));
  };
  const std::vector<at::Tensor> inputs{x, w, b, w * 0.5, b * 2, w * 3, b};
  auto fused = run(fused_f, inputs, seed), composite = run(composite_f, inputs, seed);
  EXPECT_FALSE(fused[6].defined());
  EXPECT_FALSE(composite[6].defined());
  fused.erase(fused.begin() + 6, fused.end());
  composite.erase(composite.begin() + 6, composite.end());
  expect_bit_identical(fused, composite, "attention with bias");
}

TEST_P(FusedOpsTest, SwigluEqualsTheComposite) {
  for (const bool bias : {false, true}) {
    const at::Tensor x = randn({10, 16}), w = randn({24, 16}), bw = randn({24}), v = randn({24, 16}), bv = randn({24}),
                     seed = randn({10, 16});
    // Pre-norm MLP shape: h = x * 2; out = h + W_2(swiglu(h)) with W_2 = identity-like slice.
    auto body = [&](auto swiglu) {
      return [=](const std::vector<at::Tensor>& in) {
        const at::Tensor h = in[0] * 2;
        return h + swiglu(h, in[1], bias ? in[2] : at::Tensor(), in[3], bias ? in[4] : at::Tensor()).narrow(1, 0, 16);
      };
    };
    const auto fused =
        run(body([](auto x, auto w, auto bw, auto v, auto bv) { return g::fused_swiglu(x, w, bw, v, bv); }),
            {x, w, bw, v, bv}, seed);
    const auto composite = run(body([](auto x, auto w, auto bw, auto v, auto bv) {
                                 return at::silu(at::linear(x, w, bw)) * at::linear(x, v, bv);
                               }),
                               {x, w, bw, v, bv}, seed);
    if (bias) {
      expect_bit_identical(fused, composite, "swiglu with bias");
    } else {
      expect_bit_identical({fused[0], fused[1], fused[2], fused[4]},
                           {composite[0], composite[1], composite[2], composite[4]}, "swiglu");
    }
  }
}

// Edge shapes of the CPU loops: one token, one head, odd head size without RoPE.
TEST_P(FusedOpsTest, HeadsEdgeShapes) {
  struct Shape {
    std::int64_t B, T, H, hd, repeat;
    bool rotary;
  };
  for (const Shape& sh : {Shape{2, 1, 2, 4, 2, true}, Shape{1, 3, 1, 6, 1, true}, Shape{2, 3, 2, 5, 2, false}}) {
    const std::int64_t d = sh.H * sh.hd;
    const auto tables = rope_tables(sh.T, sh.hd + sh.hd % 2, GetParam());
    const at::Tensor c = sh.rotary ? tables.first : at::Tensor(), s = sh.rotary ? tables.second : at::Tensor();
    const at::Tensor x = randn({sh.B * sh.T, d}), w = randn({d, d}),
                     seed = randn({sh.B, sh.H * sh.repeat, sh.T, sh.hd});
    auto fused_f = [&](const std::vector<at::Tensor>& in) {
      const g::HeadsSpec spec{sh.H, c, s, sh.repeat};
      return g::fused_qkv(in[0], in[1], {}, in[1], {}, in[1], {}, sh.B, sh.T, sh.hd, spec, spec, spec).k;
    };
    auto composite_f = [&](const std::vector<at::Tensor>& in) {
      at::Tensor k = at::linear(in[0], in[1]).view({sh.B, sh.T, sh.H, sh.hd}).transpose(1, 2).contiguous();
      if (sh.rotary) k = k * c + rotate_half(k) * s;
      if (sh.repeat > 1)
        k = k.unsqueeze(2).expand({sh.B, sh.H, sh.repeat, sh.T, sh.hd}).reshape({sh.B, sh.H * sh.repeat, sh.T, sh.hd});
      return k;
    };
    expect_bit_identical(run(fused_f, {x, w}, seed), run(composite_f, {x, w}, seed),
                         "heads B=" + std::to_string(sh.B) + " T=" + std::to_string(sh.T) +
                             " H=" + std::to_string(sh.H) + " hd=" + std::to_string(sh.hd));
  }
}

TEST_P(FusedOpsTest, NonRowMajorWeightsTakeTheComposite) {
  const at::Tensor x = randn({6, 8}), wt = randn({8, 8}).t(), seed = randn({6, 8});  // a transposed weight
  auto f = [](auto linear) { return [=](const std::vector<at::Tensor>& in) { return linear(in[0], in[1]); }; };
  expect_bit_identical(run(f([](auto x, auto w) { return g::fused_linear(x, w, {}); }), {x, wt.contiguous().t()}, seed),
                       run(f([](auto x, auto w) { return at::linear(x, w); }), {x, wt.contiguous().t()}, seed),
                       "linear, transposed weight");
}

INSTANTIATE_TEST_SUITE_P(Dtypes, FusedOpsTest, ::testing::Values(at::kFloat, at::kBFloat16, at::kHalf, at::kDouble),
                         [](const auto& info) { return std::string(c10::toString(info.param)); });

TEST(FusedOpsBehaviourTest, NoGradRecordsNoGraph) {
  const at::Tensor x = at::randn({4, 8}, at::kFloat).requires_grad_(true), w = at::randn({3, 8}).requires_grad_(true);
  c10::GradMode::set_enabled(false);  // restored below
  struct Restore {
    ~Restore() { c10::GradMode::set_enabled(true); }
  } restore;
  EXPECT_FALSE(g::fused_linear(x, w, {}).requires_grad());
  EXPECT_FALSE(g::fused_rms_norm(x, {}, 1e-5).requires_grad());
  const g::HeadsSpec spec{2, {}, {}, 1};
  const at::Tensor wqkv = at::randn({8, 8}).requires_grad_(true);
  EXPECT_FALSE(g::fused_qkv(x, wqkv, {}, wqkv, {}, wqkv, {}, 2, 2, 4, spec, spec, spec).q.requires_grad());
  EXPECT_FALSE(g::fused_swiglu(x, w, {}, w, {}).requires_grad());
}

TEST(FusedOpsBehaviourTest, DoubleBackwardIsRefusedClearly) {
  const at::Tensor x = at::randn({4, 8}).requires_grad_(true), w = at::randn({3, 8}).requires_grad_(true);
  const at::Tensor y = g::fused_linear(x, w, {}).pow(2).sum();
  try {
    (void)torch::autograd::grad({y}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true);
    FAIL() << "double backward through a fused op must be refused";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("double backward"), std::string::npos) << e.what();
  }
}

TEST(FusedOpsBehaviourTest, SavedInputsModifiedInPlaceAreDetected) {
  const at::Tensor w = at::randn({3, 8}).requires_grad_(true);
  at::Tensor x = at::randn({4, 8}).requires_grad_(true) * 1;  // non-leaf, may be modified in place
  const at::Tensor y = g::fused_linear(x, w, {}).sum();
  x.mul_(2);
  EXPECT_THROW(y.backward(), c10::Error);
}

TEST(FusedOpsBehaviourTest, UnsupportedLayoutsFallBackToTheComposite) {
  // A 3-d input and a column-major 2-d input take at::linear; results still agree.
  const at::Tensor w = at::randn({5, 8});
  const at::Tensor x3 = at::randn({2, 3, 8});
  EXPECT_TRUE(at::equal(g::fused_linear(x3, w, {}), at::linear(x3, w)));
  const at::Tensor xt = at::randn({8, 4}).t();
  EXPECT_TRUE(at::equal(g::fused_linear(xt, w, {}), at::linear(xt, w)));
}

}  // namespace
