// DeviceSetting: a config field naming a device the way Modalities configs do,
// an integer N (meaning cuda:N) or a string "cpu", "cuda", "cuda:N". Checked
// while the config is parsed; the component turns `text` into a c10::Device
// (e.g. with parse_run_device from run_context.h) and checks CUDA availability
// when it is built. Header-only: a plain struct with its Codec.
#pragma once

#include <modalities/sdk/schema.h>

#include <c10/core/Device.h>
#include <fmt/format.h>

#include <exception>
#include <stdexcept>
#include <string>

namespace modalities {

/// `device = 0` is stored as "cuda:0"; strings are kept as written.
struct DeviceSetting {
  std::string text = "cpu";
};

template <>
struct Codec<DeviceSetting> {
  static std::string type_name() { return "int | \"cpu\" | \"cuda\" | \"cuda:N\""; }
  static Parsed parse(const Value& v, DeviceSetting& out, const std::string& path, ParseContext& ctx) {
    if (ctx.dry_run() && detail::pending_fits(v, {"int", "string"})) return Parsed::kPending;
    if (v.is_int()) {
      if (v.as_int() < 0) {
        ctx.fail(path, fmt::format("a CUDA device index must be >= 0, got {}", v.as_int()));
        return Parsed::kError;
      }
      out.text = fmt::format("cuda:{}", v.as_int());
      return Parsed::kOk;
    }
    if (!v.is_string()) return detail::type_error(v, "a device index or \"cpu\"", path, ctx);
    // c10's own parser, so that every accepted string is one c10::Device accepts later.
    try {
      const c10::Device d(v.as_string());
      if (!d.is_cpu() && !d.is_cuda()) throw std::invalid_argument("not cpu/cuda");
    } catch (const std::exception&) {
      ctx.fail(path, fmt::format("expected \"cpu\", \"cuda\", \"cuda:N\" or an integer N, got \"{}\"", v.as_string()));
      return Parsed::kError;
    }
    out.text = v.as_string();
    return Parsed::kOk;
  }
  static std::string repr(const DeviceSetting& d) { return fmt::format("\"{}\"", d.text); }
};

}  // namespace modalities
