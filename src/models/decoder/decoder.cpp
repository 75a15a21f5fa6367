// The one decoder of every decoder-only family (decoder/spec.h; the families in decoder/families/): pre- or
// post-norm blocks of RMS norms, rotary position embeddings (per layer: none, or one of the spec's RoPEs, on the
// first rotary_dim of each head), grouped-query attention with optional q/k norms, scaling, soft-capping and sliding
// windows, a gated MLP (separate or fused projections), and the multipliers some families put on the embeddings,
// the residual branches and the logits. Module names are transformers', so checkpoints, PEFT adapters and 4-bit
// layers load and save by name.
#include <cmath>
#include <map>
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

class DecoderAttention : public Module {
 public:
  DecoderAttention(std::shared_ptr<const DecoderSpec> spec, const DecoderLayerSpec& layer,
                   const c10::TensorOptions& o)
      : spec_holder_(std::move(spec)), spec_(*spec_holder_), rope_(layer.rope) {
    const DecoderSpec& s = spec_;
    const int64_t q_out = s.heads * s.head_dim, kv_out = s.kv_heads * s.head_dim;
    if (s.fused_qkv) {
      qkv_proj = register_module("qkv_proj", std::make_shared<Linear>(s.hidden, q_out + 2 * kv_out, s.qkv_bias, o));
    } else {
      q_proj = register_module("q_proj", std::make_shared<Linear>(s.hidden, q_out, s.qkv_bias, o));
      k_proj = register_module("k_proj", std::make_shared<Linear>(s.hidden, kv_out, s.qkv_bias, o));
      v_proj = register_module("v_proj", std::make_shared<Linear>(s.hidden, kv_out, s.qkv_bias, o));
    }
    o_proj = register_module("o_proj", std::make_shared<Linear>(q_out, s.hidden, s.o_bias, o));
    if (s.qk_norm != QkNorm::kNone) {
      const bool whole = s.qk_norm == QkNorm::kWholeProjection;
      q_norm = register_module("q_norm", std::make_shared<NormWeight>(whole ? q_out : s.head_dim, o));
      k_norm = register_module("k_norm", std::make_shared<NormWeight>(whole ? kv_out : s.head_dim, o));
    }
    attention_dropout = register_module("attention_dropout", std::make_shared<Dropout>(s.attention_dropout));
  }

  // x (B, T, D); cos/sin (B or 1, T, rotary_dim); mask (B, 1, T, Tk) bool. With a cache, the new keys and values
  // are written into this layer's buffers and attention runs over all filled positions. With a segment layout
  // (packed rows) the attention runs per segment, with a varlen layout as one variable-length flash attention
  // within `window` (CUDA); either way `mask` is unused.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& mask,
                     KvCache* cache = nullptr, std::size_t layer = 0, const SegmentLayout* layout = nullptr,
                     const VarlenLayout* varlen = nullptr, std::optional<int64_t> window = std::nullopt) {
    const int64_t b = x.size(0), t = x.size(1), hd = spec_.head_dim;
    const int64_t q_out = spec_.heads * hd, kv_out = spec_.kv_heads * hd;
    at::Tensor q, k, v;  // (B, T, H * hd), (B, T, Hkv * hd)
    if (qkv_proj) {
      const at::Tensor qkv = qkv_proj->forward(x);
      q = qkv.narrow(-1, 0, q_out);
      k = qkv.narrow(-1, q_out, kv_out);
      v = qkv.narrow(-1, q_out + kv_out, kv_out);
    } else {
      q = q_proj->forward(x);
      k = k_proj->forward(x);
      v = v_proj->forward(x);
    }
    if (spec_.qk_norm == QkNorm::kWholeProjection) {
      q = rms_norm(spec_.norm, q, q_norm->weight, spec_.eps);
      k = rms_norm(spec_.norm, k, k_norm->weight, spec_.eps);
    }
    q = q.reshape({b, t, spec_.heads, hd});
    k = k.reshape({b, t, spec_.kv_heads, hd});
    if (spec_.qk_norm == QkNorm::kPerHead) {
      q = rms_norm(spec_.norm, q, q_norm->weight, spec_.eps);
      k = rms_norm(spec_.norm, k, k_norm->weight, spec_.eps);
    }
    q = q.transpose(1, 2);                                                  // (B, H, T, hd)
    k = k.transpose(1, 2);                                                  // (B, Hkv, T, hd)
    v = v.reshape({b, t, spec_.kv_heads, hd}).transpose(1, 2);
    if (rope_) {
      const at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
      q = apply_rotary(q, c, s);
      k = apply_rotary(k, c, s);
    }
    if (cache) std::tie(k, v) = cache->append(layer, k, v);
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
      const int64_t group = spec_.heads / spec_.kv_heads;
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
                                            /*enable_gqa=*/spec_.kv_heads != spec_.heads);
  }

  std::shared_ptr<Linear> q_proj, k_proj, v_proj, qkv_proj, o_proj;
  std::shared_ptr<NormWeight> q_norm, k_norm;
  std::shared_ptr<Dropout> attention_dropout;

 private:
  std::shared_ptr<const DecoderSpec> spec_holder_;  // shared with the model and its other modules
  const DecoderSpec& spec_;
  bool rope_;
};

class DecoderMlp : public Module {
 public:
  DecoderMlp(const DecoderSpec& s, const c10::TensorOptions& o) : act_(s.act) {
    if (s.fused_gate_up) {
      gate_up_proj =
          register_module("gate_up_proj", std::make_shared<Linear>(s.hidden, 2 * s.intermediate, s.mlp_bias, o));
    } else {
      gate_proj = register_module("gate_proj", std::make_shared<Linear>(s.hidden, s.intermediate, s.mlp_bias, o));
      up_proj = register_module("up_proj", std::make_shared<Linear>(s.hidden, s.intermediate, s.mlp_bias, o));
    }
    down_proj = register_module("down_proj", std::make_shared<Linear>(s.intermediate, s.hidden, s.mlp_bias, o));
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

class DecoderBlock : public Module {
 public:
  DecoderBlock(std::shared_ptr<const DecoderSpec> spec, const DecoderLayerSpec& layer, const c10::TensorOptions& o)
      : spec_holder_(std::move(spec)), spec_(*spec_holder_) {
    const DecoderSpec& s = spec_;
    self_attn = register_module("self_attn", std::make_shared<DecoderAttention>(spec_holder_, layer, o));
    mlp = register_module("mlp", std::make_shared<DecoderMlp>(s, o));
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
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& mask,
                     KvCache* cache = nullptr, std::size_t layer = 0, const SegmentLayout* layout = nullptr,
                     const VarlenLayout* varlen = nullptr, std::optional<int64_t> window = std::nullopt) {
    at::Tensor a = self_attn->forward(norm(pre_attention_norm, x), cos, sin, mask, cache, layer, layout, varlen, window);
    a = norm(post_attention_norm, a);
    if (resid_attn_dropout) a = resid_attn_dropout->forward(a, is_training());
    const at::Tensor h = residual(x, a);
    at::Tensor m = norm(post_mlp_norm, mlp->forward(norm(pre_mlp_norm, h)));
    if (resid_mlp_dropout) m = resid_mlp_dropout->forward(m, is_training());
    return residual(h, m);
  }
  std::shared_ptr<DecoderAttention> self_attn;
  std::shared_ptr<DecoderMlp> mlp;
  std::shared_ptr<NormWeight> pre_attention_norm, post_attention_norm, pre_mlp_norm, post_mlp_norm;
  std::shared_ptr<Dropout> resid_attn_dropout, resid_mlp_dropout;

 private:
  at::Tensor norm(const std::shared_ptr<NormWeight>& n, const at::Tensor& x) const {
    return n ? rms_norm(spec_.norm, x, n->weight, spec_.eps) : x;
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

// model.* of the checkpoint: embeddings, blocks, final norm.
class DecoderBody : public Module {
 public:
  DecoderBody(const std::shared_ptr<const DecoderSpec>& spec, const c10::TensorOptions& o) {
    const DecoderSpec& s = *spec;
    embed_tokens = register_module("embed_tokens", std::make_shared<Embedding>(s.vocab_size, s.hidden, s.pad_token_id, o));
    layers = register_module("layers", std::make_shared<Layers>());
    for (const auto& layer : s.layers) layers->push_back(std::make_shared<DecoderBlock>(spec, layer, o));
    norm = register_module("norm", std::make_shared<NormWeight>(s.hidden, o));
  }
  std::shared_ptr<Embedding> embed_tokens;
  std::shared_ptr<Layers> layers;
  std::shared_ptr<NormWeight> norm;
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
    for (const auto& rope : s_.ropes) ropes_.emplace_back(rope, s_.head_dim, s_.max_position_embeddings);
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

  at::Tensor embed(const at::Tensor& ids) const {
    at::Tensor x = model->embed_tokens->forward(ids);
    if (s_.embedding_scale == 1.0) return x;
    // Gemma multiplies by its scale rounded to the weights' dtype (sqrt(3072) is 55.5 in bf16).
    const double scale = s_.embedding_scale_in_dtype
                             ? at::scalar_tensor(s_.embedding_scale, at::kDouble).to(x.scalar_type()).item<double>()
                             : s_.embedding_scale;
    return x * scale;
  }

  // Runs the blocks over (B, T) ids; with a state, uses and extends its cache (`offset`: the cache's length).
  // Position ids (B, T), when given, rotate instead of offset + t (left-padded generation). Packed rows (segment
  // and position ids) attend within their segments and rotate by their positions within them: as one varlen flash
  // attention on a CUDA card (varlen_attention_runs), per segment when plan_segment_attention chooses it (one
  // layout per distinct sliding window), else over the row with the mask.
  at::Tensor body(const at::Tensor& ids, const at::Tensor& key_mask, int64_t offset, DecoderGenerationState* state,
                  const at::Tensor& segments = {}, const at::Tensor& positions = {}) {
    at::Tensor x = embed(ids);
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
        varlen_attention_runs(x, s_.head_dim))
      varlen = plan_varlen_attention(segments, positions);
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
      if (state) {
        x = block->forward(x, cos, sin, mask, &state->cache, i);
      } else {
        x = run_block([block, layout, varlen, window](const std::vector<at::Tensor>& in) {
          return block->forward(in[0], in[1], in[2], in[3], nullptr, 0, layout.get(), varlen.get(), window);
        }, {x, cos, sin, mask});
      }
    }
    return rms_norm(s_.norm, x, model->norm->weight, s_.eps);
  }

  std::pair<at::Tensor, at::Tensor> hidden_and_targets(const Batch& batch) override {
    const at::Tensor hidden =
        body(batch.input_ids, batch.attention_mask, 0, nullptr, batch.segment_ids, batch.position_ids);
    // Position t predicts token t + 1; the last position predicts nothing.
    at::Tensor targets = at::full_like(batch.labels, -100);
    const int64_t t = batch.labels.size(1);
    targets.narrow(1, 0, t - 1).copy_(batch.labels.narrow(1, 1, t - 1));
    return {hidden, targets};
  }

  at::Tensor lm_head(const at::Tensor& hidden) override {
    at::Tensor logits = at::linear(hidden, lm_head_weight());
    if (s_.logits_scaling != 1.0) logits = logits / s_.logits_scaling;
    if (s_.final_softcap) logits = at::tanh(logits / *s_.final_softcap) * *s_.final_softcap;
    return logits;
  }
  at::Tensor lm_head_weight() const override {
    return lm_head_weight_.defined() ? lm_head_weight_ : model->embed_tokens->weight;
  }
  double lm_head_scale() const override { return 1.0 / s_.logits_scaling; }
  std::optional<double> final_logit_softcap() const override { return s_.final_softcap; }

  // A multimodal checkpoint's files name the text model language_model.model.* and its head
  // language_model.lm_head.weight (what transformers writes and the Hub holds); transformers 5's own tree
  // (model.language_model.*) is read too. Everything else in such a file is carried.
  std::string checkpoint_name(const std::string& name) const override {
    if (!s_.multimodal) return name;
    if (name.starts_with(kLanguageModel)) return "language_model.model." + name.substr(kLanguageModel.size());
    if (name == "lm_head.weight") return "language_model.lm_head.weight";
    return name;
  }
  std::optional<std::string> parameter_name(const std::string& checkpoint) const override {
    if (!s_.multimodal) return checkpoint;
    static const std::string kLegacy = "language_model.model.";
    if (checkpoint.starts_with(kLegacy)) return std::string(kLanguageModel) + checkpoint.substr(kLegacy.size());
    if (checkpoint.starts_with(kLanguageModel)) return checkpoint;
    if (checkpoint == "language_model.lm_head.weight" || checkpoint == "lm_head.weight") return "lm_head.weight";
    return std::nullopt;
  }

  std::string text_model_path() const override { return s_.multimodal ? "model.language_model" : ""; }

  std::vector<std::pair<std::string, std::string>> aliases() const override {
    if (lm_head_tied())
      return {{"lm_head.weight", s_.multimodal ? std::string(kLanguageModel) + "embed_tokens.weight"
                                               : std::string("model.embed_tokens.weight")}};
    return {};
  }
  bool lm_head_tied() const override { return !lm_head_weight_.defined(); }
  void untie_lm_head() override {
    if (lm_head_weight_.defined()) return;
    lm_head_weight_ = at::empty({s_.vocab_size, s_.hidden}, options_);
    register_parameter("lm_head.weight", &lm_head_weight_);
  }

  void init_weights() override {
    // transformers' PreTrainedModel._init_weights: normal(0, initializer_range) for linear and embedding
    // weights, zero biases, ones for norms, a zero padding row.
    at::NoGradGuard no_grad;
    const double std_dev = s_.initializer_range;
    for_each_parameter([&](const std::string& name, at::Tensor& p) {
      if (name.ends_with("norm.weight")) p.fill_(s_.norm == NormKind::kGemma ? 0.0 : 1.0);  // Gemma: 1 + weight
      else if (name.ends_with(".bias")) p.zero_();
      else p.normal_(0.0, std_dev);
    });
    if (s_.pad_token_id) model->embed_tokens->weight[*s_.pad_token_id].zero_();
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
  c10::TensorOptions options_;
  at::Tensor lm_head_weight_;
};

}  // namespace

std::unique_ptr<LanguageModel> make_decoder(const nlohmann::json& config, DecoderSpec spec,
                                           const c10::TensorOptions& options) {
  return std::make_unique<DecoderModel>(config, std::move(spec), options);
}

}  // namespace trainer
