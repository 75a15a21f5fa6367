// The Llama family (transformers' modeling_llama.py, modeling_qwen2.py, modeling_mistral.py): pre-norm decoder
// blocks with RMSNorm, rotary position embeddings (rotate-half), grouped-query attention, SwiGLU MLP.
// Flavours: Llama (optional attention/MLP biases), Qwen2 (q/k/v biases), Mistral (sliding-window attention).
#include <cmath>
#include <map>
#include <numbers>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "models/dropout.h"
#include "models/hf_config.h"
#include "models/kv_cache.h"
#include "models/layers.h"
#include "models/model.h"
#include "models/segment_attention.h"

namespace trainer {
namespace {

struct LlamaHyper {
  std::string model_type;
  int64_t vocab_size, hidden, intermediate, layers, heads, kv_heads, head_dim;
  double eps, initializer_range, attention_dropout;
  bool qkv_bias, o_bias, mlp_bias, tie;
  std::string act;
  std::optional<int64_t> pad_token_id, eos;
  std::vector<std::optional<int64_t>> window;  // per layer: sliding window or none
  at::Tensor inv_freq;                          // (head_dim / 2) fp32, after any rope scaling

  explicit LlamaHyper(const nlohmann::json& c) {
    model_type = hf::get_string(c, "model_type", "llama");
    vocab_size = hf::get_int(c, "vocab_size");
    hidden = hf::get_int(c, "hidden_size");
    intermediate = hf::get_int(c, "intermediate_size");
    layers = hf::get_int(c, "num_hidden_layers");
    heads = hf::get_int(c, "num_attention_heads");
    kv_heads = hf::get_int(c, "num_key_value_heads", heads);
    head_dim = hf::get_int(c, "head_dim", hidden / heads);
    if (heads % kv_heads != 0)
      throw DataError("config.json: num_attention_heads (" + std::to_string(heads) +
                      ") is not a multiple of num_key_value_heads (" + std::to_string(kv_heads) + ")");
    eps = hf::get_double(c, "rms_norm_eps", 1e-6);
    initializer_range = hf::get_double(c, "initializer_range", 0.02);
    attention_dropout = hf::get_double(c, "attention_dropout", 0.0);
    const bool qwen2 = model_type == "qwen2";
    const bool attention_bias = hf::get_bool(c, "attention_bias", false);
    qkv_bias = qwen2 || attention_bias;
    o_bias = !qwen2 && attention_bias;
    mlp_bias = hf::get_bool(c, "mlp_bias", false);
    tie = hf::get_bool(c, "tie_word_embeddings", false);
    act = hf::get_string(c, "hidden_act", "silu");
    check_activation(act, "config.json \"hidden_act\"");
    pad_token_id = hf::get_optional_int(c, "pad_token_id");
    if (pad_token_id && (*pad_token_id < 0 || *pad_token_id >= vocab_size)) pad_token_id.reset();
    eos = hf::get_eos(c);

    const auto sliding = hf::get_optional_int(c, "sliding_window");
    window.assign(static_cast<std::size_t>(layers), std::nullopt);
    if (const auto* types = hf::find(c, "layer_types"); types && types->is_array()) {
      for (std::size_t i = 0; i < window.size() && i < types->size(); ++i)
        if ((*types)[i] == "sliding_attention") window[i] = sliding;
    } else if (model_type == "mistral" && sliding) {
      window.assign(window.size(), sliding);
    } else if (model_type == "qwen2" && hf::get_bool(c, "use_sliding_window", false)) {
      const int64_t max_window_layers = hf::get_int(c, "max_window_layers", layers);
      for (int64_t i = max_window_layers; i < layers; ++i) window[static_cast<std::size_t>(i)] = sliding;
    }
    inv_freq = rope_inverse_frequencies(c);
  }

  // RoPE inverse frequencies, with the rope_type of config.json (rope_parameters in transformers 5,
  // rope_theta + rope_scaling before).
  at::Tensor rope_inverse_frequencies(const nlohmann::json& c) const {
    nlohmann::json rope = nlohmann::json::object();
    if (const auto* p = hf::find(c, "rope_parameters"); p && p->is_object()) rope = *p;
    else if (const auto* s = hf::find(c, "rope_scaling"); s && s->is_object()) rope = *s;
    const double theta = hf::get_double(rope, "rope_theta", hf::get_double(c, "rope_theta", 10000.0));
    std::string type = hf::get_string(rope, "rope_type", hf::get_string(rope, "type", "default"));
    const double partial = hf::get_double(c, "partial_rotary_factor", 1.0);
    const int64_t dim = static_cast<int64_t>(static_cast<double>(head_dim) * partial);
    at::Tensor inv = 1.0 / at::pow(theta, at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(dim));
    if (type == "default") return inv;
    if (type == "linear") return inv / hf::get_double(rope, "factor");
    if (type == "llama3") {
      const double factor = hf::get_double(rope, "factor");
      const double low = hf::get_double(rope, "low_freq_factor");
      const double high = hf::get_double(rope, "high_freq_factor");
      const double old_context = hf::get_double(rope, "original_max_position_embeddings");
      const double low_wavelen = old_context / low, high_wavelen = old_context / high;
      const at::Tensor wavelen = 2 * std::numbers::pi / inv;
      at::Tensor scaled = at::where(wavelen > low_wavelen, inv / factor, inv);
      const at::Tensor smooth = (old_context / wavelen - low) / (high - low);
      const at::Tensor smoothed = (1 - smooth) * scaled / factor + smooth * scaled;
      const at::Tensor medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen);
      return at::where(medium, smoothed, scaled);
    }
    throw DataError("config.json: rope type \"" + type + "\" is not supported",
                    "supported rope types: default, linear, llama3");
  }
};

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

class LlamaAttention : public Module {
 public:
  LlamaAttention(const LlamaHyper& h, const c10::TensorOptions& o)
      : heads_(h.heads), kv_heads_(h.kv_heads), head_dim_(h.head_dim) {
    q_proj = register_module("q_proj", std::make_shared<Linear>(h.hidden, h.heads * h.head_dim, h.qkv_bias, o));
    k_proj = register_module("k_proj", std::make_shared<Linear>(h.hidden, h.kv_heads * h.head_dim, h.qkv_bias, o));
    v_proj = register_module("v_proj", std::make_shared<Linear>(h.hidden, h.kv_heads * h.head_dim, h.qkv_bias, o));
    o_proj = register_module("o_proj", std::make_shared<Linear>(h.heads * h.head_dim, h.hidden, h.o_bias, o));
    attention_dropout = register_module("attention_dropout", std::make_shared<Dropout>(h.attention_dropout));
  }

  // x (B, T, D); cos/sin (B or 1, T, head_dim); mask (B, 1, T, Tk) bool. With a cache, the new keys and values
  // are written into this layer's buffers and attention runs over all filled positions. With a segment layout (packed rows) the
  // attention runs per segment, with a varlen layout as one variable-length flash attention within `window`
  // (CUDA); either way `mask` is unused.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& mask,
                     KvCache* cache = nullptr, std::size_t layer = 0, const SegmentLayout* layout = nullptr,
                     const VarlenLayout* varlen = nullptr, std::optional<int64_t> window = std::nullopt) {
    const int64_t b = x.size(0), t = x.size(1);
    at::Tensor q = q_proj->forward(x).view({b, t, heads_, head_dim_}).transpose(1, 2);     // (B, H, T, hd)
    at::Tensor k = k_proj->forward(x).view({b, t, kv_heads_, head_dim_}).transpose(1, 2);  // (B, Hkv, T, hd)
    at::Tensor v = v_proj->forward(x).view({b, t, kv_heads_, head_dim_}).transpose(1, 2);
    const at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
    q = q * c + rotate_half(q) * s;
    k = k * c + rotate_half(k) * s;
    if (cache) std::tie(k, v) = cache->append(layer, k, v);
    if (varlen) return o_proj->forward(attend_varlen(*varlen, q, k, v, window));
    if (layout) {
      return o_proj->forward(attend_per_segment(
          *layout, q, k, v,
          [this](const at::Tensor& qg, const at::Tensor& kg, const at::Tensor& vg, const at::Tensor& allowed,
                 const SegmentGroup&) { return attend(qg, kg, vg, allowed); }));
    }
    return o_proj->forward(attend(q, k, v, mask).transpose(1, 2).reshape({b, t, heads_ * head_dim_}));
  }

  // q (B, H, Tq, hd), k and v (B, Hkv, Tk, hd), mask (B, 1, Tq, Tk) bool -> (B, H, Tq, hd).
  at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask) const {
    if (attention_dropout->explicit_attention(is_training())) {
      // transformers' eager attention: keys and values repeated per group, softmax in fp32, dropout on the
      // probabilities.
      const int64_t group = heads_ / kv_heads_;
      const at::Tensor keys = group == 1 ? k : k.repeat_interleave(group, 1);
      const at::Tensor values = group == 1 ? v : v.repeat_interleave(group, 1);
      const at::Tensor scores = at::matmul(q, keys.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(head_dim_))) +
                                additive_mask(mask, q.scalar_type());
      const at::Tensor probabilities = at::softmax(scores.to(at::kFloat), -1).to(q.scalar_type());
      return at::matmul(attention_dropout->attention(probabilities, true), values);
    }
    return at::scaled_dot_product_attention(q, k, v, mask, attention_dropout->sdpa_p(is_training()),
                                            /*is_causal=*/false, std::nullopt, /*enable_gqa=*/kv_heads_ != heads_);
  }

  std::shared_ptr<Linear> q_proj, k_proj, v_proj, o_proj;
  std::shared_ptr<Dropout> attention_dropout;

 private:
  int64_t heads_, kv_heads_, head_dim_;
};

class LlamaMlp : public Module {
 public:
  LlamaMlp(const LlamaHyper& h, const c10::TensorOptions& o) : act_(h.act) {
    gate_proj = register_module("gate_proj", std::make_shared<Linear>(h.hidden, h.intermediate, h.mlp_bias, o));
    up_proj = register_module("up_proj", std::make_shared<Linear>(h.hidden, h.intermediate, h.mlp_bias, o));
    down_proj = register_module("down_proj", std::make_shared<Linear>(h.intermediate, h.hidden, h.mlp_bias, o));
  }
  at::Tensor forward(const at::Tensor& x) {
    return down_proj->forward(activation(gate_proj->forward(x), act_) * up_proj->forward(x));
  }
  std::shared_ptr<Linear> gate_proj, up_proj, down_proj;

 private:
  std::string act_;
};

class LlamaBlock : public Module {
 public:
  LlamaBlock(const LlamaHyper& h, const c10::TensorOptions& o) : eps_(h.eps) {
    self_attn = register_module("self_attn", std::make_shared<LlamaAttention>(h, o));
    mlp = register_module("mlp", std::make_shared<LlamaMlp>(h, o));
    input_layernorm = register_module("input_layernorm", std::make_shared<NormWeight>(h.hidden, o));
    post_attention_layernorm = register_module("post_attention_layernorm", std::make_shared<NormWeight>(h.hidden, o));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& mask,
                     KvCache* cache = nullptr, std::size_t layer = 0, const SegmentLayout* layout = nullptr,
                     const VarlenLayout* varlen = nullptr, std::optional<int64_t> window = std::nullopt) {
    at::Tensor h = x + self_attn->forward(llama_rms_norm(x, input_layernorm->weight, eps_), cos, sin, mask,
                                          cache, layer, layout, varlen, window);
    return h + mlp->forward(llama_rms_norm(h, post_attention_layernorm->weight, eps_));
  }
  std::shared_ptr<LlamaAttention> self_attn;
  std::shared_ptr<LlamaMlp> mlp;
  std::shared_ptr<NormWeight> input_layernorm, post_attention_layernorm;

 private:
  double eps_;
};

class Layers : public Module {
 public:
  void push_back(std::shared_ptr<LlamaBlock> block) {
    items.push_back(register_module(std::to_string(items.size()), block));
  }
  std::vector<std::shared_ptr<LlamaBlock>> items;
};

// model.* of the checkpoint: embeddings, blocks, final norm.
class LlamaBody : public Module {
 public:
  LlamaBody(const LlamaHyper& h, const c10::TensorOptions& o) {
    embed_tokens = register_module("embed_tokens", std::make_shared<Embedding>(h.vocab_size, h.hidden, h.pad_token_id, o));
    layers = register_module("layers", std::make_shared<Layers>());
    for (int64_t i = 0; i < h.layers; ++i) layers->push_back(std::make_shared<LlamaBlock>(h, o));
    norm = register_module("norm", std::make_shared<NormWeight>(h.hidden, o));
  }
  std::shared_ptr<Embedding> embed_tokens;
  std::shared_ptr<Layers> layers;
  std::shared_ptr<NormWeight> norm;
};

struct LlamaGenerationState : GenerationState {
  LlamaGenerationState(std::size_t layers, int64_t capacity) : cache(layers, capacity) {}
  KvCache cache;           // per layer (B, Hkv, T, hd)
  at::Tensor key_mask;     // (B, T): 0 at the prompts' left padding
  at::Tensor next_position;  // (B) long: the position id of each row's next token
};

class LlamaModel : public LanguageModel {
 public:
  LlamaModel(const nlohmann::json& config, const c10::TensorOptions& options)
      : config_(config), h_(config), options_(options) {
    model = register_module("model", std::make_shared<LlamaBody>(h_, options));
    if (!h_.tie) untie_lm_head();
  }

  const std::string& model_type() const override { return h_.model_type; }
  ModelFamily family() const override { return ModelFamily::kCausal; }
  int64_t vocab_size() const override { return h_.vocab_size; }
  const nlohmann::json& hf_config() const override { return config_; }
  std::optional<int64_t> eos_token_id() const override { return h_.eos; }

  // cos and sin (1, T, head_dim) for positions offset..offset+T-1, computed in fp32 and cast to `dtype`.
  std::pair<at::Tensor, at::Tensor> rotary(int64_t offset, int64_t length, c10::ScalarType dtype,
                                           const at::Device& device) const {
    const at::Tensor positions = at::arange(offset, offset + length, at::TensorOptions().dtype(at::kFloat).device(device));
    const at::Tensor freqs = positions.unsqueeze(1) * h_.inv_freq.to(device).unsqueeze(0);  // (T, hd/2)
    const at::Tensor emb = at::cat({freqs, freqs}, -1).unsqueeze(0);
    return {emb.cos().to(dtype), emb.sin().to(dtype)};
  }

  // cos and sin (B, T, head_dim) for the position ids of packed rows (B, T), computed as rotary() computes them.
  std::pair<at::Tensor, at::Tensor> rotary_at(const at::Tensor& positions, c10::ScalarType dtype) const {
    const at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * h_.inv_freq.to(positions.device());  // (B, T, hd/2)
    const at::Tensor emb = at::cat({freqs, freqs}, -1);
    return {emb.cos().to(dtype), emb.sin().to(dtype)};
  }

  // Runs the blocks over (B, T) ids; with a state, uses and extends its cache (`offset`: the cache's length).
  // Position ids (B, T), when given, rotate instead of offset + t (left-padded generation). Packed rows (segment
  // and position ids) attend within their segments and rotate by their positions within them: as one varlen flash
  // attention on a CUDA card (varlen_attention_runs), per segment when plan_segment_attention chooses it (one
  // layout per distinct sliding window), else over the row with the mask.
  at::Tensor body(const at::Tensor& ids, const at::Tensor& key_mask, int64_t offset, LlamaGenerationState* state,
                  const at::Tensor& segments = {}, const at::Tensor& positions = {}) {
    at::Tensor x = model->embed_tokens->forward(ids);
    const bool packed = segments.defined();
    const auto [cos, sin] = positions.defined() ? rotary_at(positions, x.scalar_type())
                                   : rotary(offset, ids.size(1), x.scalar_type(), x.device());
    auto mask_for = [&](std::optional<int64_t> window) {
      return packed ? segment_mask(segments, segments, positions, positions, /*causal=*/true, window)
                    : causal_mask(key_mask, ids.size(1), offset, window);
    };
    std::optional<at::Tensor> full_mask;
    std::map<std::optional<int64_t>, std::shared_ptr<const SegmentLayout>> layouts;  // per window
    // On a CUDA card in bf16/fp16 without attention dropout: one variable-length flash attention per layer.
    std::shared_ptr<const VarlenLayout> varlen;
    if (packed && !state && (!is_training() || h_.attention_dropout == 0.0) &&
        varlen_attention_runs(x, h_.head_dim))
      varlen = plan_varlen_attention(segments, positions);
    for (std::size_t i = 0; i < model->layers->items.size(); ++i) {
      std::shared_ptr<const SegmentLayout> layout;
      if (packed && !state && !varlen) {
        auto found = layouts.find(h_.window[i]);
        if (found == layouts.end())
          found = layouts.emplace(h_.window[i], plan_segment_attention(segments, segments, positions, positions,
                                                                       /*causal=*/true, h_.window[i]))
                      .first;
        layout = found->second;
      }
      at::Tensor mask;
      if (layout || varlen) {
        // Per segment: no mask over the row. An empty tensor stands in (block inputs must be defined tensors for
        // activation checkpointing).
        mask = at::empty({0}, ids.options().dtype(at::kBool));
      } else if (h_.window[i]) {
        mask = mask_for(h_.window[i]);
      } else {
        if (!full_mask) full_mask = mask_for(std::nullopt);
        mask = *full_mask;
      }
      auto& block = model->layers->items[i];
      if (state) {
        x = block->forward(x, cos, sin, mask, &state->cache, i);
      } else {
        x = run_block([block, layout, varlen, window = h_.window[i]](const std::vector<at::Tensor>& in) {
          return block->forward(in[0], in[1], in[2], in[3], nullptr, 0, layout.get(), varlen.get(), window);
        }, {x, cos, sin, mask});
      }
    }
    return llama_rms_norm(x, model->norm->weight, h_.eps);
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

  at::Tensor lm_head(const at::Tensor& hidden) override { return at::linear(hidden, lm_head_weight()); }
  at::Tensor lm_head_weight() const override {
    return lm_head_weight_.defined() ? lm_head_weight_ : model->embed_tokens->weight;
  }
  double lm_head_scale() const override { return 1.0; }

  std::vector<std::pair<std::string, std::string>> aliases() const override {
    if (lm_head_tied()) return {{"lm_head.weight", "model.embed_tokens.weight"}};
    return {};
  }
  bool lm_head_tied() const override { return !lm_head_weight_.defined(); }
  void untie_lm_head() override {
    if (lm_head_weight_.defined()) return;
    lm_head_weight_ = at::empty({h_.vocab_size, h_.hidden}, options_);
    register_parameter("lm_head.weight", &lm_head_weight_);
  }

  void init_weights() override {
    // transformers' PreTrainedModel._init_weights: normal(0, initializer_range) for linear and embedding
    // weights, zero biases, ones for norms, a zero padding row.
    at::NoGradGuard no_grad;
    const double std_dev = h_.initializer_range;
    for_each_parameter([&](const std::string& name, at::Tensor& p) {
      if (name.ends_with("norm.weight")) p.fill_(1.0);
      else if (name.ends_with(".bias")) p.zero_();
      else p.normal_(0.0, std_dev);
    });
    if (h_.pad_token_id) model->embed_tokens->weight[*h_.pad_token_id].zero_();
  }

  std::pair<std::unique_ptr<GenerationState>, at::Tensor> prefill(const at::Tensor& prompt_ids,
                                                                  const at::Tensor& attention_mask,
                                                                  int64_t new_tokens) override {
    const int64_t batch = prompt_ids.size(0), width = prompt_ids.size(1);
    const std::size_t layers = model->layers->items.size();
    auto state = std::make_unique<LlamaGenerationState>(layers, width + new_tokens);
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
      LlamaGenerationState part(layers, group.width);
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
    auto& state = static_cast<LlamaGenerationState&>(generic);
    const int64_t offset = state.key_mask.size(1);
    state.key_mask = at::cat({state.key_mask, at::ones_like(tokens).to(state.key_mask.scalar_type())}, 1);
    const at::Tensor hidden = body(tokens, state.key_mask, offset, &state, {}, state.next_position.unsqueeze(1));
    state.next_position = state.next_position + 1;
    return lm_head(hidden.select(1, 0));
  }

  void select_rows(GenerationState& generic, const at::Tensor& rows) override {
    auto& state = static_cast<LlamaGenerationState&>(generic);
    const at::Tensor index = rows.to(state.key_mask.device());
    state.cache.select_rows(index);
    state.key_mask = state.key_mask.index_select(0, index);
    state.next_position = state.next_position.index_select(0, index);
  }

  std::shared_ptr<LlamaBody> model;

 private:
  nlohmann::json config_;
  LlamaHyper h_;
  c10::TensorOptions options_;
  at::Tensor lm_head_weight_;
};

}  // namespace

std::unique_ptr<LanguageModel> make_llama(const nlohmann::json& config, const c10::TensorOptions& options) {
  return std::make_unique<LlamaModel>(config, options);
}

}  // namespace trainer
