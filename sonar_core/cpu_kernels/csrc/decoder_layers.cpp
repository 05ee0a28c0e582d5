// A run of plain pre-norm decoder layers in one call: the kernel calls of
// sonar_core/layers/direct_layers.py's DirectLayer.forward, in the same order with the same
// arguments, looped in C++.
//
// Why: a decode or verification step of a small model is about ten kernel calls per layer, and
// calling them from Python costs tens of microseconds per layer (argument conversion, views,
// attribute lookups): a few milliseconds of a SmolLM2 step whose matmuls take about twelve. Here the
// loop, the views and the residual add cost a few microseconds per layer. Each kernel is reached
// through the dispatcher (looked up once), so this file depends only on the operators' schemas,
// and the result is the same bits as the Python loop's.
//
// Per layer l the flat lists hold:
//   weights[6 l ..]: input norm weight, packed qkv, packed o, post-attention norm weight, packed
//                    gate_up, packed down (pack_linear_weight's layout);
//   biases[4 l ..]:  the four projections' biases (None where a projection has none);
//   caches[2 l ..]:  the layer's key and value caches;
//   ints[8 l ..]:    num_heads, num_kv_heads, head_dim, sliding window (0: none), and the four
//                    projections' output features;
//   floats[3 l ..]:  input norm eps, post-attention norm eps, attention scale.
// With attention_input, the first layer's attention reads it instead of the input norm of hidden
// (whose weight is then not read): EAGLE-3's first draft layer attends over its embedding and the
// target's state side by side while its residual stream is the state alone.
// With capture, the state after capture_after[i] layers of the run is copied into the columns
// capture_columns[i] onwards of capture's first T rows (a hidden-state capture's buffer), so a
// capture does not split the run into one call per recorded layer.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace {

constexpr int64_t kWeights = 6, kBiases = 4, kCaches = 2, kInts = 8, kFloats = 3;

template <typename Signature>
c10::TypedOperatorHandle<Signature> kernel(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// The kernels' C++ signatures, exactly as they are registered (cpu_ops.cpp, skinny_linear.cpp).
struct Kernels {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm =
      kernel<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("sonar::rms_norm");
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&, double)>
      add_rms_norm = kernel<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                               const at::Tensor&, double)>("sonar::add_rms_norm");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                      int64_t, bool)>
      skinny_linear = kernel<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                        int64_t, bool)>("sonar::skinny_linear");
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&)> rotary_embedding =
      kernel<void(at::Tensor, const at::Tensor&, const at::Tensor&)>("sonar::rotary_embedding_");
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor, const at::Tensor&)>
      store_kv = kernel<void(const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor, const at::Tensor&)>(
          "sonar::store_kv_");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, double, bool, int64_t)>
      paged_attention = kernel<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const at::Tensor&, const at::Tensor&, double, bool, int64_t)>(
          "sonar::paged_attention");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_and_mul =
      kernel<at::Tensor(const at::Tensor&)>("sonar::silu_and_mul");
};

const Kernels& kernels() {
  static const Kernels found;
  return found;
}

at::Tensor decoder_layers(const at::Tensor& hidden_in, const at::Tensor& cos, const at::Tensor& signed_sin,
                          at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                          at::TensorList caches, at::IntArrayRef ints, at::ArrayRef<double> floats,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, const at::Tensor& slot_mapping, bool causal,
                          const std::optional<at::Tensor>& attention_input, const std::optional<at::Tensor>& capture,
                          at::IntArrayRef capture_after, at::IntArrayRef capture_columns) {
  const auto layers = static_cast<int64_t>(weights.size()) / kWeights;
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(weights.size()) == layers * kWeights &&
                  static_cast<int64_t>(biases.size()) == layers * kBiases &&
                  static_cast<int64_t>(caches.size()) == layers * kCaches &&
                  static_cast<int64_t>(ints.size()) == layers * kInts &&
                  static_cast<int64_t>(floats.size()) == layers * kFloats,
              "decoder_layers: every list must hold the same number of layers");
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.is_contiguous(), "decoder_layers: hidden must be contiguous [T, H]");
  TORCH_CHECK(capture_after.size() == capture_columns.size() && (capture.has_value() || capture_after.empty()),
              "decoder_layers: capture_after and capture_columns must pair up, and need a capture buffer");
  const Kernels& k = kernels();
  const int64_t tokens = hidden_in.size(0);
  at::Tensor hidden = hidden_in;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kWeights;
    const int64_t* n = ints.data() + l * kInts;
    const double* f = floats.data() + l * kFloats;
    const int64_t num_heads = n[0], num_kv_heads = n[1], head_dim = n[2], window = n[3];
    const int64_t qk_rows = (num_heads + num_kv_heads) * head_dim;
    const at::Tensor& k_cache = caches[l * kCaches];
    const at::Tensor& v_cache = caches[l * kCaches + 1];

    const at::Tensor normed =
        l == 0 && attention_input.has_value() ? *attention_input : k.rms_norm.call(hidden, w[0], f[0]);
    const at::Tensor qkv = k.skinny_linear.call(normed, w[1], biases.get(l * kBiases), n[4], false);
    const at::Tensor qk = qkv.narrow(1, 0, qk_rows).view({tokens, num_heads + num_kv_heads, head_dim});
    k.rotary_embedding.call(qk, cos, signed_sin);
    const at::Tensor v = qkv.narrow(1, qk_rows, qkv.size(1) - qk_rows).view({tokens, num_kv_heads, head_dim});
    k.store_kv.call(qk.narrow(1, num_heads, num_kv_heads), v, k_cache, v_cache, slot_mapping);
    const at::Tensor attended = k.paged_attention.call(qk.narrow(1, 0, num_heads), k_cache, v_cache, block_tables,
                                                       seq_lens, query_start_loc, f[2], causal, window);
    const at::Tensor out = k.skinny_linear.call(attended, w[2], biases.get(l * kBiases + 1), n[5], false);
    auto [post_normed, summed] = k.add_rms_norm.call(out, hidden, w[3], f[1]);
    const at::Tensor gate_up = k.skinny_linear.call(post_normed, w[4], biases.get(l * kBiases + 2), n[6], false);
    const at::Tensor down = k.skinny_linear.call(k.silu_and_mul.call(gate_up), w[5], biases.get(l * kBiases + 3), n[7], false);
    hidden = summed + down;
    for (size_t i = 0; i < capture_after.size(); ++i) {
      if (capture_after[i] == l + 1) {
        capture->narrow(0, 0, tokens).narrow(1, capture_columns[i], hidden.size(1)).copy_(hidden);
      }
    }
  }
  return hidden;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sonar, m) {
  m.def(
      "decoder_layers(Tensor hidden, Tensor cos, Tensor signed_sin, Tensor[] weights, Tensor?[] biases, "
      "Tensor(a!)[] caches, int[] ints, float[] floats, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
      "Tensor slot_mapping, bool causal, Tensor? attention_input=None, Tensor(b!)? capture=None, "
      "int[] capture_after=[], int[] capture_columns=[]) -> Tensor");
}

TORCH_LIBRARY_IMPL(sonar, CPU, m) { m.impl("decoder_layers", &decoder_layers); }
