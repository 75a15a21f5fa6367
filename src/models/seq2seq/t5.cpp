// T5 and T5 v1.1 / FLAN-T5 (transformers' modeling_t5.py): encoder-decoder, RMS layer norm without bias,
// relative position buckets (one learned bias per stack, computed in block 0 and shared by every layer), no
// 1/sqrt(d) attention scaling, relu or gated-gelu feed-forward, decoder output rescaled by d_model^-0.5 when the
// LM head is the shared embedding (original T5).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

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

struct T5Hyper {
  int64_t vocab_size, d_model, d_kv, d_ff, num_layers, num_decoder_layers, num_heads;
  int64_t num_buckets, max_distance;
  double dropout, eps, initializer_factor;
  bool gated;
  std::string act;
  bool scale_decoder_outputs, tie_lm_head;
  int64_t decoder_start_token_id, pad_token_id;
  std::optional<int64_t> eos;

  explicit T5Hyper(const nlohmann::json& c) {
    vocab_size = hf::get_int(c, "vocab_size", 32128);
    d_model = hf::get_int(c, "d_model", 512);
    d_kv = hf::get_int(c, "d_kv", 64);
    d_ff = hf::get_int(c, "d_ff", 2048);
    num_layers = hf::get_int(c, "num_layers", 6);
    num_decoder_layers = hf::get_int(c, "num_decoder_layers", num_layers);
    num_heads = hf::get_int(c, "num_heads", 8);
    num_buckets = hf::get_int(c, "relative_attention_num_buckets", 32);
    max_distance = hf::get_int(c, "relative_attention_max_distance", 128);
    dropout = hf::get_double(c, "dropout_rate", 0.1);
    eps = hf::get_double(c, "layer_norm_epsilon", 1e-6);
    initializer_factor = hf::get_double(c, "initializer_factor", 1.0);
    const std::string proj = hf::get_string(c, "feed_forward_proj", "relu");
    gated = proj.starts_with("gated-");
    act = gated ? proj.substr(6) : proj;
    if (proj == "gated-gelu") act = "gelu_new";  // as transformers maps it
    check_activation(act, "config.json \"feed_forward_proj\"");
    // transformers 5 keeps the rescale as its own key; older configs say it through tie_word_embeddings
    // (original T5: tied and rescaled; T5 v1.1 / FLAN-T5: "tie_word_embeddings": false, untied, no rescale).
    const bool tie = hf::get_bool(c, "tie_word_embeddings", true);
    scale_decoder_outputs = hf::get_bool(c, "scale_decoder_outputs", tie);
    tie_lm_head = tie;
    decoder_start_token_id = hf::get_int(c, "decoder_start_token_id", hf::get_int(c, "pad_token_id", 0));
    pad_token_id = hf::get_int(c, "pad_token_id", 0);
    eos = hf::get_eos(c);
  }
};

// Bucket of each relative position (memory - query), as Mesh TensorFlow and transformers compute it: half the
// buckets exact, half logarithmic up to max_distance; the encoder distinguishes direction, the decoder sees
// only the past.
at::Tensor relative_position_bucket(const at::Tensor& relative_position, bool bidirectional, int64_t num_buckets,
                                    int64_t max_distance) {
  at::Tensor buckets = at::zeros_like(relative_position);
  at::Tensor position = relative_position;
  if (bidirectional) {
    num_buckets /= 2;
    buckets = buckets + (position > 0).to(at::kLong) * num_buckets;
    position = position.abs();
  } else {
    position = -at::minimum(position, at::zeros_like(position));
  }
  const int64_t max_exact = num_buckets / 2;
  const at::Tensor is_small = position < max_exact;
  at::Tensor large = max_exact + (at::log(position.to(at::kFloat) / max_exact) /
                                  std::log(static_cast<double>(max_distance) / max_exact) * (num_buckets - max_exact))
                                     .to(at::kLong);
  large = at::minimum(large, at::full_like(large, num_buckets - 1));
  return buckets + at::where(is_small, position, large);
}

class T5Attention : public Module {
 public:
  T5Attention(const T5Hyper& h, bool has_relative_bias, const c10::TensorOptions& options)
      : heads_(h.num_heads), d_kv_(h.d_kv) {
    const int64_t inner = h.num_heads * h.d_kv;
    q = register_module("q", std::make_shared<Linear>(h.d_model, inner, false, options));
    k = register_module("k", std::make_shared<Linear>(h.d_model, inner, false, options));
    v = register_module("v", std::make_shared<Linear>(h.d_model, inner, false, options));
    o = register_module("o", std::make_shared<Linear>(inner, h.d_model, false, options));
    dropout = register_module("dropout", std::make_shared<Dropout>(h.dropout));  // on the attention probabilities
    if (has_relative_bias)
      relative_attention_bias = register_module(
          "relative_attention_bias", std::make_shared<Embedding>(h.num_buckets, h.num_heads, std::nullopt, options));
  }

  // (B, T, D) -> (B, H, T, d_kv)
  at::Tensor heads(const Linear& projection, const at::Tensor& x) const { return split_heads(projection.forward(x)); }
  // (B, T, H * d_kv) -> (B, H, T, d_kv)
  at::Tensor split_heads(const at::Tensor& y) const {
    return y.view({y.size(0), y.size(1), heads_, d_kv_}).transpose(1, 2);
  }

  // x (B, Tq, D) attends to keys/values (B, H, Tk, d_kv) with an additive bias (B or 1, H or 1, Tq, Tk). With a
  // segment layout (packed rows), per segment instead: `bias` is then the position bias (1, H, Lq, Lk) at the
  // layout's longest segments (empty: none, cross-attention) and the layout supplies the masks.
  at::Tensor attend(const at::Tensor& x, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& bias,
                    const SegmentLayout* layout = nullptr) {
    const at::Tensor query = heads(*q, x);
    if (layout) {
      const auto dtype = query.scalar_type();
      const at::Tensor out = attend_per_segment(
          *layout, query, keys, values,
          [&](const at::Tensor& qg, const at::Tensor& kg, const at::Tensor& vg, const at::Tensor& allowed,
              const SegmentGroup& g) {
            // Relative positions within a segment are those of its first Lq x Lk positions: the top-left block.
            const at::Tensor mask = additive_mask(allowed, dtype);
            return scores_to_output(qg, kg, vg,
                                    bias.numel() > 0 ? bias.narrow(2, 0, g.query_length).narrow(3, 0, g.key_length) + mask
                                                     : mask);
          });
      return o->forward(out);  // (B, Tq, D)
    }
    const at::Tensor out = scores_to_output(query, keys, values, bias);  // (B, H, Tq, d_kv)
    return o->forward(out.transpose(1, 2).reshape({x.size(0), x.size(1), heads_ * d_kv_}));  // (B, Tq, D)
  }

  // (B, H, Tq, d_kv) queries, (B, H, Tk, d_kv) keys and values, additive bias -> (B, H, Tq, d_kv).
  at::Tensor scores_to_output(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                              const at::Tensor& bias) const {
    if (dropout->explicit_attention(is_training())) {
      // As transformers' T5Attention: softmax in fp32, cast back, dropout on the probabilities.
      const at::Tensor scores = at::matmul(query, keys.transpose(-2, -1)) + bias.to(query.scalar_type());
      const at::Tensor probabilities = at::softmax(scores.to(at::kFloat), -1).to(query.scalar_type());
      return at::matmul(dropout->attention(probabilities, true), values);
    }
    return at::scaled_dot_product_attention(query, keys, values, bias.to(query.scalar_type()),
                                            dropout->sdpa_p(is_training()), /*is_causal=*/false, /*scale=*/1.0);
  }

  std::shared_ptr<Linear> q, k, v, o;
  std::shared_ptr<Dropout> dropout;
  std::shared_ptr<Embedding> relative_attention_bias;

 private:
  int64_t heads_, d_kv_;
};

// layer.N of a block: a norm, an attention named SelfAttention or EncDecAttention, the residual's dropout.
class T5AttentionLayer : public Module {
 public:
  T5AttentionLayer(const T5Hyper& h, const char* name, bool has_relative_bias, const c10::TensorOptions& o) {
    attention = register_module(name, std::make_shared<T5Attention>(h, has_relative_bias, o));
    layer_norm = register_module("layer_norm", std::make_shared<NormWeight>(h.d_model, o));
    dropout = register_module("dropout", std::make_shared<Dropout>(h.dropout));
  }
  std::shared_ptr<T5Attention> attention;
  std::shared_ptr<NormWeight> layer_norm;
  std::shared_ptr<Dropout> dropout;
};

class T5DenseReluDense : public Module {
 public:
  T5DenseReluDense(const T5Hyper& h, const c10::TensorOptions& o) : act_(h.act) {
    if (h.gated) {
      wi_0 = register_module("wi_0", std::make_shared<Linear>(h.d_model, h.d_ff, false, o));
      wi_1 = register_module("wi_1", std::make_shared<Linear>(h.d_model, h.d_ff, false, o));
    } else {
      wi = register_module("wi", std::make_shared<Linear>(h.d_model, h.d_ff, false, o));
    }
    wo = register_module("wo", std::make_shared<Linear>(h.d_ff, h.d_model, false, o));
    dropout = register_module("dropout", std::make_shared<Dropout>(h.dropout));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor hidden = wi ? activation(wi->forward(x), act_) : activation(wi_0->forward(x), act_) * wi_1->forward(x);
    hidden = dropout->forward(hidden, is_training());
    return wo->forward(hidden.to(wo->weight.scalar_type()));
  }
  std::shared_ptr<Linear> wi, wi_0, wi_1, wo;
  std::shared_ptr<Dropout> dropout;

 private:
  std::string act_;
};

class T5FeedForwardLayer : public Module {
 public:
  T5FeedForwardLayer(const T5Hyper& h, const c10::TensorOptions& o) {
    DenseReluDense = register_module("DenseReluDense", std::make_shared<T5DenseReluDense>(h, o));
    layer_norm = register_module("layer_norm", std::make_shared<NormWeight>(h.d_model, o));
    dropout = register_module("dropout", std::make_shared<Dropout>(h.dropout));
  }
  std::shared_ptr<T5DenseReluDense> DenseReluDense;
  std::shared_ptr<NormWeight> layer_norm;
  std::shared_ptr<Dropout> dropout;
};

// A numbered list of children ("block.0", "layer.1").
template <class M>
class ModuleList : public Module {
 public:
  void push_back(std::shared_ptr<M> child) { items.push_back(register_module(std::to_string(items.size()), child)); }
  std::vector<std::shared_ptr<M>> items;
};

struct T5Block : public Module {
  T5Block(const T5Hyper& h, bool decoder, bool first, const c10::TensorOptions& o) {
    auto list = register_module("layer", std::make_shared<ModuleList<Module>>());
    self_attention = std::make_shared<T5AttentionLayer>(h, "SelfAttention", first, o);
    list->push_back(self_attention);
    if (decoder) {
      cross_attention = std::make_shared<T5AttentionLayer>(h, "EncDecAttention", false, o);
      list->push_back(cross_attention);
    }
    feed_forward = std::make_shared<T5FeedForwardLayer>(h, o);
    list->push_back(feed_forward);
  }

  std::shared_ptr<T5AttentionLayer> self_attention, cross_attention;
  std::shared_ptr<T5FeedForwardLayer> feed_forward;
};

// The decoder's state during generation. Cross-attention keys and values come from the encoder output, once per
// prompt; rows (beams, or the prompts still running) use their prompt's, gathered again only when the prompt of
// some row changes: reordering the beams of a prompt leaves them as they are. When the rows are runs of equally
// many rows per prompt (beam search), the keys and values are gathered per prompt, not per row, and a prompt's
// rows attend to them together as that many queries: each prompt's keys and values are read once a step.
struct T5GenerationState : GenerationState {
  T5GenerationState(std::size_t layers, int64_t capacity) : self_cache(layers, capacity) {}
  KvCache self_cache;                           // decoder self-attention, one position per step
  at::Tensor self_bias;                         // (1, H, capacity, capacity): the position bias of the steps
  std::vector<at::Tensor> prompt_cross_keys, prompt_cross_values;  // per layer (P, H, S, d_kv), one row per prompt
  at::Tensor prompt_cross_bias;                 // (P, 1, 1, S): the prompts' padding
  std::vector<int64_t> prompt_of_row;           // (B): the prompt each row continues
  int64_t rows_per_prompt = 1;                  // G: rows r*G .. r*G+G-1 share the keys and values of entry r
  std::vector<at::Tensor> cross_keys, cross_values;  // per layer (B / G, H, S, d_kv)
  at::Tensor cross_bias;                        // (B / G, 1, 1, S)
  int64_t position = 0;                         // decoder positions already in the cache

  // Gathers the cross-attention inputs of the rows (or of their prompts, in runs of G) from those of the prompts
  // (none when entry r is prompt r).
  void gather_cross() {
    const auto rows = static_cast<int64_t>(prompt_of_row.size());
    int64_t group = 1;
    while (group < rows && prompt_of_row[static_cast<std::size_t>(group)] == prompt_of_row[0]) ++group;
    bool runs = group > 1 && rows % group == 0;
    for (int64_t r = 0; runs && r < rows; ++r)
      runs = prompt_of_row[static_cast<std::size_t>(r)] == prompt_of_row[static_cast<std::size_t>(r - r % group)];
    rows_per_prompt = runs ? group : 1;
    std::vector<int64_t> entries;
    for (int64_t r = 0; r < rows; r += rows_per_prompt) entries.push_back(prompt_of_row[static_cast<std::size_t>(r)]);
    bool identity = static_cast<int64_t>(entries.size()) == prompt_cross_bias.size(0);
    for (std::size_t r = 0; identity && r < entries.size(); ++r) identity = entries[r] == static_cast<int64_t>(r);
    const at::Tensor index = identity ? at::Tensor() : at::tensor(entries, at::kLong).to(prompt_cross_bias.device());
    auto rows_of = [&](const at::Tensor& t) { return identity ? t : t.index_select(0, index); };
    cross_keys.clear();
    cross_values.clear();
    for (std::size_t i = 0; i < prompt_cross_keys.size(); ++i) {
      cross_keys.push_back(rows_of(prompt_cross_keys[i]));
      cross_values.push_back(rows_of(prompt_cross_values[i]));
    }
    cross_bias = rows_of(prompt_cross_bias);
  }
};

// Packed rows attended per segment (models/segment_attention.h): the layouts of a stack's self-attention and the
// decoder's cross-attention. A null layout takes whole-row attention with the masked bias.
struct T5Layouts {
  std::shared_ptr<const SegmentLayout> self, cross;
};

class T5Stack : public Module {
 public:
  T5Stack(const T5Hyper& h, bool decoder, const c10::TensorOptions& o) : h_(h), decoder_(decoder) {
    block = register_module("block", std::make_shared<ModuleList<T5Block>>());
    const int64_t n = decoder ? h.num_decoder_layers : h.num_layers;
    for (int64_t i = 0; i < n; ++i) block->push_back(std::make_shared<T5Block>(h, decoder, i == 0, o));
    final_layer_norm = register_module("final_layer_norm", std::make_shared<NormWeight>(h.d_model, o));
    // transformers' T5Stack calls one dropout module on the embeddings and on the output; two sites here.
    dropout = register_module("dropout", std::make_shared<Dropout>(h.dropout));
    final_dropout = register_module("final_dropout", std::make_shared<Dropout>(h.dropout));
  }

  // (1, H, Tq, Tk) learned bias of block 0 for queries starting at `offset`.
  at::Tensor position_bias(int64_t query_length, int64_t key_length, int64_t offset, const at::Device& device) {
    const auto long_options = at::TensorOptions().dtype(at::kLong).device(device);
    const at::Tensor context = at::arange(offset, offset + query_length, long_options).unsqueeze(1);
    const at::Tensor memory = at::arange(key_length, long_options).unsqueeze(0);
    const at::Tensor buckets = relative_position_bucket(memory - context, !decoder_, h_.num_buckets, h_.max_distance);
    const auto& table = block->items[0]->self_attention->attention->relative_attention_bias;
    return table->forward(buckets).permute({2, 0, 1}).unsqueeze(0);
  }

  // One block over the whole sequence: x (B, T, D), biases (B or 1, H or 1, T, Tk), encoder states or undefined.
  // With layouts, the biases are what T5Attention::attend takes with a layout.
  at::Tensor block_forward(T5Block& b, const at::Tensor& input, const at::Tensor& self_bias,
                           const at::Tensor& encoder_states, const at::Tensor& cross_bias,
                           const T5Layouts& layouts = {}) const {
    auto& sa = *b.self_attention;
    at::Tensor normed = t5_rms_norm(input, sa.layer_norm->weight, h_.eps);
    const bool training = is_training();
    at::Tensor x = input + sa.dropout->forward(sa.attention->attend(normed, sa.attention->heads(*sa.attention->k, normed),
                                                                    sa.attention->heads(*sa.attention->v, normed),
                                                                    self_bias, layouts.self.get()),
                                               training);
    if (decoder_) {
      auto& ca = *b.cross_attention;
      normed = t5_rms_norm(x, ca.layer_norm->weight, h_.eps);
      x = x + ca.dropout->forward(ca.attention->attend(normed, ca.attention->heads(*ca.attention->k, encoder_states),
                                                       ca.attention->heads(*ca.attention->v, encoder_states), cross_bias,
                                                       layouts.cross.get()),
                                  training);
    }
    auto& ff = *b.feed_forward;
    return x + ff.dropout->forward(ff.DenseReluDense->forward(t5_rms_norm(x, ff.layer_norm->weight, h_.eps)), training);
  }

  // Whole-sequence forward (training, evaluation, the encoder during generation). embeddings (B, T, D).
  // `run` runs each block (directly, or through a wrapper such as activation checkpointing).
  template <class Run>
  at::Tensor forward(const at::Tensor& embeddings, const at::Tensor& self_bias, const at::Tensor& encoder_states,
                     const at::Tensor& cross_bias, const Run& run, const T5Layouts& layouts = {}) {
    at::Tensor x = dropout->forward(embeddings, is_training());
    for (auto& b : block->items) {
      std::vector<at::Tensor> inputs = {x, self_bias};
      if (decoder_) {
        inputs.push_back(encoder_states);
        inputs.push_back(cross_bias);
      }
      x = run([this, b, layouts](const std::vector<at::Tensor>& in) {
        return block_forward(*b, in[0], in[1], in.size() > 2 ? in[2] : at::Tensor(), in.size() > 3 ? in[3] : at::Tensor(),
                             layouts);
      }, inputs, static_cast<const Module*>(b.get()));
    }
    return final_dropout->forward(t5_rms_norm(x, final_layer_norm->weight, h_.eps), is_training());
  }

  // One decoder position with the cache. embedding (B, 1, D): every row at the same position. `unit` runs each
  // block's step (fully sharded weights gather the block for it).
  template <class Unit>
  at::Tensor decode_step(const at::Tensor& embedding, T5GenerationState& state, const Unit& unit) {
    const int64_t key_length = state.position + 1;
    // The position bias of this query, from the table computed for the whole generation (past it: computed here).
    const at::Tensor self_bias = key_length <= state.self_bias.size(3)
                                     ? state.self_bias.narrow(2, state.position, 1).narrow(3, 0, key_length)
                                     : position_bias(1, key_length, state.position, embedding.device());
    at::Tensor x = embedding;
    for (std::size_t i = 0; i < block->items.size(); ++i) {
      auto& b = *block->items[i];
      x = unit([&, i](const std::vector<at::Tensor>& in) {
        at::Tensor y = in[0];
        auto& sa = *b.self_attention->attention;
        at::Tensor normed = t5_rms_norm(y, b.self_attention->layer_norm->weight, h_.eps);
        const auto [keys, values] = state.self_cache.append(i, sa.heads(*sa.k, normed), sa.heads(*sa.v, normed));
        y = y + sa.attend(normed, keys, values, self_bias);
        auto& ca = *b.cross_attention->attention;
        normed = t5_rms_norm(y, b.cross_attention->layer_norm->weight, h_.eps);
        // A prompt's G rows (B, 1, D) attend as G queries of one row (B / G, G, D): the same per query.
        const int64_t g = state.rows_per_prompt;
        y = y + ca.attend(normed.reshape({-1, g, normed.size(2)}), state.cross_keys[i], state.cross_values[i],
                          state.cross_bias)
                    .reshape(normed.sizes());
        auto& ff = *b.feed_forward;
        return y + ff.DenseReluDense->forward(t5_rms_norm(y, ff.layer_norm->weight, h_.eps));
      }, std::vector<at::Tensor>{x}, static_cast<const Module*>(&b));
    }
    state.position += 1;
    return t5_rms_norm(x, final_layer_norm->weight, h_.eps);
  }

  std::shared_ptr<ModuleList<T5Block>> block;
  std::shared_ptr<NormWeight> final_layer_norm;
  std::shared_ptr<Dropout> dropout, final_dropout;

 private:
  const T5Hyper& h_;
  bool decoder_;
};

class T5Model : public LanguageModel {
 public:
  T5Model(const nlohmann::json& config, const c10::TensorOptions& options)
      : config_(config), h_(config), options_(options) {
    shared = register_module("shared", std::make_shared<Embedding>(h_.vocab_size, h_.d_model, std::nullopt, options));
    encoder = register_module("encoder", std::make_shared<T5Stack>(h_, false, options));
    decoder = register_module("decoder", std::make_shared<T5Stack>(h_, true, options));
    if (!h_.tie_lm_head) untie_lm_head();
  }

  const std::string& model_type() const override { return type_; }
  ModelFamily family() const override { return ModelFamily::kSeq2Seq; }
  int64_t vocab_size() const override { return h_.vocab_size; }
  const nlohmann::json& hf_config() const override { return config_; }
  std::optional<int64_t> eos_token_id() const override { return h_.eos; }

  // transformers' _shift_right: decoder_start_token_id first, -100 becomes padding.
  at::Tensor shift_right(const at::Tensor& labels) const {
    at::Tensor shifted = at::full_like(labels, h_.decoder_start_token_id);
    shifted.narrow(1, 1, labels.size(1) - 1).copy_(labels.narrow(1, 0, labels.size(1) - 1));
    return shifted.masked_fill(shifted == -100, h_.pad_token_id);
  }

  auto runner() const {
    return [this](const BlockFn& fn, const std::vector<at::Tensor>& inputs, const Module* unit) {
      return run_block(fn, inputs, unit);
    };
  }

  // Packed rows: attention within segments. The relative position of two positions of one segment (key minus
  // query) is the same counted in the row or within the example, so the stack's bias over the row, masked to the
  // segments, is the bias of each example's own positions. Per segment (when plan_segment_attention chooses it),
  // the bias is computed once at the longest segment's length and each group takes its top-left block.
  at::Tensor encode(const at::Tensor& input_ids, const at::Tensor& attention_mask, const at::Tensor& segments = {},
                    const at::Tensor& positions = {}) {
    const int64_t t = input_ids.size(1);
    const auto dtype = shared->weight.scalar_type();
    if (segments.defined()) {
      if (auto layout = plan_segment_attention(segments, segments, positions, positions, false, std::nullopt)) {
        const at::Tensor bias =
            encoder->position_bias(layout->max_query_length, layout->max_key_length, 0, input_ids.device());
        return encoder->forward(shared->forward(input_ids), bias, {}, {}, runner(), T5Layouts{std::move(layout), {}});
      }
    }
    const at::Tensor mask = segments.defined()
                                ? additive_mask(segment_mask(segments, segments, {}, {}, false, std::nullopt), dtype)
                                : padding_bias(attention_mask, dtype);
    const at::Tensor bias = encoder->position_bias(t, t, 0, input_ids.device()) + mask;
    return encoder->forward(shared->forward(input_ids), bias, {}, {}, runner());
  }

  std::pair<at::Tensor, at::Tensor> hidden_and_targets(const Batch& batch) override {
    const bool packed = batch.segment_ids.defined();
    const at::Tensor encoder_states = encode(batch.input_ids, batch.attention_mask, batch.segment_ids, batch.position_ids);
    at::Tensor decoder_ids = shift_right(batch.labels);
    // Each packed example's decoder starts from the start token, not from the previous example's last label.
    if (packed) decoder_ids = decoder_ids.masked_fill(batch.decoder_position_ids == 0, h_.decoder_start_token_id);
    const int64_t l = decoder_ids.size(1);
    const auto dtype = shared->weight.scalar_type();
    const at::Tensor decoder_mask = batch.decoder_attention_mask.defined()
                                        ? batch.decoder_attention_mask
                                        : at::ones_like(decoder_ids);
    T5Layouts layouts;
    if (packed) {
      layouts.self = plan_segment_attention(batch.decoder_segment_ids, batch.decoder_segment_ids,
                                            batch.decoder_position_ids, batch.decoder_position_ids, true, std::nullopt);
      layouts.cross = plan_segment_attention(batch.decoder_segment_ids, batch.segment_ids, batch.decoder_position_ids,
                                             batch.position_ids, false, std::nullopt);
    }
    at::Tensor self_bias, cross_bias;
    if (layouts.self) {
      self_bias = decoder->position_bias(layouts.self->max_query_length, layouts.self->max_key_length, 0,
                                         decoder_ids.device());
    } else {
      const at::Tensor causal = packed ? segment_mask(batch.decoder_segment_ids, batch.decoder_segment_ids,
                                                      batch.decoder_position_ids, batch.decoder_position_ids, true,
                                                      std::nullopt)
                                       : causal_mask(decoder_mask, l, 0, std::nullopt);  // (B, 1, L, L) bool
      self_bias = decoder->position_bias(l, l, 0, decoder_ids.device()) + additive_mask(causal, dtype);
    }
    // Per segment, cross-attention has no bias: an empty tensor stands in (block inputs must be defined tensors for
    // activation checkpointing).
    if (layouts.cross) {
      cross_bias = at::empty({0}, decoder_ids.options().dtype(dtype));
    } else {
      cross_bias = packed ? additive_mask(segment_mask(batch.decoder_segment_ids, batch.segment_ids, {}, {}, false,
                                                       std::nullopt),
                                          dtype)
                          : padding_bias(batch.attention_mask, dtype);
    }
    const at::Tensor hidden =
        decoder->forward(shared->forward(decoder_ids), self_bias, encoder_states, cross_bias, runner(), layouts);
    return {hidden, batch.labels};
  }

  at::Tensor lm_head(const at::Tensor& hidden) override {
    const at::Tensor h = h_.scale_decoder_outputs ? hidden * lm_head_scale() : hidden;
    return at::linear(h, lm_head_weight());
  }
  at::Tensor lm_head_weight() const override { return lm_head_weight_.defined() ? lm_head_weight_ : shared->weight; }
  double lm_head_scale() const override {
    return h_.scale_decoder_outputs ? std::pow(static_cast<double>(h_.d_model), -0.5) : 1.0;
  }

  std::vector<const Module*> blocks() const override {
    std::vector<const Module*> out;
    for (const auto* stack : {encoder.get(), decoder.get()})
      for (const auto& b : stack->block->items) out.push_back(b.get());
    return out;
  }
  std::vector<std::string> parameters_used_outside_blocks() const override {
    return {"encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"};
  }

  std::vector<std::pair<std::string, std::string>> aliases() const override {
    std::vector<std::pair<std::string, std::string>> out = {{"encoder.embed_tokens.weight", "shared.weight"},
                                                            {"decoder.embed_tokens.weight", "shared.weight"}};
    if (lm_head_tied()) out.emplace_back("lm_head.weight", "shared.weight");
    return out;
  }
  bool lm_head_tied() const override { return !lm_head_weight_.defined(); }
  void untie_lm_head() override {
    if (lm_head_weight_.defined()) return;
    lm_head_weight_ = at::empty({h_.vocab_size, h_.d_model}, options_);
    register_parameter("lm_head.weight", &lm_head_weight_);
  }

  void init_weights() override {
    // transformers' T5PreTrainedModel._init_weights, factor = initializer_factor.
    const double f = h_.initializer_factor;
    at::NoGradGuard no_grad;
    shared->weight.normal_(0.0, f * 1.0);
    if (lm_head_weight_.defined()) lm_head_weight_.normal_(0.0, f * 1.0);
    const double dm = static_cast<double>(h_.d_model), dff = static_cast<double>(h_.d_ff);
    const double inner = static_cast<double>(h_.num_heads * h_.d_kv);
    for (auto* stack : {encoder.get(), decoder.get()}) {
      stack->final_layer_norm->weight.fill_(f);
      for (auto& b : stack->block->items) {
        for (auto* layer : {b->self_attention.get(), b->cross_attention.get()}) {
          if (!layer) continue;
          layer->layer_norm->weight.fill_(f);
          auto& a = *layer->attention;
          a.q->weight.normal_(0.0, f * std::pow(dm * h_.d_kv, -0.5));
          a.k->weight.normal_(0.0, f * std::pow(dm, -0.5));
          a.v->weight.normal_(0.0, f * std::pow(dm, -0.5));
          a.o->weight.normal_(0.0, f * std::pow(inner, -0.5));
          if (a.relative_attention_bias) a.relative_attention_bias->weight.normal_(0.0, f * std::pow(dm, -0.5));
        }
        auto& ff = *b->feed_forward;
        ff.layer_norm->weight.fill_(f);
        for (auto& wi : {ff.DenseReluDense->wi, ff.DenseReluDense->wi_0, ff.DenseReluDense->wi_1})
          if (wi) wi->weight.normal_(0.0, f * std::pow(dm, -0.5));
        ff.DenseReluDense->wo->weight.normal_(0.0, f * std::pow(dff, -0.5));
      }
    }
  }

  std::pair<std::unique_ptr<GenerationState>, at::Tensor> prefill(const at::Tensor& prompt_ids,
                                                                  const at::Tensor& attention_mask,
                                                                  int64_t new_tokens) override {
    // The decoder's inputs: the start token, then every new token but the last.
    const int64_t capacity = std::max<int64_t>(new_tokens, 1);
    auto state = std::make_unique<T5GenerationState>(decoder->block->items.size(), capacity);
    state->self_bias = decoder->position_bias(capacity, capacity, 0, prompt_ids.device());
    // The encoder runs once; every step reuses the cross-attention keys and values. Prompts of similar length run
    // together, each group padded to its own longest prompt only; the keys and values at the rest of the padding
    // are zeros (the cross-attention mask hides them).
    const auto groups = prefill_groups(prompt_extents(attention_mask, /*left_padded=*/false));
    // Fully sharded weights: each decoder block is gathered for its keys and values (run_unit), as for its steps.
    auto cross_inputs = [this](T5Block& b, const at::Tensor& encoder_states) {
      const at::Tensor both = run_unit([&b](const std::vector<at::Tensor>& in) {
        auto& ca = *b.cross_attention->attention;
        return at::stack({ca.k->forward(in[0]), ca.v->forward(in[0])});
      }, {encoder_states}, &b);
      return std::pair<at::Tensor, at::Tensor>{both[0], both[1]};  // (B, S, H * d_kv) each
    };
    if (groups.size() == 1) {
      const at::Tensor encoder_states = encode(prompt_ids, attention_mask);
      for (auto& b : decoder->block->items) {
        auto& ca = *b->cross_attention->attention;
        const auto [k, v] = cross_inputs(*b, encoder_states);
        state->prompt_cross_keys.push_back(ca.split_heads(k));
        state->prompt_cross_values.push_back(ca.split_heads(v));
      }
    } else {
      const int64_t batch = prompt_ids.size(0), width = prompt_ids.size(1);
      std::vector<at::Tensor> keys, values;  // per layer (B, S, H * d_kv)
      for (const auto& group : groups) {
        const at::Tensor rows = at::tensor(group.rows, at::kLong).to(prompt_ids.device());
        const at::Tensor encoder_states = encode(prompt_ids.index_select(0, rows).narrow(1, 0, group.width),
                                                 attention_mask.index_select(0, rows).narrow(1, 0, group.width));
        for (std::size_t i = 0; i < decoder->block->items.size(); ++i) {
          const auto [k, v] = cross_inputs(*decoder->block->items[i], encoder_states);
          if (keys.size() <= i) {
            keys.push_back(at::zeros({batch, width, k.size(2)}, k.options()));
            values.push_back(at::zeros({batch, width, v.size(2)}, v.options()));
          }
          keys[i].narrow(1, 0, group.width).index_copy_(0, rows, k);
          values[i].narrow(1, 0, group.width).index_copy_(0, rows, v);
        }
      }
      for (std::size_t i = 0; i < keys.size(); ++i) {
        auto& ca = *decoder->block->items[i]->cross_attention->attention;
        state->prompt_cross_keys.push_back(ca.split_heads(keys[i]));
        state->prompt_cross_values.push_back(ca.split_heads(values[i]));
      }
    }
    state->prompt_cross_bias = padding_bias(attention_mask, shared->weight.scalar_type());
    state->prompt_of_row.resize(static_cast<std::size_t>(prompt_ids.size(0)));
    std::iota(state->prompt_of_row.begin(), state->prompt_of_row.end(), 0);
    state->gather_cross();
    const at::Tensor start = at::full({prompt_ids.size(0), 1}, h_.decoder_start_token_id, prompt_ids.options());
    at::Tensor logits = decode_step(*state, start);
    return {std::move(state), logits};
  }

  at::Tensor decode_step(GenerationState& state, const at::Tensor& tokens) override {
    auto& s = static_cast<T5GenerationState&>(state);
    const at::Tensor hidden = decoder->decode_step(
        shared->forward(tokens), s, [this](const BlockFn& f, const std::vector<at::Tensor>& in, const Module* unit) {
          return run_unit(f, in, unit);
        });
    return lm_head(hidden).select(1, 0);  // (B, V)
  }

  void select_rows(GenerationState& state, const at::Tensor& rows) override {
    auto& s = static_cast<T5GenerationState&>(state);
    s.self_cache.select_rows(rows.to(s.cross_bias.device()));
    const at::Tensor on_cpu = rows.to(at::kCPU).to(at::kLong).contiguous();
    const int64_t* picked = on_cpu.data_ptr<int64_t>();
    std::vector<int64_t> prompts;
    for (int64_t r = 0; r < on_cpu.numel(); ++r) prompts.push_back(s.prompt_of_row[static_cast<std::size_t>(picked[r])]);
    if (prompts == s.prompt_of_row) return;  // beams reordered within their prompts: the same cross inputs
    s.prompt_of_row = std::move(prompts);
    s.gather_cross();
  }

  std::shared_ptr<Embedding> shared;
  std::shared_ptr<T5Stack> encoder, decoder;

 private:
  nlohmann::json config_;
  T5Hyper h_;
  c10::TensorOptions options_;
  at::Tensor lm_head_weight_;
  std::string type_ = "t5";
};

}  // namespace

std::unique_ptr<LanguageModel> make_t5(const nlohmann::json& config, const c10::TensorOptions& options) {
  return std::make_unique<T5Model>(config, options);
}

}  // namespace trainer
