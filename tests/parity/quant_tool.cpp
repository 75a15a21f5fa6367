// The quantization parity tests' helper (tests/parity/test_quantization.py): runs src/quant on raw binary
// files so pytest can compare the bytes with bitsandbytes itself. All files are raw little-endian arrays.
//
//   trainer_quant_tool quantize4 IN DTYPE NUMEL BLOCKSIZE nf4|fp4 DOUBLE(0|1) OUTDIR
//       IN holds NUMEL values of DTYPE (float32 | bfloat16 | float16); writes OUTDIR/packed (uint8),
//       absmax (float32, DOUBLE=0) or nested_codes (uint8), nested_absmax (float32), nested_offset (float32)
//   trainer_quant_tool dequantize4 DIR NUMEL BLOCKSIZE nf4|fp4 DOUBLE(0|1) DTYPE OUT
//       reads the files quantize4 writes from DIR and writes NUMEL values of DTYPE to OUT
//   trainer_quant_tool dynamic_map signed|unsigned OUT            the 256 float32 entries
//   trainer_quant_tool code4 nf4|fp4 OUT                           the 16 float32 entries (index = nibble)
//   trainer_quant_tool layout IN DTYPE BLOCKSIZE nf4|fp4 DOUBLE(0|1) SHAPE OUTDIR
//       quantize4 of IN (SHAPE: comma-separated dims) saved as bitsandbytes' QuantState.as_dict(packed=True):
//       OUTDIR/<key> raw bytes and OUTDIR/<key>.meta ("<safetensors dtype> d0,d1,...") for every tensor
//   trainer_quant_tool float_repr VALUE...                         Python's repr of each (as a double), a
//   line each
//   trainer_quant_tool quantize8 IN NUMEL BLOCKSIZE signed|unsigned OUTDIR   OUTDIR/codes, OUTDIR/absmax
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "quant/blockwise.h"
#include "quant/bnb_layout.h"

namespace {

namespace quant = trainer::quant;

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw std::runtime_error("cannot open " + path + "; hint: the test writes it before calling the tool");
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

template <typename T>
std::vector<T> read_array(const std::string& path, size_t count) {
  const std::vector<uint8_t> bytes = read_bytes(path);
  if (bytes.size() != count * sizeof(T)) {
    throw std::runtime_error(path + " has " + std::to_string(bytes.size()) + " bytes, expected " +
                             std::to_string(count * sizeof(T)));
  }
  std::vector<T> out(count);
  std::copy(bytes.begin(), bytes.end(), reinterpret_cast<uint8_t*>(out.data()));
  return out;
}

template <typename T>
void write_array(const std::string& path, const std::vector<T>& values) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(values.data()),
            static_cast<std::streamsize>(values.size() * sizeof(T)));
  if (!out) throw std::runtime_error("cannot write " + path);
}

size_t dtype_size(quant::FloatDtype dtype) {
  return dtype == quant::FloatDtype::kFp32 ? 4 : 2;
}

int64_t to_int(const std::string& text) {
  return std::stoll(text);
}

void quantize4(const std::vector<std::string>& args) {
  const quant::FloatDtype dtype = quant::parse_float_dtype(args[1]);
  const int64_t numel = to_int(args[2]);
  const std::vector<uint8_t> input =
      read_array<uint8_t>(args[0], static_cast<size_t>(numel) * dtype_size(dtype));
  const quant::Quantized4bit q = quant::quantize_4bit(input.data(), numel, dtype, to_int(args[3]),
                                                      quant::parse_quant_type(args[4]), args[5] == "1");
  const std::string dir = args[6];
  std::filesystem::create_directories(dir);
  write_array(dir + "/packed", q.packed);
  if (q.nested) {
    write_array(dir + "/nested_codes", q.nested_codes);
    write_array(dir + "/nested_absmax", q.nested_absmax);
    write_array(dir + "/nested_offset", std::vector<float>{q.nested_offset});
  } else {
    write_array(dir + "/absmax", q.absmax);
  }
}

void dequantize4(const std::vector<std::string>& args) {
  const std::string dir = args[0];
  quant::Quantized4bit q;
  q.numel = to_int(args[1]);
  q.blocksize = to_int(args[2]);
  q.type = quant::parse_quant_type(args[3]);
  q.nested = args[4] == "1";
  const quant::FloatDtype dtype = quant::parse_float_dtype(args[5]);
  const auto blocks = static_cast<size_t>((q.numel + q.blocksize - 1) / q.blocksize);
  q.packed = read_array<uint8_t>(dir + "/packed", static_cast<size_t>((q.numel + 1) / 2));
  if (q.nested) {
    q.nested_codes = read_array<uint8_t>(dir + "/nested_codes", blocks);
    q.nested_absmax = read_array<float>(dir + "/nested_absmax", (blocks + 255) / 256);
    q.nested_offset = read_array<float>(dir + "/nested_offset", 1)[0];
  } else {
    q.absmax = read_array<float>(dir + "/absmax", blocks);
  }
  std::vector<uint8_t> out(static_cast<size_t>(q.numel) * dtype_size(dtype));
  quant::dequantize_4bit(q, dtype, out.data());
  write_array(args[6], out);
}

void quantize8(const std::vector<std::string>& args) {
  const auto numel = static_cast<size_t>(to_int(args[1]));
  const std::vector<float> values = read_array<float>(args[0], numel);
  const quant::Blockwise8bit q =
      quant::quantize_blockwise_8bit(values, quant::create_dynamic_map(args[3] == "signed"), to_int(args[2]));
  std::filesystem::create_directories(args[4]);
  write_array(args[4] + "/codes", q.codes);
  write_array(args[4] + "/absmax", q.absmax);
}

void layout(const std::vector<std::string>& args) {
  const quant::FloatDtype dtype = quant::parse_float_dtype(args[1]);
  std::vector<int64_t> shape;
  int64_t numel = 1;
  for (size_t start = 0; start <= args[5].size();) {
    const size_t comma = std::min(args[5].find(',', start), args[5].size());
    shape.push_back(to_int(args[5].substr(start, comma - start)));
    numel *= shape.back();
    start = comma + 1;
  }
  const std::vector<uint8_t> input =
      read_array<uint8_t>(args[0], static_cast<size_t>(numel) * dtype_size(dtype));
  const quant::Quantized4bit q = quant::quantize_4bit(input.data(), numel, dtype, to_int(args[2]),
                                                      quant::parse_quant_type(args[3]), args[4] == "1");
  std::filesystem::create_directories(args[6]);
  for (const auto& [key, tensor] : quant::bnb_saved_tensors(q, dtype, shape)) {
    write_array(args[6] + "/" + key, tensor.bytes);
    std::ofstream meta(args[6] + "/" + key + ".meta");
    meta << tensor.dtype << " ";
    for (size_t i = 0; i < tensor.shape.size(); ++i) meta << (i ? "," : "") << tensor.shape[i];
  }
}

void run(const std::string& command, const std::vector<std::string>& args) {
  const auto need = [&](size_t count) {
    if (args.size() != count) {
      throw std::invalid_argument(command + " takes " + std::to_string(count) + " arguments, got " +
                                  std::to_string(args.size()) +
                                  "; hint: see the usage at the top of "
                                  "tests/parity/quant_tool.cpp");
    }
  };
  if (command == "quantize4") {
    need(7);
    quantize4(args);
  } else if (command == "dequantize4") {
    need(7);
    dequantize4(args);
  } else if (command == "dynamic_map") {
    need(2);
    write_array(args[1], quant::create_dynamic_map(args[0] == "signed"));
  } else if (command == "code4") {
    need(2);
    const auto& code = quant::four_bit_code(quant::parse_quant_type(args[0]));
    write_array(args[1], std::vector<float>(code.begin(), code.end()));
  } else if (command == "layout") {
    need(7);
    layout(args);
  } else if (command == "float_repr") {
    for (const std::string& value : args) std::cout << quant::python_float_repr(std::stod(value)) << "\n";
  } else if (command == "quantize8") {
    need(5);
    quantize8(args);
  } else {
    throw std::invalid_argument(
        "unknown command '" + command +
        "'; hint: quantize4, dequantize4, dynamic_map, code4, layout, float_repr or quantize8");
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: trainer_quant_tool COMMAND ARGS... (see tests/parity/quant_tool.cpp)\n";
    return 2;
  }
  try {
    run(argv[1], std::vector<std::string>(argv + 2, argv + argc));
  } catch (const std::exception& error) {
    std::cerr << "trainer_quant_tool " << argv[1] << ": " << error.what() << "\n";
    return 1;
  }
  return 0;
}
