// The bytes each token id stands for, where a tokenizer's decode() is a plain join of fixed bytes per token (the
// byte-level BPE of tokenizer.json). Placing tokens on the bytes of a text (chat loss masks) reads this table
// instead of decoding token by token. A narrow header, so the Tokenizer interface (included nearly everywhere)
// stays as it is.
#pragma once

#include <string>
#include <vector>

#include "trainer/tokenizer.h"

namespace trainer::tokenizer_detail {

// For a byte-level BPE tokenizer: entry `id` holds the bytes decode({id}, skip_special=false) joins for that id
// before replacing invalid UTF-8 (empty for an id without a token). Nothing for other tokenizers (SentencePiece,
// ids only), whose decode() does more than join bytes.
const std::vector<std::string>* decoded_token_bytes(const Tokenizer& tokenizer);

}  // namespace trainer::tokenizer_detail
