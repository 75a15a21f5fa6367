// 4-bit linear layers (see linear4bit.h). The formulas follow bitsandbytes 0.50.2: quantize_4bit (in src/quant),
// the default gemm_4bit path (dequantize to the input's dtype, then an ordinary linear) and MatMul4Bit's backward
// (grad_x = grad_y @ dequantize(W), nothing else kept).
#include "models/linear4bit.h"

#include <dlfcn.h>

#include <array>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <mutex>

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/custom_function.h>

#include "models/layers.h"
#include "models/model.h"
#include "quant/bnb_layout.h"
#include "trainer/errors.h"
#include "util/counter_rng.h"
#include "util/cuda_device.h"

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

// The packed weight and its state travel through the autograd context as one capsule, with the dequantized weight
// when the layer keeps it resident (then backward uses it instead of dequantizing again).
struct Weight4bitHolder : torch::CustomClassHolder {
  Weight4bitHolder(at::Tensor p, const QuantState4bit& s, at::Tensor b, at::Tensor w)
      : packed(std::move(p)), state(s), bias(std::move(b)), weight(std::move(w)) {}
  at::Tensor packed;
  QuantState4bit state;
  at::Tensor bias;    // frozen (no gradient), or undefined
  at::Tensor weight;  // the kept dequantized weight (out, in), or undefined
};

struct Linear4bitFunction : public torch::autograd::Function<Linear4bitFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::intrusive_ptr<Weight4bitHolder> holder) {
    const at::Tensor w = holder->weight.defined() ? holder->weight
                                                  : dequantize_weight(holder->packed, holder->state, x.scalar_type());
    ctx->saved_data["weight"] = at::IValue::make_capsule(holder);
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    return holder->bias.defined() ? at::linear(x, w, holder->bias.to(x.scalar_type())) : at::linear(x, w);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto holder = c10::static_intrusive_pointer_cast<Weight4bitHolder>(ctx->saved_data["weight"].toCapsule());
    const at::Tensor& grad = grad_outputs[0];
    if (!grad.defined()) return {at::Tensor(), at::Tensor()};
    const bool kept = holder->weight.defined() && holder->weight.scalar_type() == grad.scalar_type();
    const at::Tensor w = kept ? holder->weight : dequantize_weight(holder->packed, holder->state, grad.scalar_type());
    const auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    return {at::matmul(grad, w).to(x_dtype), at::Tensor()};  // w (out, in)
  }
};

// The layer's resident dequantized weight in `dtype`: `kept` when it holds that dtype on the packed weight's device,
// else dequantized now and stored in `kept` (a model moved to another device, or another compute dtype, replaces it).
at::Tensor kept_weight(at::Tensor& kept, const at::Tensor& packed, const QuantState4bit& state, at::ScalarType dtype) {
  if (!kept.defined() || kept.scalar_type() != dtype || kept.device() != packed.device()) {
    kept = at::Tensor();  // the stale copy goes before the new one is made
    kept = dequantize_weight(packed, state, dtype);
  }
  return kept;
}

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

// ---- bitsandbytes' shared library ------------------------------------------------------------------------------
// Its C functions (no header ships: the prototypes are declared here, as csrc/pythonInterface.cpp defines them in
// 0.45-0.50, and every symbol is looked up and checked when the library is loaded).
namespace {

namespace fs = std::filesystem;

constexpr const char* kLibraryVariable = "TRAINER_BITSANDBYTES";
constexpr const char* kPinnedVersion = "bitsandbytes==0.50.2";

// CPU (libbitsandbytes_cpu): packed (rows, cols / 2) bytes, fp32 block scales, out (rows, cols); cols even.
using CpuDequantize4bit = void (*)(unsigned char* packed, float* absmax, void* out, long long blocksize,
                                   long long rows, long long cols);
// CUDA (libbitsandbytes_cudaXY): code (NULL: the built-in table), packed, fp32 block scales, out, n elements, the
// stream to launch on.
using CudaDequantize4bit = void (*)(float* code, unsigned char* packed, float* absmax, void* out, int blocksize,
                                    int n, void* stream);
using HasAvx512 = bool (*)();

constexpr int kBlockSizes = 8;  // 32, 64, ..., 4096: the block sizes the format allows

// log2(blocksize) - 5 for a block size the format allows (quant::check_4bit_blocksize).
int block_index(int64_t blocksize) { return std::countr_zero(static_cast<uint64_t>(blocksize)) - 5; }

// The start-up check's verdict on one kind of call (type, dtype, block size), for weights whose rows are not whole
// blocks [0] and whose rows are [1].
struct CallVerdict {
  bool checked = false;
  std::array<bool, 2> trusted{};
  std::array<int, 2> failed{};  // how many of the check's shapes decoded to other values
  std::array<int, 2> shapes{};  // how many shapes were checked
  std::array<std::string, 2> first_failure;
};

struct BitsandbytesLibrary {
  std::string path;                                  // empty: not used (ATen ops)
  std::string reason;                                // why not, for the log
  std::array<std::array<void*, 3>, 2> dequantize{};  // [nf4, fp4][fp32, bf16, fp16]
  bool avx512 = false;                               // CPU: blocks of 2048+ go to ATen, as bitsandbytes does
  c10::DeviceType device = c10::DeviceType::CPU;
  // [nf4, fp4][fp32, bf16, fp16][block 32..4096], filled by the check on the first call of each kind.
  std::mutex verdicts_mutex;
  std::array<std::array<std::array<CallVerdict, kBlockSizes>, 3>, 2> verdicts;
};

const char* dtype_suffix(int dtype) { return dtype == 0 ? "fp32" : dtype == 1 ? "bf16" : "fp16"; }
int dtype_index(at::ScalarType type) {
  return type == at::kFloat ? 0 : type == at::kBFloat16 ? 1 : type == at::kHalf ? 2 : -1;
}

// The library's file name for a device: libbitsandbytes_cpu.so, or libbitsandbytes_cudaXY.so for the CUDA runtime
// this LibTorch was built with (13.0 -> cuda130), as bitsandbytes itself picks it.
std::string library_file(c10::DeviceType device) {
  if (device != c10::DeviceType::CUDA) return "libbitsandbytes_cpu.so";
  const long version = at::detail::getCUDAHooks().versionCUDART();
  return "libbitsandbytes_cuda" + std::to_string(version / 1000) + std::to_string(version % 1000 / 10) + ".so";
}

// Where the library is looked for: $TRAINER_BITSANDBYTES (a file, or the folder holding it), else the bitsandbytes
// package beside the torch package trainer's LibTorch comes from (site-packages/torch/lib/libc10.so ->
// site-packages/bitsandbytes/).
fs::path library_path(c10::DeviceType device, const char* variable) {
  if (variable != nullptr) {
    const fs::path p(variable);
    return fs::is_directory(p) ? p / library_file(device) : p;
  }
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&c10::GetCPUAllocator), &info) == 0 || info.dli_fname == nullptr) return {};
  return fs::path(info.dli_fname).parent_path().parent_path().parent_path() / "bitsandbytes" / library_file(device);
}

// One call of the library's 4-bit dequantization: `bytes` holds the packed codes of out's rows * cols elements,
// `absmax` one fp32 scale a block, all on one device (the CPU, or CUDA with numel < 2^31).
void call_dequantize(const BitsandbytesLibrary& lib, int type, int dtype, const at::Tensor& bytes,
                     const at::Tensor& absmax, at::Tensor& out, int64_t blocksize) {
  void* function = lib.dequantize[static_cast<size_t>(type)][static_cast<size_t>(dtype)];
  if (out.device().is_cpu()) {
    reinterpret_cast<CpuDequantize4bit>(function)(bytes.data_ptr<uint8_t>(), absmax.data_ptr<float>(),
                                                  out.data_ptr(), blocksize, out.size(0), out.size(1));
    return;
  }
  const c10::DeviceGuard guard(out.device());
  reinterpret_cast<CudaDequantize4bit>(function)(nullptr, bytes.data_ptr<uint8_t>(), absmax.data_ptr<float>(),
                                                 out.data_ptr(), static_cast<int>(blocksize),
                                                 static_cast<int>(out.numel()), current_cuda_stream(out.device()));
}

// The start-up check. bitsandbytes 0.50's CPU library has an AVX-512 loop that reads a row's scales as if every
// row started a block: on a CPU with AVX-512, weights whose rows are not whole blocks decode to wrong values
// (docs/quantization.md). A library cannot be trusted by its version alone, so each function trainer calls decodes
// a few small weights of every block size, and its output is compared with the format's definition (src/quant:
// code table x block scale, rounded once). Rows of whole blocks and rows that are not are judged apart: real
// models' widths are mostly whole blocks, and there the library is both right and fast.
struct CheckShape {
  int64_t rows, cols;
  bool whole_blocks;
};

// Shapes for one block size: two of whole-block rows; three of rows that are not (narrower than a block, a width
// the vector loop takes (a multiple of 16) and one it does not, a block and a half), tall enough to cross several
// blocks, the last block partial where the shape allows.
std::vector<CheckShape> check_shapes(int64_t blocksize) {
  const int64_t span = 2 * blocksize;
  return {{3, blocksize, true},
          {2, 2 * blocksize, true},
          {span / 48 + 3, 48, false},
          {span / 40 + 3, 40, false},
          {3, blocksize + blocksize / 2, false}};
}

// Small weights with zeros among them, the same on every machine (util's counter-based bits).
std::vector<float> check_values(int64_t n, uint64_t seed) {
  std::vector<float> values(static_cast<size_t>(n));
  for (size_t i = 0; i < values.size(); ++i) {
    const uint32_t bits = counter_bits(seed, i);
    values[i] = bits % 7 == 0 ? 0.0f : (static_cast<float>(bits >> 8) / static_cast<float>(1 << 24) - 0.5f) * 0.1f;
  }
  return values;
}

// The format's values of `q` in `dtype`, as an fp32 tensor (rows, cols).
at::Tensor definition_values(const quant::Quantized4bit& q, int dtype, int64_t rows, int64_t cols) {
  const auto float_dtype = dtype == 0 ? quant::FloatDtype::kFp32 : dtype == 1 ? quant::FloatDtype::kBf16
                                                                              : quant::FloatDtype::kFp16;
  const at::ScalarType type = dtype == 0 ? at::kFloat : dtype == 1 ? at::kBFloat16 : at::kHalf;
  at::Tensor out = at::empty({rows, cols}, at::TensorOptions().dtype(type));
  quant::dequantize_4bit(q, float_dtype, out.data_ptr());
  return out.to(at::kFloat);
}

// The name of the library's function for a kind of call.
std::string function_name(c10::DeviceType device, int type, int dtype) {
  const std::string quant_type = type == 0 ? "nf4" : "fp4";
  return device == c10::DeviceType::CUDA ? "cdequantize_blockwise_" + std::string(dtype_suffix(dtype)) + "_" + quant_type
                                         : "cdequantize_blockwise_cpu_" + quant_type + "_" + dtype_suffix(dtype);
}

// Checks one kind of call on the library's device: a few milliseconds (five calls), once per kind.
CallVerdict check_call(const BitsandbytesLibrary& lib, int type, int dtype, int block) {
  at::NoGradGuard no_grad;
  const at::Device where(lib.device);
  const int64_t blocksize = int64_t{32} << block;
  const at::ScalarType out_type = dtype == 0 ? at::kFloat : dtype == 1 ? at::kBFloat16 : at::kHalf;
  CallVerdict verdict;
  verdict.checked = true;
  verdict.trusted = {true, true};
  for (const CheckShape& shape : check_shapes(blocksize)) {
    const int64_t n = shape.rows * shape.cols;
    const std::vector<float> values = check_values(n, static_cast<uint64_t>(n * 31 + blocksize));
    const auto q = quant::quantize_4bit(values.data(), n, quant::FloatDtype::kFp32, blocksize,
                                        type == 0 ? quant::QuantType::kNf4 : quant::QuantType::kFp4, false);
    const at::Tensor bytes =
        at::from_blob(const_cast<uint8_t*>(q.packed.data()), {static_cast<int64_t>(q.packed.size())}, at::kByte)
            .to(where);
    const at::Tensor absmax =
        at::from_blob(const_cast<float*>(q.absmax.data()), {static_cast<int64_t>(q.absmax.size())}, at::kFloat)
            .to(where);
    at::Tensor out = at::empty({shape.rows, shape.cols}, at::TensorOptions().dtype(out_type).device(where));
    call_dequantize(lib, type, dtype, bytes, absmax, out, blocksize);
    const at::Tensor theirs = out.to(at::kCPU).to(at::kFloat);
    const at::Tensor ours = definition_values(q, dtype, shape.rows, shape.cols);
    const size_t whole = shape.whole_blocks ? 1 : 0;
    ++verdict.shapes[whole];
    // Values, not bits: FP4's nibble 8 is -0.0 in some of the library's loops and +0.0 in the definition.
    const int64_t wrong = theirs.ne(ours).sum().item<int64_t>();
    if (wrong == 0) continue;
    verdict.trusted[whole] = false;
    ++verdict.failed[whole];
    if (verdict.first_failure[whole].empty())
      verdict.first_failure[whole] = function_name(lib.device, type, dtype) + " decoded a " +
                                     std::to_string(shape.rows) + "x" + std::to_string(shape.cols) +
                                     " weight in blocks of " + std::to_string(blocksize) + " with " +
                                     std::to_string(wrong) + " of " + std::to_string(n) + " values off, by up to " +
                                     std::to_string((theirs - ours).abs().max().item<float>());
  }
  return verdict;
}

// The verdict on a kind of call, checked on its first use.
const CallVerdict& call_verdict(BitsandbytesLibrary& lib, int type, int dtype, int block) {
  std::lock_guard<std::mutex> lock(lib.verdicts_mutex);
  CallVerdict& verdict =
      lib.verdicts[static_cast<size_t>(type)][static_cast<size_t>(dtype)][static_cast<size_t>(block)];
  if (!verdict.checked) verdict = check_call(lib, type, dtype, block);
  return verdict;
}

// What the checks so far found wrong, for the log: empty when nothing.
std::string distrust(BitsandbytesLibrary& lib) {
  std::lock_guard<std::mutex> lock(lib.verdicts_mutex);
  std::array<int, 2> failed{}, shapes{};
  std::array<std::string, 2> first;
  for (const auto& by_type : lib.verdicts)
    for (const auto& by_dtype : by_type)
      for (const CallVerdict& v : by_dtype)
        for (size_t whole = 0; whole < 2; ++whole) {
          failed[whole] += v.failed[whole];
          shapes[whole] += v.shapes[whole];
          if (first[whole].empty()) first[whole] = v.first_failure[whole];
        }
  const char* const kinds[2] = {"rows that are not whole blocks", "rows of whole blocks"};
  std::string out;
  for (size_t whole = 0; whole < 2; ++whole) {
    if (failed[whole] == 0) continue;
    if (!out.empty()) out += "; ";
    out += "ATen ops for weights with " + std::string(kinds[whole]) + " (the library's start-up check: " +
           first[whole] + "; " + std::to_string(failed[whole]) + " of " + std::to_string(shapes[whole]) +
           " such checks failed)";
  }
  return out;
}

void load_library(BitsandbytesLibrary& lib, c10::DeviceType device) {
  lib.device = device;
  const char* variable = std::getenv(kLibraryVariable);
  if (variable != nullptr && *variable == '\0') variable = nullptr;
  if (variable != nullptr && std::string(variable) == "none") {
    lib.reason = std::string(kLibraryVariable) + "=none";
    return;
  }
  const bool from_variable = variable != nullptr;
  const fs::path path = library_path(device, variable);
  const std::string how = from_variable ? std::string(" (") + kLibraryVariable + ")" : " (beside torch)";
  const std::string fix = std::string("install ") + kPinnedVersion + " into the Python environment trainer's torch "
                          "comes from, or set " + kLibraryVariable + " to the library file or its folder";
  if (path.empty() || !fs::exists(path)) {
    if (from_variable)
      throw UsageError(std::string(kLibraryVariable) + "=" + variable + ": no bitsandbytes library " +
                           path.string(), fix + ", or " + kLibraryVariable + "=none for ATen ops");
    if (device == c10::DeviceType::CUDA)
      throw UsageError("model.quantize on CUDA needs bitsandbytes' library " + library_file(device) +
                           ", not found" + (path.empty() ? std::string() : " at " + path.string()),
                       fix + "; or " + kLibraryVariable + "=none to dequantize with ATen ops (slower, more memory)");
    lib.reason = "no " + library_file(device) + " beside torch";
    return;
  }
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* error = dlerror();
    throw UsageError("bitsandbytes' library " + path.string() + how + " does not load: " +
                         (error != nullptr ? error : "unknown error"), fix);
  }
  const auto symbol = [&](const std::string& name) {
    void* address = dlsym(handle, name.c_str());
    if (address == nullptr)
      throw UsageError("bitsandbytes' library " + path.string() + how + " has no function " + name +
                           " (the pinned release " + kPinnedVersion + " has it)", fix);
    return address;
  };
  for (int type = 0; type < 2; ++type)
    for (int dtype = 0; dtype < 3; ++dtype) lib.dequantize[type][dtype] = symbol(function_name(device, type, dtype));
  if (device != c10::DeviceType::CUDA) lib.avx512 = reinterpret_cast<HasAvx512>(symbol("has_avx512f_cpu"))();
  lib.path = path.string();
}

// One library per device type, loaded on first use.
BitsandbytesLibrary& library(c10::DeviceType device) {
  static std::mutex mutex;
  static std::map<c10::DeviceType, std::unique_ptr<BitsandbytesLibrary>> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = loaded.find(device);
  if (it == loaded.end()) {
    auto lib = std::make_unique<BitsandbytesLibrary>();
    load_library(*lib, device);
    it = loaded.emplace(device, std::move(lib)).first;
  }
  return *it->second;
}

// The weight through bitsandbytes' kernel, or an undefined tensor where it does not apply (no library, a device
// other than the CPU or CUDA, an odd last dimension or big blocks on an AVX-512 CPU as bitsandbytes' own
// fallback, more than 2^31 - 1 elements for the CUDA kernel's int, a kind of call the start-up check found wrong).
at::Tensor dequantize_with_library(const at::Tensor& packed, const QuantState4bit& state, const at::Tensor& scales,
                                   at::ScalarType dtype) {
  const auto device = packed.device();
  if (!device.is_cpu() && !device.is_cuda()) return {};
  const int d = dtype_index(dtype);
  if (d < 0) return {};
  BitsandbytesLibrary& lib = library(device.type());
  if (lib.path.empty()) return {};
  if (device.is_cpu() && (state.in_features % 2 != 0 || (lib.avx512 && state.blocksize >= 2048))) return {};
  if (device.is_cuda() && state.numel() > std::numeric_limits<int>::max()) return {};
  const int type = state.type == quant::QuantType::kNf4 ? 0 : 1;
  const bool whole_blocks = state.in_features % state.blocksize == 0;
  if (!call_verdict(lib, type, d, block_index(state.blocksize)).trusted[whole_blocks ? 1 : 0]) return {};
  at::Tensor out = at::empty({state.out_features, state.in_features}, packed.options().dtype(dtype));
  call_dequantize(lib, type, d, packed.contiguous(), scales.to(at::kFloat).contiguous(), out, state.blocksize);
  return out;
}

}  // namespace

std::string four_bit_kernels(c10::DeviceType device) {
  BitsandbytesLibrary& lib = library(device);
  if (!lib.path.empty()) {
    const std::string found = distrust(lib);
    return "bitsandbytes' kernels from " + lib.path + (found.empty() ? "" : "; " + found);
  }
  return "ATen ops (" + lib.reason + ")";
}

std::string four_bit_kernels(LanguageModel& model, c10::DeviceType device, at::ScalarType dtype) {
  BitsandbytesLibrary& lib = library(device);
  const int d = dtype_index(dtype);
  if (!lib.path.empty() && d >= 0) {
    model.for_each_module([&](const std::string&, Module& m) {
      auto* linear = dynamic_cast<Linear*>(&m);
      if (linear == nullptr || linear->quantized() == nullptr) return;
      const QuantState4bit& state = *linear->quantized();
      call_verdict(lib, state.type == quant::QuantType::kNf4 ? 0 : 1, d, block_index(state.blocksize));
    });
  }
  return four_bit_kernels(device);
}

namespace {

// One fp32 scale per block, on the packed codes' device.
at::Tensor block_scales(const QuantState4bit& state) {
  if (!state.nested) return state.absmax;
  const int64_t blocks = (state.numel() + state.blocksize - 1) / state.blocksize;
  const at::Tensor nested = at::repeat_interleave(state.nested_absmax, quant::Quantized4bit::kNestedBlocksize)
                                .narrow(0, 0, blocks);
  return state.nested_quant_map.index_select(0, state.absmax.to(at::kInt)) * nested +
         at::scalar_tensor(state.nested_offset, at::TensorOptions().dtype(at::kFloat).device(state.absmax.device()));
}

at::Tensor dequantize_with_aten(const at::Tensor& packed, const QuantState4bit& state, const at::Tensor& scales,
                                at::ScalarType dtype) {
  const auto int_options = at::TensorOptions().dtype(at::kInt).device(packed.device());
  const int64_t n = state.numel();
  const int64_t blocks = (n + state.blocksize - 1) / state.blocksize;
  // A byte decodes to two values (element 2j in the high nibble), from the state's own code table (FP4's nibble 8
  // is +0.0 there: the definition's sign of zero, src/quant/blockwise.h).
  const at::Tensor code = state.quant_map.to(at::kFloat);
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

}  // namespace

at::Tensor dequantize_weight(const at::Tensor& packed, const QuantState4bit& state, at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  const at::Tensor scales = block_scales(state);
  if (at::Tensor w = dequantize_with_library(packed, state, scales, dtype); w.defined()) return w;
  return dequantize_with_aten(packed, state, scales, dtype);
}

at::Tensor dequantize_weight_aten(const at::Tensor& packed, const QuantState4bit& state, at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  return dequantize_with_aten(packed, state, block_scales(state), dtype);
}

at::Tensor linear4bit(const at::Tensor& x, const at::Tensor& packed, const QuantState4bit& state,
                      const at::Tensor& bias, at::Tensor* kept) {
  // A bias that trains is added outside, so autograd gives its gradient; a frozen one goes in the linear, as
  // bitsandbytes computes it.
  const bool bias_trains = bias.defined() && bias.requires_grad();
  const at::Tensor inner_bias = bias.defined() && !bias_trains ? bias : at::Tensor();
  const at::Tensor resident = kept != nullptr ? kept_weight(*kept, packed, state, x.scalar_type()) : at::Tensor();
  at::Tensor y;
  if (at::GradMode::is_enabled() && x.requires_grad()) {
    y = Linear4bitFunction::apply(x, c10::make_intrusive<Weight4bitHolder>(packed, state, inner_bias, resident));
  } else {
    const at::Tensor w = resident.defined() ? resident : dequantize_weight(packed, state, x.scalar_type());
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

std::vector<std::string> quantizable_layers(LanguageModel& model, bool experts) {
  std::vector<std::string> out;
  const bool t5 = model.model_type() == "t5";
  model.for_each_module([&](const std::string& name, Module& m) {
    if (dynamic_cast<Linear*>(&m) == nullptr) return;
    if (t5 && (name == "wo" || name.ends_with(".wo"))) return;  // T5's _keep_in_fp32_modules
    // A mixture of experts' router stays in full precision (transformers' is a parameter, not a linear layer).
    if (name.ends_with(".mlp.gate") || name.ends_with(".block_sparse_moe.gate")) return;
    if (!experts && name.find(".experts.") != std::string::npos) return;
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

int64_t keep_dequantized_weights(LanguageModel& model, bool keep) {
  int64_t layers = 0;
  model.for_each_module([&](const std::string&, Module& m) {
    auto* linear = dynamic_cast<Linear*>(&m);
    if (linear == nullptr || linear->quantized() == nullptr) return;
    linear->keep_dequantized(keep);
    ++layers;
  });
  return layers;
}

int64_t dequantized_weight_bytes(LanguageModel& model, at::ScalarType dtype) {
  int64_t bytes = 0;
  model.for_each_module([&](const std::string&, Module& m) {
    auto* linear = dynamic_cast<Linear*>(&m);
    if (linear != nullptr && linear->quantized() != nullptr)
      bytes += linear->quantized()->numel() * static_cast<int64_t>(c10::elementSize(dtype));
  });
  return bytes;
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
