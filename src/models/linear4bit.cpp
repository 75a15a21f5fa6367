// 4-bit linear layers (see linear4bit.h). The formulas follow bitsandbytes 0.50.2: quantize_4bit (in src/quant),
// the default gemm_4bit path (dequantize to the input's dtype, then an ordinary linear) and MatMul4Bit's backward
// (grad_x = grad_y @ dequantize(W), nothing else kept).
#include "models/linear4bit.h"

#include <cstring>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/custom_function.h>

#include "models/layers.h"
#include "models/model.h"
#include "quant/bnb_layout.h"
#include "trainer/errors.h"

namespace trainer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

quant::FloatDtype float_dtype(at::ScalarType type) {
  if (type == at::kBFloat16) return quant::FloatDtype::kBf16;
  if (type == at::kHalf) return quant::FloatDtype::kFp16;
  return quant::FloatDtype::kFp32;
}

at::ScalarType scalar_type(quant::FloatDtype type) {
  if (type == quant::FloatDtype::kBf16) return at::kBFloat16;
  if (type == quant::FloatDtype::kFp16) return at::kHalf;
  return at::kFloat;
}

at::Tensor from_saved(const quant::SavedTensor& saved) {
  const auto dtype = saved.dtype == "U8" ? at::kByte : at::kFloat;
  at::Tensor t = at::empty(saved.shape, at::TensorOptions().dtype(dtype));
  if (!saved.bytes.empty()) std::memcpy(t.data_ptr(), saved.bytes.data(), saved.bytes.size());
  return t;
}

// The packed weight and its state travel through the autograd context as one capsule.
struct Weight4bitHolder : torch::CustomClassHolder {
  Weight4bitHolder(at::Tensor p, const QuantState4bit& s, at::Tensor b) : packed(std::move(p)), state(s), bias(std::move(b)) {}
  at::Tensor packed;
  QuantState4bit state;
  at::Tensor bias;  // frozen (no gradient), or undefined
};

struct Linear4bitFunction : public torch::autograd::Function<Linear4bitFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::intrusive_ptr<Weight4bitHolder> holder) {
    const at::Tensor w = dequantize_weight(holder->packed, holder->state, x.scalar_type());
    ctx->saved_data["weight"] = at::IValue::make_capsule(holder);
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    return holder->bias.defined() ? at::linear(x, w, holder->bias.to(x.scalar_type())) : at::linear(x, w);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto holder = c10::static_intrusive_pointer_cast<Weight4bitHolder>(ctx->saved_data["weight"].toCapsule());
    const at::Tensor& grad = grad_outputs[0];
    if (!grad.defined()) return {at::Tensor(), at::Tensor()};
    const at::Tensor w = dequantize_weight(holder->packed, holder->state, grad.scalar_type());  // (out, in)
    const auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    return {at::matmul(grad, w).to(x_dtype), at::Tensor()};
  }
};

}  // namespace

int64_t QuantState4bit::bytes() const {
  int64_t total = (numel() + 1) / 2;
  for (const at::Tensor* t : {&absmax, &quant_map, &nested_absmax, &nested_quant_map, &state_json})
    if (t->defined()) total += static_cast<int64_t>(t->nbytes());
  return total;
}

int64_t quantized_weight_bytes(int64_t numel, const Quantize4bitOptions& options) {
  const int64_t blocks = (numel + options.blocksize - 1) / options.blocksize;
  const int64_t scales = options.double_quant
                             ? blocks + 4 * ((blocks + quant::Quantized4bit::kNestedBlocksize - 1) /
                                             quant::Quantized4bit::kNestedBlocksize) + 4 * 256
                             : 4 * blocks;
  return (numel + 1) / 2 + scales + 4 * 16 + 200;
}

std::optional<Quantize4bitOptions> quantize_options(const ModelConfig& model) {
  if (model.quantize == QuantizeMode::kNone) return std::nullopt;
  Quantize4bitOptions options;
  options.type = model.quantize == QuantizeMode::kFp4 ? quant::QuantType::kFp4 : quant::QuantType::kNf4;
  options.blocksize = model.quantize_block_size;
  options.double_quant = model.double_quant;
  return options;
}

std::pair<at::Tensor, QuantState4bit> quantize_weight(const at::Tensor& weight, const Quantize4bitOptions& options,
                                                      const c10::Device& device) {
  at::NoGradGuard no_grad;
  at::Tensor cpu = weight.detach().to(at::kCPU).contiguous();
  if (cpu.scalar_type() != at::kFloat && cpu.scalar_type() != at::kBFloat16 && cpu.scalar_type() != at::kHalf)
    cpu = cpu.to(at::kFloat);
  const auto dtype = float_dtype(cpu.scalar_type());
  const auto q = quant::quantize_4bit(cpu.data_ptr(), cpu.numel(), dtype, options.blocksize, options.type,
                                      options.double_quant);
  const std::vector<int64_t> shape = cpu.sizes().vec();
  auto saved = quant::bnb_saved_tensors(q, dtype, shape);
  QuantState4bit state;
  state.type = options.type;
  state.blocksize = options.blocksize;
  state.out_features = shape.at(0);
  state.in_features = shape.at(1);
  state.dtype = scalar_type(dtype);
  state.nested = q.nested;
  state.nested_offset = static_cast<double>(q.nested_offset);
  state.absmax = from_saved(saved.at("absmax")).to(device);
  state.quant_map = from_saved(saved.at("quant_map")).to(device);
  if (q.nested) {
    state.nested_absmax = from_saved(saved.at("nested_absmax")).to(device);
    state.nested_quant_map = from_saved(saved.at("nested_quant_map")).to(device);
  }
  state.state_json = from_saved(saved.at(state.state_key())).to(device);
  return {from_saved(saved.at("weight")).to(device), std::move(state)};
}

at::Tensor dequantize_weight(const at::Tensor& packed, const QuantState4bit& state, at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  const auto device = packed.device();
  const auto int_options = at::TensorOptions().dtype(at::kInt).device(device);
  const int64_t n = state.numel();
  const int64_t blocks = (n + state.blocksize - 1) / state.blocksize;
  // One fp32 scale per block.
  at::Tensor scales = state.absmax;
  if (state.nested) {
    const at::Tensor nested = at::repeat_interleave(state.nested_absmax, quant::Quantized4bit::kNestedBlocksize)
                                  .narrow(0, 0, blocks);
    scales = state.nested_quant_map.index_select(0, state.absmax.to(at::kInt)) * nested +
             at::scalar_tensor(state.nested_offset, at::TensorOptions().dtype(at::kFloat).device(device));
  }
  // A byte decodes to two values (element 2j in the high nibble). bitsandbytes' CPU library reads FP4's nibble 8
  // as -0.0 (when the last dimension is even, the case it handles): the same here, so results equal its bits.
  at::Tensor code = state.quant_map.to(at::kFloat);
  if (state.type == quant::QuantType::kFp4 && state.in_features % 2 == 0)
    code = at::where(at::arange(16, int_options) == 8, at::scalar_tensor(-0.0, code.options()), code);
  const at::Tensor bytes = at::arange(256, int_options);
  const at::Tensor pairs =
      at::stack({code.index_select(0, at::bitwise_right_shift(bytes, 4)), code.index_select(0, at::bitwise_and(bytes, 15))}, 1);
  at::Tensor values = pairs.index_select(0, packed.reshape({-1}).to(at::kInt)).reshape({-1});  // (2 * packed)
  const int64_t padded = blocks * state.blocksize;
  if (values.numel() < padded) values = at::constant_pad_nd(values, {0, padded - values.numel()});
  else if (values.numel() > padded) values = values.narrow(0, 0, padded);
  values.view({blocks, state.blocksize}).mul_(scales.unsqueeze(1));  // in place: one fp32 copy of the weight
  return values.narrow(0, 0, n).view({state.out_features, state.in_features}).to(dtype);
}

at::Tensor linear4bit(const at::Tensor& x, const at::Tensor& packed, const QuantState4bit& state,
                      const at::Tensor& bias) {
  // A bias that trains is added outside, so autograd gives its gradient; a frozen one goes in the linear, as
  // bitsandbytes computes it.
  const bool bias_trains = bias.defined() && bias.requires_grad();
  const at::Tensor inner_bias = bias.defined() && !bias_trains ? bias : at::Tensor();
  at::Tensor y;
  if (at::GradMode::is_enabled() && x.requires_grad()) {
    y = Linear4bitFunction::apply(x, c10::make_intrusive<Weight4bitHolder>(packed, state, inner_bias));
  } else {
    const at::Tensor w = dequantize_weight(packed, state, x.scalar_type());
    y = inner_bias.defined() ? at::linear(x, w, inner_bias.to(x.scalar_type())) : at::linear(x, w);
  }
  return bias_trains ? y + bias : y;
}

QuantState4bit state_from_saved(const std::string& name, const nlohmann::json& quant_state,
                                const at::Tensor& absmax, const at::Tensor& quant_map,
                                const at::Tensor& nested_absmax, const at::Tensor& nested_quant_map,
                                const at::Tensor& state_json, const std::string& source) {
  const std::string where = source + ": " + name;
  auto fail = [&](const std::string& what) -> DataError {
    return DataError(where + ": " + what, "the checkpoint is not one transformers + bitsandbytes saved in 4 bits; "
                                          "load the full-precision model and set model.quantize instead");
  };
  QuantState4bit state;
  try {
    state.type = quant::parse_quant_type(quant_state.at("quant_type").get<std::string>());
    state.blocksize = quant_state.at("blocksize").get<int64_t>();
    quant::check_4bit_blocksize(state.blocksize);
    state.dtype = scalar_type(quant::parse_float_dtype(quant_state.value("dtype", std::string("float32"))));
    const auto shape = quant_state.at("shape").get<std::vector<int64_t>>();
    if (shape.size() != 2) throw std::invalid_argument("the shape must have 2 dimensions");
    state.out_features = shape[0];
    state.in_features = shape[1];
    state.nested = quant_state.contains("nested_offset");
    if (state.nested) {
      state.nested_offset = quant_state.at("nested_offset").get<double>();
      if (quant_state.value("nested_blocksize", int64_t{256}) != quant::Quantized4bit::kNestedBlocksize)
        throw std::invalid_argument("nested_blocksize must be 256");
    }
  } catch (const std::exception& e) {
    throw fail(std::string("quant_state: ") + e.what());
  }
  if (!absmax.defined()) throw fail("the tensor " + name + ".absmax is missing");
  if (!quant_map.defined()) throw fail("the tensor " + name + ".quant_map is missing");
  if (state.nested && !nested_absmax.defined()) throw fail("the tensor " + name + ".nested_absmax is missing");
  if (state.nested && !nested_quant_map.defined()) throw fail("the tensor " + name + ".nested_quant_map is missing");
  const int64_t blocks = (state.numel() + state.blocksize - 1) / state.blocksize;
  if (absmax.numel() != blocks || absmax.scalar_type() != (state.nested ? at::kByte : at::kFloat))
    throw fail(".absmax has " + std::to_string(absmax.numel()) + " values; the shape needs " +
               std::to_string(blocks) + (state.nested ? " uint8 codes" : " fp32 scales"));
  if (quant_map.numel() != 16) throw fail(".quant_map must have 16 values");
  if (state.nested && (nested_quant_map.numel() != 256 ||
                       nested_absmax.numel() != (blocks + 255) / quant::Quantized4bit::kNestedBlocksize))
    throw fail(".nested_absmax / .nested_quant_map do not fit " + std::to_string(blocks) + " blocks");
  state.absmax = absmax;
  state.quant_map = quant_map.to(at::kFloat);
  if (state.nested) {
    state.nested_absmax = nested_absmax.to(at::kFloat);
    state.nested_quant_map = nested_quant_map.to(at::kFloat);
  }
  state.state_json = state_json;
  return state;
}

std::vector<std::string> quantizable_layers(LanguageModel& model) {
  std::vector<std::string> out;
  const bool t5 = model.model_type() == "t5";
  model.for_each_module([&](const std::string& name, Module& m) {
    if (dynamic_cast<Linear*>(&m) == nullptr) return;
    if (t5 && (name == "wo" || name.ends_with(".wo"))) return;  // T5's _keep_in_fp32_modules
    out.push_back(name);
  });
  return out;
}

nlohmann::json bnb_quantization_config(const Quantize4bitOptions& options, at::ScalarType compute_dtype,
                                       const std::vector<std::string>& skipped_modules) {
  const std::string compute = compute_dtype == at::kBFloat16 ? "bfloat16"
                              : compute_dtype == at::kHalf   ? "float16"
                                                             : "float32";
  return {{"quant_method", "bitsandbytes"},
          {"load_in_4bit", true},
          {"load_in_8bit", false},
          {"bnb_4bit_quant_type", quant::quant_type_name(options.type)},
          {"bnb_4bit_use_double_quant", options.double_quant},
          {"bnb_4bit_compute_dtype", compute},
          {"bnb_4bit_quant_storage", "uint8"},
          {"llm_int8_skip_modules", skipped_modules},
          {"llm_int8_threshold", 6.0},
          {"llm_int8_has_fp16_weight", false},
          {"llm_int8_enable_fp32_cpu_offload", false}};
}

bool has_quantized_layers(LanguageModel& model) {
  bool any = false;
  model.for_each_module([&](const std::string&, Module& m) {
    if (auto* linear = dynamic_cast<Linear*>(&m); linear != nullptr && linear->quantized() != nullptr) any = true;
  });
  return any;
}

void dequantize_model(LanguageModel& model, at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  model.for_each_module([&](const std::string&, Module& m) {
    auto* linear = dynamic_cast<Linear*>(&m);
    if (linear == nullptr || linear->quantized() == nullptr) return;
    linear->set_weight(dequantize_weight(linear->weight, *linear->quantized(), dtype));
  });
}

}  // namespace trainer
