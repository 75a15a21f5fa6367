// The decoder families: each turns its config.json into a DecoderSpec (decoder/spec.h), with its config class's
// defaults (transformers' configuration_*.py) for the keys a file leaves out. A new family is one such file and
// a line in spec.cpp's table.
#pragma once

#include <nlohmann/json.hpp>

#include "models/decoder/spec.h"

namespace trainer {

DecoderSpec llama_spec(const nlohmann::json& config);        // llama.cpp
DecoderSpec qwen2_spec(const nlohmann::json& config);        // llama.cpp
DecoderSpec mistral_spec(const nlohmann::json& config);      // llama.cpp
DecoderSpec qwen3_spec(const nlohmann::json& config);        // qwen3.cpp
DecoderSpec smollm3_spec(const nlohmann::json& config);      // smollm3.cpp
DecoderSpec olmo2_spec(const nlohmann::json& config);        // olmo2.cpp
DecoderSpec granite_spec(const nlohmann::json& config);      // granite.cpp
DecoderSpec gemma2_spec(const nlohmann::json& config);       // gemma.cpp
DecoderSpec gemma3_text_spec(const nlohmann::json& config);  // gemma.cpp
DecoderSpec gemma3_spec(const nlohmann::json& config);       // gemma.cpp: the multimodal checkpoint's text model
DecoderSpec gemma4_text_spec(const nlohmann::json& config);  // gemma4.cpp
DecoderSpec gemma4_spec(const nlohmann::json& config);       // gemma4.cpp: the multimodal checkpoint's text model
DecoderSpec phi3_spec(const nlohmann::json& config);         // phi3.cpp
DecoderSpec qwen3_moe_spec(const nlohmann::json& config);    // moe.cpp
DecoderSpec mixtral_spec(const nlohmann::json& config);      // moe.cpp
DecoderSpec qwen2_moe_spec(const nlohmann::json& config);    // moe.cpp
DecoderSpec olmoe_spec(const nlohmann::json& config);        // moe.cpp

}  // namespace trainer
