// Writes bitsandbytes' packed QuantState layout (functional.py QuantState.as_dict(packed=True), 0.50.2).
#include "quant/bnb_layout.h"

#include <charconv>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace trainer::quant {

namespace {

template <typename T>
SavedTensor make_tensor(const std::string& dtype, std::vector<int64_t> shape, const std::vector<T>& values) {
  SavedTensor tensor{dtype, std::move(shape), std::vector<uint8_t>(values.size() * sizeof(T))};
  if (!values.empty()) std::memcpy(tensor.bytes.data(), values.data(), tensor.bytes.size());
  return tensor;
}

}  // namespace

std::string python_float_repr(double value) {
  if (std::isnan(value)) return "NaN";  // json.dumps spells the non-finite values this way
  if (std::isinf(value)) return value > 0 ? "Infinity" : "-Infinity";
  // The shortest round-trip digits (what repr uses), then Python's choice between fixed and exponent form.
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value, std::chars_format::scientific);
  const std::string sci(buffer, result.ptr);
  const size_t e_pos = sci.find('e');
  std::string mantissa = sci.substr(0, e_pos);
  const int exponent = std::stoi(sci.substr(e_pos + 1));
  const bool negative = mantissa[0] == '-';
  if (negative) mantissa.erase(0, 1);
  std::string digits;
  for (char c : mantissa) {
    if (c != '.') digits += c;
  }
  const int decimal_point = exponent + 1;  // digits d1 d2 ... with the point after decimal_point of them
  // Built with append(), not operator+: GCC 12 reports a false -Wrestrict on string concatenation at -O3.
  std::string out;
  if (negative) out.push_back('-');
  if (decimal_point > -4 && decimal_point <= 16) {
    if (decimal_point <= 0) {
      out.append("0.");
      out.append(static_cast<size_t>(-decimal_point), '0');
      out.append(digits);
    } else if (static_cast<size_t>(decimal_point) >= digits.size()) {
      out.append(digits);
      out.append(static_cast<size_t>(decimal_point) - digits.size(), '0');
      out.append(".0");
    } else {
      out.append(digits, 0, static_cast<size_t>(decimal_point));
      out.push_back('.');
      out.append(digits, static_cast<size_t>(decimal_point));
    }
    return out;
  }
  out.push_back(digits[0]);
  if (digits.size() > 1) {
    out.push_back('.');
    out.append(digits, 1);
  }
  const int shown = decimal_point - 1;
  out.append(shown < 0 ? "e-" : "e+");
  const std::string exp_digits = std::to_string(std::abs(shown));
  if (exp_digits.size() < 2) out.push_back('0');
  out.append(exp_digits);
  return out;
}

std::string bnb_quant_state_json(const Quantized4bit& q, FloatDtype dtype, std::span<const int64_t> shape) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  if (numel != q.numel) {
    throw std::invalid_argument("bitsandbytes layout: shape holds " + std::to_string(numel) +
                                " elements but the quantized weight has " + std::to_string(q.numel));
  }
  // json.dumps' default separators: ", " and ": ".
  std::string json = "{\"quant_type\": \"" + quant_type_name(q.type) +
                     "\", \"blocksize\": " + std::to_string(q.blocksize) + ", \"dtype\": \"" +
                     float_dtype_name(dtype) + "\", \"shape\": [";
  for (size_t i = 0; i < shape.size(); ++i) json += (i ? ", " : "") + std::to_string(shape[i]);
  json += "]";
  if (q.nested) {
    json += ", \"nested_blocksize\": " + std::to_string(Quantized4bit::kNestedBlocksize) +
            ", \"nested_dtype\": \"float32\", \"nested_offset\": " +
            python_float_repr(static_cast<double>(q.nested_offset));
  }
  return json + "}";
}

std::map<std::string, SavedTensor> bnb_saved_tensors(const Quantized4bit& q, FloatDtype dtype,
                                                     std::span<const int64_t> shape) {
  std::map<std::string, SavedTensor> tensors;
  const std::string json = bnb_quant_state_json(q, dtype, shape);
  tensors["weight"] = make_tensor("U8", {static_cast<int64_t>(q.packed.size()), 1}, q.packed);
  const auto& code = four_bit_code(q.type);
  tensors["quant_map"] = make_tensor("F32", {16}, std::vector<float>(code.begin(), code.end()));
  if (q.nested) {
    tensors["absmax"] = make_tensor("U8", {static_cast<int64_t>(q.nested_codes.size())}, q.nested_codes);
    tensors["nested_absmax"] =
        make_tensor("F32", {static_cast<int64_t>(q.nested_absmax.size())}, q.nested_absmax);
    tensors["nested_quant_map"] = make_tensor("F32", {256}, create_dynamic_map(true));
  } else {
    tensors["absmax"] = make_tensor("F32", {static_cast<int64_t>(q.absmax.size())}, q.absmax);
  }
  tensors["quant_state.bitsandbytes__" + quant_type_name(q.type)] =
      make_tensor("U8", {static_cast<int64_t>(json.size())}, std::vector<uint8_t>(json.begin(), json.end()));
  return tensors;
}

}  // namespace trainer::quant
