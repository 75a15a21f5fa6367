// The one decoder of every decoder-only family (decoder/spec.h; the families in decoder/families/): pre- or
// post-norm blocks of RMS norms, rotary position embeddings (per layer: none, or one of the spec's RoPEs, on the
// first rotary_dim of each head), grouped-query attention with optional q/k norms, scaling, soft-capping and sliding
// windows, a gated MLP (separate or fused projections), and the multipliers some families put on the embeddings,
// the residual branches and the logits. Module names are transformers', so checkpoints, PEFT adapters and 4-bit
// layers load and save by name.
#include <cmath>
#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "models/decoder/rope.h"
#include "models/decoder/spec.h"
#include "models/dropout.h"
#include "models/fused_ops.h"
#include "models/hf_config.h"
#include "models/kv_cache.h"
#include "models/layers.h"
#include "models/model.h"
#include "models/segment_attention.h"

namespace trainer {
namespace {

at::Tensor rms_norm(NormKind kind, const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (kind == NormKind::kLlama) return llama_rms_norm(x, weight, eps);
  // OLMo 2 and Gemma multiply in fp32 and cast the product: the fused CPU kernel's kFp32Product, Gemma's weight as
  // 1 + w (its gradient flows back through the sum); elsewhere the composition transformers writes.
  const at::Tensor fused = fused_rms_norm(x, kind == NormKind::kGemma ? 1.0 + weight.to(at::kFloat) : weight, eps,
                                          RmsNormStyle::kFp32Product);
  if (fused.defined()) return fused;
  const at::Tensor h = x.to(at::kFloat);
  const at::Tensor normed = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  if (kind == NormKind::kFp32) return (weight.to(at::kFloat) * normed).to(x.scalar_type());
  return (normed * (1.0 + weight.to(at::kFloat))).to(x.scalar_type());  // kGemma
}

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// x (B, H, T, hd), cos and sin (B or 1, 1, T, rotary_dim): the first rotary_dim of each head rotate, the rest pass.
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t rotary = cos.size(-1), dim = x.size(-1);
  if (rotary == dim) return x * cos + rotate_half(x) * sin;
  const at::Tensor turned = x.narrow(-1, 0, rotary);
  return at::cat({turned * cos + rotate_half(turned) * sin, x.narrow(-1, rotary, dim - rotary)}, -1);
}

// The keys and values (B, Hkv, T, hd) a layer attends over, after its q/k norms, RoPE and cache: what a Gemma 4
// layer that shares them (DecoderLayerSpec::kv_from) takes from the layer that computed them.
struct KeysValues {
  at::Tensor keys, values;
};

// An RMS norm without a weight (Gemma 4's values): normalised in fp32, cast back.
at::Tensor unit_rms_norm(const at::Tensor& x, double eps) {
  const at::Tensor h = x.to(at::kFloat);
  return (h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps)).to(x.scalar_type());
}

class DecoderAttention : public Module {
 public:
  DecoderAttention(std::shared_ptr<const DecoderSpec> spec, std::size_t index, const c10::TensorOptions& o)
      : spec_holder_(std::move(spec)), spec_(*spec_holder_), layer_(spec_.layers[index]),
        head_dim_(spec_.head_dim_of(index)), kv_heads_(spec_.kv_heads_of(index)) {
    const DecoderSpec& s = spec_;
    const int64_t q_out = s.heads * head_dim_, kv_out = kv_heads_ * head_dim_;
    if (s.fused_qkv) {
      qkv_proj = register_module("qkv_proj", std::make_shared<Linear>(s.hidden, q_out + 2 * kv_out, s.qkv_bias, o));
    } else {
      q_proj = register_module("q_proj", std::make_shared<Linear>(s.hidden, q_out, s.qkv_bias, o));
      if (!layer_.kv_from) {
        k_proj = register_module("k_proj", std::make_shared<Linear>(s.hidden, kv_out, s.qkv_bias, o));
        if (!layer_.k_eq_v) v_proj = register_module("v_proj", std::make_shared<Linear>(s.hidden, kv_out, s.qkv_bias, o));
      }
    }
    o_proj = register_module("o_proj", std::make_shared<Linear>(q_out, s.hidden, s.o_bias, o));
    if (s.qk_norm != QkNorm::kNone) {
      const bool whole = s.qk_norm == QkNorm::kWholeProjection;
      q_norm = register_module("q_norm", std::make_shared<NormWeight>(whole ? q_out : head_dim_, o));
      if (!layer_.kv_from) k_norm = register_module("k_norm", std::make_shared<NormWeight>(whole ? kv_out : head_dim_, o));
    }
    attention_dropout = register_module("attention_dropout", std::make_shared<Dropout>(s.attention_dropout));
  }

  // x (B, T, D); cos/sin (B or 1, T, rotary_dim); mask (B, 1, T, Tk) bool. With a cache, the new keys and values
  // are written into this layer's buffers and attention runs over all filled positions. With a segment layout
  // (packed rows) the attention runs per segment, with a varlen layout as one variable-length flash attention
  // within `window` (CUDA); either way `mask` is unused. A layer that shares another's keys and values takes them
  // as `shared`; `produced`, when given, receives this layer's.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& mask,
                     KvCache* cache = nullptr, std::size_t layer = 0, const SegmentLayout* layout = nullptr,
                     const VarlenLayout* varlen = nullptr, std::optional<int64_t> window = std::nullopt,
                     const KeysValues* shared = nullptr, KeysValues* produced = nullptr) {
    const int64_t b = x.size(0), t = x.size(1), hd = head_dim_;
    const int64_t q_out = spec_.heads * hd, kv_out = kv_heads_ * hd;
    at::Tensor q, k, v;  // (B, T, H * hd), (B, T, Hkv * hd)
    if (qkv_proj) {
      const at::Tensor qkv = qkv_proj->forward(x);
      q = qkv.narrow(-1, 0, q_out);
      k = qkv.narrow(-1, q_out, kv_out);
      v = qkv.narrow(-1, q_out + kv_out, kv_out);
    } else {
      q = q_proj->forward(x);
      if (!shared) {
        k = k_proj->forward(x);
        v = v_proj ? v_proj->forward(x) : k;  // attention_k_eq_v: the values are the keys before their norm
      }
    }
    if (spec_.qk_norm == QkNorm::kWholeProjection) {
      q = rms_norm(spec_.norm, q, q_norm->weight, spec_.eps);
      if (!shared) k = rms_norm(spec_.norm, k, k_norm->weight, spec_.eps);
    }
    if (spec_.clip_qkv) {  // OLMoE
      q = q.clamp(-*spec_.clip_qkv, *spec_.clip_qkv);
      if (!shared) {
        k = k.clamp(-*spec_.clip_qkv, *spec_.clip_qkv);
        v = v.clamp(-*spec_.clip_qkv, *spec_.clip_qkv);
      }
    }
    q = q.reshape({b, t, spec_.heads, hd});
    if (spec_.qk_norm == QkNorm::kPerHead) q = rms_norm(spec_.norm, q, q_norm->weight, spec_.eps);
    q = q.transpose(1, 2);  // (B, H, T, hd)
    if (shared) {
      k = shared->keys;
      v = shared->values;
    } else {
      k = k.reshape({b, t, kv_heads_, hd});
      if (spec_.qk_norm == QkNorm::kPerHead) k = rms_norm(spec_.norm, k, k_norm->weight, spec_.eps);
      v = v.reshape({b, t, kv_heads_, hd});
      if (spec_.v_norm) v = unit_rms_norm(v, spec_.eps);
      k = k.transpose(1, 2);  // (B, Hkv, T, hd)
      v = v.transpose(1, 2);
    }
    if (layer_.rope) {
      const at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
      q = apply_rotary(q, c, s);
      if (!shared) k = apply_rotary(k, c, s);
    }
    if (cache && !shared) std::tie(k, v) = cache->append(layer, k, v);
    if (produced) *produced = {k, v};
    if (varlen) return o_proj->forward(attend_varlen(*varlen, q, k, v, window, spec_.attention_scale));
    if (layout) {
      return o_proj->forward(attend_per_segment(
          *layout, q, k, v,
          [this](const at::Tensor& qg, const at::Tensor& kg, const at::Tensor& vg, const at::Tensor& allowed,
                 const SegmentGroup&) { return attend(qg, kg, vg, allowed); }));
    }
    return o_proj->forward(attend(q, k, v, mask).transpose(1, 2).reshape({b, t, q_out}));
  }

  // Whether scores must be computed here rather than by scaled_dot_product_attention: keyed attention dropout in
  // training, or soft-capped scores.
  bool explicit_attention() const {
    return attention_dropout->explicit_attention(is_training()) || spec_.attention_softcap.has_value();
  }

  // q (B, H, Tq, hd), k and v (B, Hkv, Tk, hd), mask (B, 1, Tq, Tk) bool -> (B, H, Tq, hd).
  at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask) const {
    if (explicit_attention()) {
      // transformers' eager attention: keys and values repeated per group, scores scaled (and soft-capped),
      // softmax in fp32, dropout on the probabilities.
      const int64_t group = spec_.heads / kv_heads_;
      const at::Tensor keys = group == 1 ? k : k.repeat_interleave(group, 1);
      const at::Tensor values = group == 1 ? v : v.repeat_interleave(group, 1);
      at::Tensor scores = at::matmul(q, keys.transpose(-2, -1)) * spec_.attention_scale;
      if (spec_.attention_softcap) scores = at::tanh(scores / *spec_.attention_softcap) * *spec_.attention_softcap;
      scores = scores + additive_mask(mask, q.scalar_type());
      const at::Tensor probabilities = at::softmax(scores.to(at::kFloat), -1).to(q.scalar_type());
      return at::matmul(attention_dropout->attention(probabilities, is_training()), values);
    }
    return at::scaled_dot_product_attention(q, k, v, mask, attention_dropout->sdpa_p(is_training()),
                                            /*is_causal=*/false, spec_.attention_scale,
                                            /*enable_gqa=*/kv_heads_ != spec_.heads);
  }

  std::shared_ptr<Linear> q_proj, k_proj, v_proj, qkv_proj, o_proj;
  std::shared_ptr<NormWeight> q_norm, k_norm;
  std::shared_ptr<Dropout> attention_dropout;

 private:
  std::shared_ptr<const DecoderSpec> spec_holder_;  // shared with the model and its other modules
  const DecoderSpec& spec_;
  const DecoderLayerSpec& layer_;
  int64_t head_dim_, kv_heads_;
};

class DecoderMlp : public Module {
 public:
  DecoderMlp(const DecoderSpec& s, int64_t intermediate, const c10::TensorOptions& o) : act_(s.act) {
    if (s.fused_gate_up) {
      gate_up_proj =
          register_module("gate_up_proj", std::make_shared<Linear>(s.hidden, 2 * intermediate, s.mlp_bias, o));
    } else {
      gate_proj = register_module("gate_proj", std::make_shared<Linear>(s.hidden, intermediate, s.mlp_bias, o));
      up_proj = register_module("up_proj", std::make_shared<Linear>(s.hidden, intermediate, s.mlp_bias, o));
    }
    down_proj = register_module("down_proj", std::make_shared<Linear>(intermediate, s.hidden, s.mlp_bias, o));
  }
  at::Tensor forward(const at::Tensor& x) {
    if (gate_up_proj) {
      const at::Tensor both = gate_up_proj->forward(x);
      const int64_t half = both.size(-1) / 2;
      return down_proj->forward(both.narrow(-1, half, half) * activation(both.narrow(-1, 0, half), act_));
    }
    return down_proj->forward(activation(gate_proj->forward(x), act_) * up_proj->forward(x));
  }
  std::shared_ptr<Linear> gate_proj, up_proj, gate_up_proj, down_proj;

 private:
  std::string act_;
};

// One expert: a gated MLP under the names the files give it (gate_proj / up_proj / down_proj, Mixtral's w1 / w3 / w2).
class Expert : public Module {
 public:
  Expert(const DecoderSpec& s, const c10::TensorOptions& o) {
    const MoeSpec& m = s.moe;
    gate = register_module(m.gate, std::make_shared<Linear>(s.hidden, m.intermediate, false, o));
    up = register_module(m.up, std::make_shared<Linear>(s.hidden, m.intermediate, false, o));
    down = register_module(m.down, std::make_shared<Linear>(m.intermediate, s.hidden, false, o));
  }
  at::Tensor forward(const at::Tensor& x, const std::string& act) const {
    return down->forward(activation(gate->forward(x), act) * up->forward(x));
  }
  std::shared_ptr<Linear> gate, up, down;
};

class Experts : public Module {
 public:
  void push_back(std::shared_ptr<Expert> expert) {
    items.push_back(register_module(std::to_string(items.size()), std::move(expert)));
  }
  std::vector<std::shared_ptr<Expert>> items;
  std::function<void()> pass_hook;  // set from outside (StackedExpertLayers): called before each pass over the experts
};

// The experts' part of a sparse MLP: flat (N, D) tokens, their top-k `weights` and `chosen` experts (N, k); the
// (token, slot) assignments sorted by expert, stably (within an expert, tokens in order), each expert run once over
// its tokens (`expert(e, tokens)`), the outputs weighted and added back per token in expert order.
at::Tensor combine(const at::Tensor& flat, const at::Tensor& weights, const at::Tensor& chosen, int64_t experts,
                   const std::function<at::Tensor(int64_t, const at::Tensor&)>& expert) {
  const int64_t top_k = chosen.size(-1);
  const at::Tensor expert_of = chosen.reshape({-1});
  const at::Tensor order = std::get<1>(at::sort(expert_of, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  const at::Tensor token_of = at::floor_divide(order, top_k);
  const at::Tensor counts = at::bincount(expert_of, {}, experts).to(at::kCPU);
  const int64_t* count = counts.data_ptr<int64_t>();
  const at::Tensor routed = flat.index_select(0, token_of);
  std::vector<at::Tensor> outputs;
  int64_t start = 0;
  for (int64_t e = 0; e < experts; ++e) {
    if (count[e] == 0) continue;
    outputs.push_back(expert(e, routed.narrow(0, start, count[e])));
    start += count[e];
  }
  const at::Tensor weighted = at::cat(outputs, 0) * weights.reshape({-1}).index_select(0, order).unsqueeze(-1);
  return at::zeros_like(flat).index_add(0, token_of, weighted.to(flat.scalar_type()));
}

// The sparse MLP: the router's top-k experts per token, tokens grouped by expert (one sort, then one pass of each
// expert over its tokens: no loop over tokens, no expert over tokens it was not chosen for), the outputs weighted
// and summed back per token in expert order, as transformers' experts loop adds them.
class MoeMlp : public Module {
 public:
  MoeMlp(const DecoderSpec& s, const c10::TensorOptions& o) : spec_(s.moe), act_(s.act) {
    router = register_module(spec_.router, std::make_shared<Linear>(s.hidden, spec_.experts, false, o));
    experts = register_module("experts", std::make_shared<Experts>());
    for (int64_t e = 0; e < spec_.experts; ++e) experts->push_back(std::make_shared<Expert>(s, o));
    if (spec_.jitter > 0) jitter = register_module("jitter", std::make_shared<Dropout>(spec_.jitter));
    if (spec_.shared_expert > 0) {
      shared_expert = register_module("shared_expert", std::make_shared<DecoderMlp>(s, spec_.shared_expert, o));
      shared_expert_gate = register_module("shared_expert_gate", std::make_shared<Linear>(s.hidden, 1, false, o));
    }
  }

  // x (B, T, D) -> (B, T, D); `router_logits`, when given, receives the router's logits (B * T, experts).
  at::Tensor forward(const at::Tensor& input, at::Tensor* router_logits = nullptr) const {
    // Mixtral's jitter in training: router and experts see the input times keyed uniform noise in [1 - j, 1 + j].
    const at::Tensor x = jitter && is_training()
                             ? input * (1.0 - spec_.jitter + 2.0 * spec_.jitter * jitter->uniform(input)).to(input.scalar_type())
                             : input;
    const int64_t hidden = x.size(-1);
    const at::Tensor flat = x.reshape({-1, hidden});
    const at::Tensor logits = router->forward(flat);
    if (router_logits) *router_logits = logits;
    const at::Tensor probabilities = at::softmax(logits.to(at::kFloat), -1);
    auto [weights, chosen] = at::topk(probabilities, spec_.top_k, -1);  // (N, k)
    if (spec_.norm_topk) weights = weights / weights.sum(-1, /*keepdim=*/true);
    if (spec_.weights_in_dtype) weights = weights.to(logits.scalar_type());
    if (experts->pass_hook) experts->pass_hook();
    at::Tensor out = combine(flat, weights, chosen, spec_.experts, [&](int64_t e, const at::Tensor& tokens) {
      return experts->items[static_cast<std::size_t>(e)]->forward(tokens, act_);
    });
    if (shared_expert)  // Qwen2-MoE: plus the shared expert, gated per token
      out = out + at::sigmoid(shared_expert_gate->forward(flat)) * shared_expert->forward(flat);
    return out.view(x.sizes());
  }

  std::shared_ptr<Linear> router;
  std::shared_ptr<Experts> experts;
  std::shared_ptr<DecoderMlp> shared_expert;
  std::shared_ptr<Linear> shared_expert_gate;
  std::shared_ptr<Dropout> jitter;

 private:
  const MoeSpec& spec_;
  std::string act_;
};

// Gemma 4's router: the residual RMS-normed without a weight, times `scale` and hidden^-0.5, scored by `proj`.
class Gemma4Router : public Module {
 public:
  Gemma4Router(const DecoderSpec& s, const c10::TensorOptions& o) {
    proj = register_module("proj", std::make_shared<Linear>(s.hidden, s.moe.experts, false, o));
    scale = at::ones({s.hidden}, o);
    per_expert_scale = at::ones({s.moe.experts}, o);
    register_parameter("scale", &scale);
    register_parameter("per_expert_scale", &per_expert_scale);
  }
  std::shared_ptr<Linear> proj;
  at::Tensor scale, per_expert_scale;
};

// Experts as two stacked tensors (Gemma 4's files): gate_up_proj (E, 2I, H), gate rows first; down_proj (E, H, I).
class StackedExperts : public Module {
 public:
  StackedExperts(const DecoderSpec& s, const c10::TensorOptions& o) {
    const MoeSpec& m = s.moe;
    gate_up_proj = at::empty({m.experts, 2 * m.intermediate, s.hidden}, o);
    down_proj = at::empty({m.experts, s.hidden, m.intermediate}, o);
    register_parameter("gate_up_proj", &gate_up_proj);
    register_parameter("down_proj", &down_proj);
  }
  at::Tensor forward(int64_t e, const at::Tensor& x, const std::string& act) const {
    const at::Tensor both = at::linear(x, gate_up_proj.select(0, e));
    const int64_t half = both.size(-1) / 2;
    return at::linear(activation(both.narrow(-1, 0, half), act) * both.narrow(-1, half, half), down_proj.select(0, e));
  }
  at::Tensor gate_up_proj, down_proj;
};

class DecoderBlock : public Module {
 public:
  DecoderBlock(std::shared_ptr<const DecoderSpec> spec, std::size_t index, const c10::TensorOptions& o)
      : spec_holder_(std::move(spec)), spec_(*spec_holder_) {
    const DecoderSpec& s = spec_;
    self_attn = register_module("self_attn", std::make_shared<DecoderAttention>(spec_holder_, index, o));
    if (s.layers[index].sparse && !s.moe.gemma4)
      moe = register_module(s.moe.block, std::make_shared<MoeMlp>(s, o));
    else
      mlp = register_module("mlp", std::make_shared<DecoderMlp>(s, s.intermediate_of(index), o));
    if (s.layers[index].sparse && s.moe.gemma4) {  // beside the dense MLP
      router = register_module("router", std::make_shared<Gemma4Router>(s, o));
      experts = register_module("experts", std::make_shared<StackedExperts>(s, o));
    }
    auto make_norm = [&](const std::string& name) -> std::shared_ptr<NormWeight> {
      return name.empty() ? nullptr : register_module(name, std::make_shared<NormWeight>(s.hidden, o));
    };
    pre_attention_norm = make_norm(s.pre_attention_norm);
    post_attention_norm = make_norm(s.post_attention_norm);
    pre_mlp_norm = make_norm(s.pre_mlp_norm);
    post_mlp_norm = make_norm(s.post_mlp_norm);
    if (s.residual_dropout > 0) {
      resid_attn_dropout = register_module("resid_attn_dropout", std::make_shared<Dropout>(s.residual_dropout));
      resid_mlp_dropout = register_module("resid_mlp_dropout", std::make_shared<Dropout>(s.residual_dropout));
    }
    if (router) {
      post_feedforward_layernorm_1 = make_norm("post_feedforward_layernorm_1");
      post_feedforward_layernorm_2 = make_norm("post_feedforward_layernorm_2");
      pre_feedforward_layernorm_2 = make_norm("pre_feedforward_layernorm_2");
    }
    if (s.per_layer_input > 0) {
      per_layer_input_gate =
          register_module("per_layer_input_gate", std::make_shared<Linear>(s.hidden, s.per_layer_input, false, o));
      per_layer_projection =
          register_module("per_layer_projection", std::make_shared<Linear>(s.per_layer_input, s.hidden, false, o));
      post_per_layer_input_norm = make_norm("post_per_layer_input_norm");
    }
  }
  // `per_layer_input` (B, T, per_layer_input): this layer's slice of the per-layer input embeddings, or undefined.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& mask,
                     KvCache* cache = nullptr, std::size_t layer = 0, const SegmentLayout* layout = nullptr,
                     const VarlenLayout* varlen = nullptr, std::optional<int64_t> window = std::nullopt,
                     const at::Tensor& per_layer_input = {}, const KeysValues* shared = nullptr,
                     KeysValues* produced = nullptr, at::Tensor* router_logits = nullptr) {
    at::Tensor a = self_attn->forward(norm(pre_attention_norm, x), cos, sin, mask, cache, layer, layout, varlen, window,
                                      shared, produced);
    a = norm(post_attention_norm, a);
    if (resid_attn_dropout) a = resid_attn_dropout->forward(a, is_training());
    const at::Tensor h = residual(x, a);
    const at::Tensor mlp_in = norm(pre_mlp_norm, h);
    at::Tensor m = moe ? moe->forward(mlp_in, router_logits) : mlp->forward(mlp_in);
    if (router) m = norm(post_feedforward_layernorm_1, m) + gemma4_experts(h, router_logits);
    m = norm(post_mlp_norm, m);
    if (resid_mlp_dropout) m = resid_mlp_dropout->forward(m, is_training());
    at::Tensor out = residual(h, m);
    if (per_layer_input_gate) {
      // Gemma 4: gate the hidden state by this layer's input embedding, project back, norm, add.
      const at::Tensor gated = activation(per_layer_input_gate->forward(out), spec_.act) * per_layer_input;
      out = out + norm(post_per_layer_input_norm, per_layer_projection->forward(gated));
    }
    if (layer_scalar.defined()) out = out * layer_scalar;
    return out;
  }
  std::shared_ptr<DecoderAttention> self_attn;
  std::shared_ptr<DecoderMlp> mlp;
  std::shared_ptr<MoeMlp> moe;
  std::shared_ptr<Gemma4Router> router;
  std::shared_ptr<StackedExperts> experts;
  std::shared_ptr<NormWeight> post_feedforward_layernorm_1, post_feedforward_layernorm_2, pre_feedforward_layernorm_2;
  std::shared_ptr<NormWeight> pre_attention_norm, post_attention_norm, pre_mlp_norm, post_mlp_norm;
  std::shared_ptr<Dropout> resid_attn_dropout, resid_mlp_dropout;
  std::shared_ptr<Linear> per_layer_input_gate, per_layer_projection;
  std::shared_ptr<NormWeight> post_per_layer_input_norm;
  at::Tensor layer_scalar;  // Gemma 4's buffer (1) in the compute dtype, or undefined; set by the model

 private:
  at::Tensor norm(const std::shared_ptr<NormWeight>& n, const at::Tensor& x) const {
    return n ? rms_norm(spec_.norm, x, n->weight, spec_.eps) : x;
  }
  // Gemma 4's experts over the block's residual h (B, T, D), as Gemma4TextDecoderLayer runs them.
  at::Tensor gemma4_experts(const at::Tensor& h, at::Tensor* router_logits) const {
    const MoeSpec& m = spec_.moe;
    const at::Tensor flat = h.reshape({-1, h.size(-1)});
    const at::Tensor scored = unit_rms_norm(flat, spec_.eps) * router->scale *
                              std::pow(static_cast<double>(spec_.hidden), -0.5);
    const at::Tensor logits = router->proj->forward(scored);
    if (router_logits) *router_logits = logits;
    const at::Tensor probabilities = at::softmax(logits.to(at::kFloat), -1);
    auto [weights, chosen] = at::topk(probabilities, m.top_k, -1);
    weights = weights / weights.sum(-1, /*keepdim=*/true);
    weights = weights * router->per_expert_scale.index({chosen});
    const at::Tensor routed_in = norm(pre_feedforward_layernorm_2, flat);
    const std::string& act = spec_.act;
    const at::Tensor out = combine(routed_in, weights, chosen, m.experts, [&](int64_t e, const at::Tensor& tokens) {
      return experts->forward(e, tokens, act);
    });
    return norm(post_feedforward_layernorm_2, out.view(h.sizes()));
  }
  at::Tensor residual(const at::Tensor& x, const at::Tensor& branch) const {
    return spec_.residual_multiplier == 1.0 ? x + branch : x + branch * spec_.residual_multiplier;
  }
  std::shared_ptr<const DecoderSpec> spec_holder_;
  const DecoderSpec& spec_;
};

class Layers : public Module {
 public:
  void push_back(std::shared_ptr<DecoderBlock> block) {
    items.push_back(register_module(std::to_string(items.size()), block));
  }
  std::vector<std::shared_ptr<DecoderBlock>> items;
};

// model.* of the checkpoint: embeddings, blocks, final norm; Gemma 4's per-layer input embeddings and their
// projection from the embeddings.
class DecoderBody : public Module {
 public:
  DecoderBody(const std::shared_ptr<const DecoderSpec>& spec, const c10::TensorOptions& o) {
    const DecoderSpec& s = *spec;
    embed_tokens = register_module("embed_tokens", std::make_shared<Embedding>(s.vocab_size, s.hidden, s.pad_token_id, o));
    layers = register_module("layers", std::make_shared<Layers>());
    for (std::size_t i = 0; i < s.layers.size(); ++i) layers->push_back(std::make_shared<DecoderBlock>(spec, i, o));
    norm = register_module("norm", std::make_shared<NormWeight>(s.hidden, o));
    if (s.per_layer_input > 0) {
      const int64_t all = static_cast<int64_t>(s.layers.size()) * s.per_layer_input;
      std::optional<int64_t> pad = s.pad_token_id;
      if (pad && *pad >= s.per_layer_vocab) pad.reset();
      embed_tokens_per_layer = register_module("embed_tokens_per_layer",
                                               std::make_shared<Embedding>(s.per_layer_vocab, all, pad, o));
      per_layer_model_projection =
          register_module("per_layer_model_projection", std::make_shared<Linear>(s.hidden, all, false, o));
      per_layer_projection_norm =
          register_module("per_layer_projection_norm", std::make_shared<NormWeight>(s.per_layer_input, o));
    }
  }
  std::shared_ptr<Embedding> embed_tokens;
  std::shared_ptr<Layers> layers;
  std::shared_ptr<NormWeight> norm;
  std::shared_ptr<Embedding> embed_tokens_per_layer;
  std::shared_ptr<Linear> per_layer_model_projection;
  std::shared_ptr<NormWeight> per_layer_projection_norm;
};

// An untied LM head's weight (lm_head.weight): a module of its own so that it can be a unit of fully sharded data
// parallelism (run_unit).
class HeadWeight : public Module {
 public:
  HeadWeight(int64_t vocab, int64_t hidden, const c10::TensorOptions& o) : weight(at::empty({vocab, hidden}, o)) {
    register_parameter("weight", &weight);
  }
  at::Tensor weight;
};

// model.* of a multimodal checkpoint: the text model as model.language_model (the towers are carried, not built).
class LanguageModelHolder : public Module {
 public:
  std::shared_ptr<DecoderBody> hold(std::shared_ptr<DecoderBody> body) {
    return register_module("language_model", std::move(body));
  }
};

constexpr std::string_view kLanguageModel = "model.language_model.";

struct DecoderGenerationState : GenerationState {
  DecoderGenerationState(std::size_t layers, int64_t capacity) : cache(layers, capacity) {}
  KvCache cache;           // per layer (B, Hkv, T, hd)
  at::Tensor key_mask;     // (B, T): 0 at the prompts' left padding
  at::Tensor next_position;  // (B) long: the position id of each row's next token
};

class DecoderModel : public LanguageModel {
 public:
  DecoderModel(const nlohmann::json& config, DecoderSpec spec, const c10::TensorOptions& options)
      : config_(config), spec_(std::make_shared<const DecoderSpec>(std::move(spec))), s_(*spec_), options_(options) {
    for (const auto& rope : s_.ropes)
      ropes_.emplace_back(rope, rope.head_dim ? rope.head_dim : s_.head_dim, s_.max_position_embeddings);
    for (std::size_t i = 0; i < s_.layers.size(); ++i) {
      max_head_dim_ = std::max(max_head_dim_, s_.head_dim_of(i));
      if (s_.layers[i].kv_from) shared_from_.insert(*s_.layers[i].kv_from);
    }
    if (s_.multimodal) {
      // transformers 5's Gemma3ForConditionalGeneration: model.language_model is the text model.
      auto outer = register_module("model", std::make_shared<LanguageModelHolder>());
      model = outer->hold(std::make_shared<DecoderBody>(spec_, options));
    } else {
      model = register_module("model", std::make_shared<DecoderBody>(spec_, options));
    }
    if (!s_.tie) untie_lm_head();
  }

  const std::string& model_type() const override { return s_.model_type; }
  ModelFamily family() const override { return ModelFamily::kCausal; }
  int64_t vocab_size() const override { return s_.vocab_size; }
  const nlohmann::json& hf_config() const override { return config_; }
  std::optional<int64_t> eos_token_id() const override { return s_.eos; }

  // cos and sin (B or 1, T, rotary_dim) of one RoPE for position ids (B or 1, T), computed in fp32 (times the
  // rope's attention scaling) and cast to `dtype`. `length`: how far the positions reach (dynamic and longrope
  // choose their frequencies by it).
  std::pair<at::Tensor, at::Tensor> rotary(const Rope& rope, const at::Tensor& positions, int64_t length,
                                           c10::ScalarType dtype) const {
    const at::Tensor inv = rope.inverse_frequencies(length).to(positions.device());
    const at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * inv;  // (B, T, rotary_dim / 2)
    const at::Tensor emb = at::cat({freqs, freqs}, -1);
    at::Tensor cos = emb.cos(), sin = emb.sin();
    if (rope.attention_scaling() != 1.0) {
      cos = cos * rope.attention_scaling();
      sin = sin * rope.attention_scaling();
    }
    return {cos.to(dtype), sin.to(dtype)};
  }

  // `scale` as a multiplier of a tensor of `dtype`: rounded to it first where the family does (Gemma: sqrt(3072)
  // is 55.5 in bf16).
  double scale_in(double scale, c10::ScalarType dtype) const {
    return s_.embedding_scale_in_dtype ? at::scalar_tensor(scale, at::kDouble).to(dtype).item<double>() : scale;
  }

  at::Tensor embed(const at::Tensor& ids) const {
    const BlockFn f = [this](const std::vector<at::Tensor>& in) {
      at::Tensor x = model->embed_tokens->forward(in[0]);
      if (s_.embedding_scale == 1.0) return x;
      return x * scale_in(s_.embedding_scale, x.scalar_type());
    };
    // Untied, the embeddings are a unit of their own (fully sharded weights); tied, they are the head too (the root).
    return lm_head_ ? run_unit(f, {ids}, model->embed_tokens.get()) : f({ids});
  }

  // Gemma 4's per-layer inputs (B, T, layers, per_layer_input) for ids (B, T) and their embeddings x (B, T, D):
  // the per-layer table's rows (times sqrt(per_layer_input)) and the RMS-normed projection of x (times
  // hidden^-0.5), summed and times 2^-0.5, as Gemma4TextModel computes them.
  at::Tensor per_layer_inputs(const at::Tensor& ids, const at::Tensor& x) const {
    const int64_t layers = static_cast<int64_t>(s_.layers.size()), width = s_.per_layer_input;
    at::Tensor table = model->embed_tokens_per_layer->forward(ids);
    table = table * scale_in(std::sqrt(static_cast<double>(width)), table.scalar_type());
    at::Tensor projected =
        model->per_layer_model_projection->forward(x) * std::pow(static_cast<double>(s_.hidden), -0.5);
    projected = projected.reshape({x.size(0), x.size(1), layers, width});
    projected = rms_norm(s_.norm, projected, model->per_layer_projection_norm->weight, s_.eps);
    return (projected + table.reshape({x.size(0), x.size(1), layers, width})) * std::pow(2.0, -0.5);
  }

  // Gemma 4's layer_scalar buffers, carried from the checkpoint, into each block in x's dtype and device (once per
  // dtype and device). A block without one (a model built from config.json alone) multiplies by nothing.
  void resolve_layer_scalars(const at::Tensor& x) {
    if (!s_.layer_scalar || (scalars_dtype_ == x.scalar_type() && scalars_device_ == x.device() &&
                             scalars_carried_ == carried_tensors().size()))
      return;
    std::map<std::string, const at::Tensor*> carried;
    for (const auto& [name, tensor] : carried_tensors()) carried[name] = &tensor;
    for (std::size_t i = 0; i < model->layers->items.size(); ++i) {
      const std::string name = checkpoint_name(layer_path(i) + ".layer_scalar");
      const auto it = carried.find(name);
      model->layers->items[i]->layer_scalar =
          it == carried.end() ? at::Tensor() : it->second->to(x.device(), x.scalar_type());
    }
    scalars_dtype_ = x.scalar_type();
    scalars_device_ = x.device();
    scalars_carried_ = carried_tensors().size();
  }

  std::string layer_path(std::size_t i) const {
    return std::string(s_.multimodal ? "model.language_model" : "model") + ".layers." + std::to_string(i);
  }

  // Runs the blocks over (B, T) ids; with a state, uses and extends its cache (`offset`: the cache's length).
  // Position ids (B, T), when given, rotate instead of offset + t (left-padded generation). Packed rows (segment
  // and position ids) attend within their segments and rotate by their positions within them: as one varlen flash
  // attention on a CUDA card (varlen_attention_runs), per segment when plan_segment_attention chooses it (one
  // layout per distinct sliding window), else over the row with the mask.
  at::Tensor body(const at::Tensor& ids, const at::Tensor& key_mask, int64_t offset, DecoderGenerationState* state,
                  const at::Tensor& segments = {}, const at::Tensor& positions = {}) {
    at::Tensor x = embed(ids);
    resolve_layer_scalars(x);
    router_logits_.clear();
    routing_ = s_.moe.aux_loss && !state && (counting_ || (is_training() && at::GradMode::is_enabled()));
    const at::Tensor per_layer = s_.per_layer_input > 0 ? per_layer_inputs(ids, x) : at::Tensor();
    const bool packed = segments.defined();
    const at::Tensor position_ids =
        positions.defined() ? positions
                            : at::arange(offset, offset + ids.size(1), ids.options().dtype(at::kLong)).unsqueeze(0);
    int64_t length = offset + ids.size(1);
    bool by_length = false;
    for (const auto& rope : ropes_) by_length = by_length || rope.depends_on_length();
    if (by_length && positions.defined() && positions.numel() > 0) length = positions.max().item<int64_t>() + 1;
    std::vector<std::pair<at::Tensor, at::Tensor>> rotations;  // per RoPE: cos, sin
    for (const auto& rope : ropes_) rotations.push_back(rotary(rope, position_ids, length, x.scalar_type()));
    auto mask_for = [&](std::optional<int64_t> window) {
      return packed ? segment_mask(segments, segments, positions, positions, /*causal=*/true, window)
                    : causal_mask(key_mask, ids.size(1), offset, window);
    };
    std::map<std::optional<int64_t>, at::Tensor> masks;  // per window (none: full attention), made once
    std::map<std::optional<int64_t>, std::shared_ptr<const SegmentLayout>> layouts;  // per window
    // On a CUDA card in bf16/fp16 without attention dropout or soft-capping: one variable-length flash attention
    // per layer.
    std::shared_ptr<const VarlenLayout> varlen;
    if (packed && !state && (!is_training() || s_.attention_dropout == 0.0) && !s_.attention_softcap &&
        varlen_attention_runs(x, max_head_dim_))
      varlen = plan_varlen_attention(segments, positions);
    std::map<std::size_t, KeysValues> shared;  // the keys and values of the layers others reuse (Gemma 4)
    for (std::size_t i = 0; i < model->layers->items.size(); ++i) {
      const auto window = s_.layers[i].window;
      std::shared_ptr<const SegmentLayout> layout;
      if (packed && !state && !varlen) {
        auto found = layouts.find(window);
        if (found == layouts.end())
          found = layouts.emplace(window, plan_segment_attention(segments, segments, positions, positions,
                                                                 /*causal=*/true, window))
                      .first;
        layout = found->second;
      }
      at::Tensor mask;
      if (layout || varlen) {
        // Per segment: no mask over the row. An empty tensor stands in (block inputs must be defined tensors for
        // activation checkpointing).
        mask = at::empty({0}, ids.options().dtype(at::kBool));
      } else {
        auto found = masks.find(window);
        if (found == masks.end()) found = masks.emplace(window, mask_for(window)).first;
        mask = found->second;
      }
      const auto& [cos, sin] = rotations[s_.layers[i].rope_index];
      auto& block = model->layers->items[i];
      const at::Tensor layer_input = per_layer.defined() ? per_layer.select(2, static_cast<int64_t>(i)) : at::Tensor();
      const KeysValues* reuse = s_.layers[i].kv_from ? &shared.at(*s_.layers[i].kv_from) : nullptr;
      const bool produces = shared_from_.count(i) > 0;
      if (state) {
        // Generation with the cache: no gradients, no block runner; fully sharded weights gather the block for it.
        KeysValues produced;
        x = run_unit(
            [&](const std::vector<at::Tensor>& in) {
              return block->forward(in[0], cos, sin, mask, &state->cache, i, nullptr, nullptr, std::nullopt,
                                    layer_input, reuse, produces ? &produced : nullptr);
            },
            {x}, block.get());
        if (produces) shared[i] = produced;
        continue;
      }
      // The block's tensor inputs: x, cos, sin, mask, then its per-layer input and the keys and values it reuses
      // (those that need gradients must be inputs, for activation checkpointing).
      std::vector<at::Tensor> inputs = {x, cos, sin, mask};
      if (layer_input.defined()) inputs.push_back(layer_input);
      if (reuse) inputs.insert(inputs.end(), {reuse->keys, reuse->values});
      const bool has_layer_input = layer_input.defined(), reuses = reuse != nullptr;
      const bool routes = routing_ && (block->moe || block->router);  // the router's logits are wanted (the load-balancing loss)
      // The block's outputs: x, then this layer's keys and values when later layers reuse them, then its router's
      // logits when wanted.
      auto run = [block, layout, varlen, window, has_layer_input, reuses, produces,
                  routes](const std::vector<at::Tensor>& in) {
        std::size_t next = 4;
        const at::Tensor layer_in = has_layer_input ? in[next++] : at::Tensor();
        KeysValues reused, produced;
        if (reuses) reused = {in[next], in[next + 1]};
        at::Tensor logits;
        std::vector<at::Tensor> out = {block->forward(in[0], in[1], in[2], in[3], nullptr, 0, layout.get(),
                                                      varlen.get(), window, layer_in, reuses ? &reused : nullptr,
                                                      produces ? &produced : nullptr, routes ? &logits : nullptr)};
        if (produces) out.insert(out.end(), {produced.keys, produced.values});
        if (routes) out.push_back(logits);
        return out;
      };
      std::vector<at::Tensor> out;
      if (!produces && !routes) {
        out = {run_block([run](const std::vector<at::Tensor>& in) { return run(in)[0]; }, inputs, block.get())};
      } else if (!has_block_runner() && !has_unit_hooks()) {
        out = run(inputs);
      } else {
        // A block runner (activation checkpointing) passes one tensor out: the outputs travel flattened into one
        // (in a dtype that holds them all) and are cut apart here, with the shapes and dtypes the forward noted.
        auto shapes = std::make_shared<std::vector<std::pair<std::vector<int64_t>, c10::ScalarType>>>();
        const at::Tensor all = run_block([run, shapes](const std::vector<at::Tensor>& in) {
          const std::vector<at::Tensor> parts = run(in);
          shapes->clear();
          std::vector<at::Tensor> flat;
          for (const auto& part : parts) {
            shapes->emplace_back(part.sizes().vec(), part.scalar_type());
            flat.push_back(part.flatten());
          }
          return at::cat(flat);
        }, inputs, block.get());
        int64_t offset = 0;
        for (const auto& [shape, dtype] : *shapes) {
          const int64_t n = c10::multiply_integers(shape);
          out.push_back(all.narrow(0, offset, n).view(shape).to(dtype));
          offset += n;
        }
      }
      x = out[0];
      std::size_t next = 1;
      if (produces) {
        shared[i] = {out[next], out[next + 1]};
        next += 2;
      }
      if (routes) router_logits_.push_back(out[next]);
    }
    return rms_norm(s_.norm, x, model->norm->weight, s_.eps);
  }

  bool has_routing_loss() const override { return s_.moe.aux_loss; }
  int64_t routing_experts() const override { return s_.moe.experts; }

  // The routers' statistics of the last forward over its real tokens (`batch`'s mask: attention mask, or segments of
  // packed rows): per expert the summed probabilities (with their gradient), the top-k assignments, and the rows.
  struct Routing {
    at::Tensor probabilities, assignments;  // (experts) fp32
    at::Tensor rows;                        // scalar fp32
  };
  Routing routing_statistics(const Batch& batch) const {
    const at::Tensor real =
        (batch.segment_ids.defined() ? batch.segment_ids > 0 : batch.attention_mask != 0).reshape({-1}).to(at::kFloat);
    const auto options = real.options();
    Routing r{at::zeros({s_.moe.experts}, options), at::zeros({s_.moe.experts}, options), at::zeros({}, options)};
    for (const auto& logits : router_logits_) {
      const at::Tensor probabilities = at::softmax(logits.to(at::kFloat), -1);
      r.probabilities = r.probabilities + (probabilities * real.unsqueeze(-1)).sum(0);
      at::NoGradGuard no_grad;
      const at::Tensor chosen = std::get<1>(at::topk(probabilities, s_.moe.top_k, -1)).reshape({-1});
      r.assignments = r.assignments + at::zeros_like(r.assignments).scatter_add(0, chosen,
                                                                               real.repeat_interleave(s_.moe.top_k));
      r.rows = r.rows + real.sum();
    }
    return r;
  }

  std::vector<double> routing_counts(const Batch& batch) override {
    if (!s_.moe.aux_loss) return {};
    at::NoGradGuard no_grad;
    counting_ = true;
    try {
      body(batch.input_ids, batch.attention_mask, 0, nullptr, batch.segment_ids, batch.position_ids);
    } catch (...) {
      counting_ = false;
      throw;
    }
    counting_ = false;
    const Routing r = routing_statistics(batch);
    router_logits_.clear();
    const at::Tensor all = at::cat({r.assignments, r.rows.reshape({1})}).to(at::kDouble).to(at::kCPU);
    return {all.data_ptr<double>(), all.data_ptr<double>() + all.numel()};
  }
  void set_routing_totals(std::vector<double> totals) override {
    routing_totals_ = std::move(totals);
    summary_ = {};
  }
  RoutingSummary routing_summary() const override { return summary_; }

  // transformers' load_balancing_loss_func: experts x sum_e (assignments_e / rows) (probabilities_e / rows), over
  // every sparse layer and real token of the effective batch; this forward's share is its probabilities' part, the
  // assignments and rows the effective batch's (set_routing_totals) or its own.
  at::Tensor routing_loss() override {
    if (!routing_ || router_logits_.empty()) return {};
    const Routing r = routing_statistics(last_batch_);
    at::Tensor assignments = r.assignments, rows = r.rows;
    if (!routing_totals_.empty()) {
      const auto experts = static_cast<std::size_t>(s_.moe.experts);
      if (routing_totals_.size() != experts + 1)
        throw Error("routing totals of " + std::to_string(routing_totals_.size()) + " numbers for " +
                    std::to_string(experts) + " experts");
      assignments = at::tensor(std::vector<double>(routing_totals_.begin(), routing_totals_.begin() + s_.moe.experts),
                               at::kDouble)
                        .to(r.probabilities.options());
      rows = at::scalar_tensor(routing_totals_.back(), r.probabilities.options());
    }
    router_logits_.clear();
    const at::Tensor loss = static_cast<double>(s_.moe.experts) * (assignments / rows * r.probabilities / rows).sum();
    // For the metrics: the assignments the loss used (the effective batch's) and its share.
    const at::Tensor counts = assignments.detach().to(at::kDouble).to(at::kCPU).contiguous();
    summary_.assignments.assign(counts.data_ptr<double>(), counts.data_ptr<double>() + counts.numel());
    summary_.balancing_loss += loss.item<double>();
    return s_.moe.aux_coef * loss;
  }

  std::pair<at::Tensor, at::Tensor> hidden_and_targets(const Batch& batch) override {
    last_batch_ = batch;
    const at::Tensor hidden =
        body(batch.input_ids, batch.attention_mask, 0, nullptr, batch.segment_ids, batch.position_ids);
    // Position t predicts token t + 1; the last position predicts nothing.
    at::Tensor targets = at::full_like(batch.labels, -100);
    const int64_t t = batch.labels.size(1);
    targets.narrow(1, 0, t - 1).copy_(batch.labels.narrow(1, 1, t - 1));
    return {hidden, targets};
  }

  at::Tensor lm_head(const at::Tensor& hidden) override {
    const BlockFn f = [this](const std::vector<at::Tensor>& in) {
      at::Tensor logits = at::linear(in[0], lm_head_weight());
      if (s_.logits_scaling != 1.0) logits = logits / s_.logits_scaling;
      if (s_.final_softcap) logits = at::tanh(logits / *s_.final_softcap) * *s_.final_softcap;
      return logits;
    };
    return lm_head_ ? run_unit(f, {hidden}, lm_head_.get()) : f({hidden});
  }
  at::Tensor lm_head_weight() const override { return lm_head_ ? lm_head_->weight : model->embed_tokens->weight; }
  double lm_head_scale() const override { return 1.0 / s_.logits_scaling; }
  std::optional<double> final_logit_softcap() const override { return s_.final_softcap; }

  // A multimodal checkpoint's files name the text model language_model.model.* and its head
  // language_model.lm_head.weight (what transformers writes and the Hub holds); transformers 5's own tree
  // (model.language_model.*) is read too. Everything else in such a file is carried.
  std::string checkpoint_name(const std::string& name) const override {
    if (!s_.multimodal || s_.multimodal_module_names) return name;
    if (name.starts_with(kLanguageModel)) return "language_model.model." + name.substr(kLanguageModel.size());
    if (name == "lm_head.weight") return "language_model.lm_head.weight";
    return name;
  }
  std::optional<std::string> parameter_name(const std::string& checkpoint) const override {
    std::optional<std::string> name = checkpoint;
    if (s_.multimodal) {
      static const std::string kLegacy = "language_model.model.";
      if (!s_.multimodal_module_names && checkpoint.starts_with(kLegacy))
        name = std::string(kLanguageModel) + checkpoint.substr(kLegacy.size());
      else if (checkpoint.starts_with(kLanguageModel) || checkpoint == "lm_head.weight")
        name = checkpoint;
      else if (!s_.multimodal_module_names && checkpoint == "language_model.lm_head.weight")
        name = "lm_head.weight";
      else
        name.reset();
    }
    if (name && unused_by_decoder(*name)) name.reset();
    return name;
  }

  // Tensors a Gemma 4 checkpoint holds that no parameter stands for: the layer_scalar buffers (read from the
  // carried tensors) and the key/value projections and norms of the layers that reuse another's keys and values
  // (transformers ignores them on load).
  bool unused_by_decoder(const std::string& name) const {
    if (s_.layer_scalar && name.ends_with(".layer_scalar")) return true;
    for (std::size_t i = 0; i < s_.layers.size(); ++i) {
      if (!s_.layers[i].kv_from) continue;
      const std::string attention = layer_path(i) + ".self_attn.";
      if (!name.starts_with(attention)) continue;
      const std::string rest = name.substr(attention.size());
      for (const char* module : {"k_proj.", "v_proj.", "k_norm.", "v_norm."})
        if (rest.starts_with(module)) return true;
    }
    return false;
  }

  std::string text_model_path() const override { return s_.multimodal ? "model.language_model" : ""; }

  // An untied model's embeddings and head are units too (run_unit), as FSDP2 shards them in torchtitan: neither is
  // then held gathered beyond its own forward and backward.
  std::vector<const Module*> blocks() const override {
    std::vector<const Module*> out;
    if (lm_head_) out.push_back(model->embed_tokens.get());
    for (const auto& block : model->layers->items) out.push_back(block.get());
    if (lm_head_) out.push_back(lm_head_.get());
    return out;
  }

  // transformers 5 names every family's sparse block "mlp" (Mixtral's files say block_sparse_moe).
  std::vector<StackedExpertLayers> stacked_expert_layers() override {
    std::vector<StackedExpertLayers> out;
    for (std::size_t i = 0; i < model->layers->items.size(); ++i) {
      const auto& moe = model->layers->items[i]->moe;
      if (!moe) continue;
      StackedExpertLayers group{layer_path(i) + ".mlp.experts", {}, {}, {}, &moe->experts->pass_hook};
      for (const auto& expert : moe->experts->items) {
        group.gate.push_back(expert->gate.get());
        group.up.push_back(expert->up.get());
        group.down.push_back(expert->down.get());
      }
      out.push_back(std::move(group));
    }
    return out;
  }

  std::vector<std::pair<std::string, std::string>> aliases() const override {
    if (lm_head_tied())
      return {{"lm_head.weight", s_.multimodal ? std::string(kLanguageModel) + "embed_tokens.weight"
                                               : std::string("model.embed_tokens.weight")}};
    return {};
  }
  bool lm_head_tied() const override { return !lm_head_; }
  void untie_lm_head() override {
    if (lm_head_) return;
    // First, where lm_head.weight was when it was the model's own parameter: the order of the parameters (the
    // initialisation's draws, the gradient norm's sum, the files) stays as it was.
    lm_head_ = register_module("lm_head", std::make_shared<HeadWeight>(s_.vocab_size, s_.hidden, options_), true);
  }

  void init_weights() override {
    // transformers' PreTrainedModel._init_weights: normal(0, initializer_range) for linear and embedding
    // weights, zero biases, ones for norms, a zero padding row.
    at::NoGradGuard no_grad;
    const double std_dev = s_.initializer_range;
    for_each_parameter([&](const std::string& name, at::Tensor& p) {
      if (name.ends_with("norm.weight")) p.fill_(s_.norm == NormKind::kGemma ? 0.0 : 1.0);  // Gemma: 1 + weight
      else if (name.ends_with("router.scale") || name.ends_with("router.per_expert_scale")) p.fill_(1.0);
      else if (name.ends_with(".bias")) p.zero_();
      else p.normal_(0.0, std_dev);
    });
    if (s_.pad_token_id) model->embed_tokens->weight[*s_.pad_token_id].zero_();
    if (model->embed_tokens_per_layer && model->embed_tokens_per_layer->padding_idx)
      model->embed_tokens_per_layer->weight[*model->embed_tokens_per_layer->padding_idx].zero_();
  }

  std::pair<std::unique_ptr<GenerationState>, at::Tensor> prefill(const at::Tensor& prompt_ids,
                                                                  const at::Tensor& attention_mask,
                                                                  int64_t new_tokens) override {
    const int64_t batch = prompt_ids.size(0), width = prompt_ids.size(1);
    const std::size_t layers = model->layers->items.size();
    auto state = std::make_unique<DecoderGenerationState>(layers, width + new_tokens);
    state->key_mask = attention_mask;
    const at::Tensor mask = attention_mask.to(at::kLong);
    state->next_position = mask.sum(-1);
    // Prompts of similar length run together, each group padded (on the left) to its own longest prompt only;
    // their caches are written into the batch's, right-aligned. Each row's computation is what the whole batch
    // would do for it.
    const auto groups = prefill_groups(prompt_extents(attention_mask, /*left_padded=*/true));
    if (groups.size() == 1) {
      const at::Tensor hidden = body(prompt_ids, state->key_mask, 0, state.get(), {}, prefill_positions(mask));
      return {std::move(state), lm_head(hidden.select(1, width - 1))};
    }
    at::Tensor last;  // (B, D): each row's last hidden state
    for (const auto& group : groups) {
      const at::Tensor rows = at::tensor(group.rows, at::kLong).to(prompt_ids.device());
      const at::Tensor ids = prompt_ids.index_select(0, rows).narrow(1, width - group.width, group.width);
      const at::Tensor group_mask = mask.index_select(0, rows).narrow(1, width - group.width, group.width);
      DecoderGenerationState part(layers, group.width);
      const at::Tensor hidden = body(ids, group_mask, 0, &part, {}, prefill_positions(group_mask));
      if (!last.defined()) last = at::empty({batch, hidden.size(2)}, hidden.options());
      last.index_copy_(0, rows, hidden.select(1, group.width - 1));
      state->cache.write_rows(part.cache, rows, batch, width);
    }
    return {std::move(state), lm_head(last)};
  }

  // As transformers derives position ids for left padding: the count of real tokens before each one. mask (B, T)
  // long.
  static at::Tensor prefill_positions(const at::Tensor& mask) {
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0);
  }

  at::Tensor decode_step(GenerationState& generic, const at::Tensor& tokens) override {
    auto& state = static_cast<DecoderGenerationState&>(generic);
    const int64_t offset = state.key_mask.size(1);
    state.key_mask = at::cat({state.key_mask, at::ones_like(tokens).to(state.key_mask.scalar_type())}, 1);
    const at::Tensor hidden = body(tokens, state.key_mask, offset, &state, {}, state.next_position.unsqueeze(1));
    state.next_position = state.next_position + 1;
    return lm_head(hidden.select(1, 0));
  }

  void select_rows(GenerationState& generic, const at::Tensor& rows) override {
    auto& state = static_cast<DecoderGenerationState&>(generic);
    const at::Tensor index = rows.to(state.key_mask.device());
    state.cache.select_rows(index);
    state.key_mask = state.key_mask.index_select(0, index);
    state.next_position = state.next_position.index_select(0, index);
  }

  std::shared_ptr<DecoderBody> model;

 private:
  nlohmann::json config_;
  std::shared_ptr<const DecoderSpec> spec_;
  const DecoderSpec& s_;
  std::vector<Rope> ropes_;
  int64_t max_head_dim_ = 0;
  std::set<std::size_t> shared_from_;  // layers whose keys and values later layers reuse
  c10::ScalarType scalars_dtype_ = c10::ScalarType::Undefined;  // of the blocks' layer_scalar
  at::Device scalars_device_ = at::kCPU;
  std::size_t scalars_carried_ = 0;
  // The load-balancing loss: whether this forward keeps its routers' logits (training with gradients, or a
  // counting pass), which it kept, the batch they are of, the effective batch's counts.
  bool routing_ = false, counting_ = false;
  std::vector<at::Tensor> router_logits_;
  Batch last_batch_;
  std::vector<double> routing_totals_;
  RoutingSummary summary_;
  c10::TensorOptions options_;
  std::shared_ptr<HeadWeight> lm_head_;  // untied: lm_head.weight
};

}  // namespace

std::unique_ptr<LanguageModel> make_decoder(const nlohmann::json& config, DecoderSpec spec,
                                           const c10::TensorOptions& options) {
  return std::make_unique<DecoderModel>(config, std::move(spec), options);
}

}  // namespace trainer
