#!/usr/bin/env python3
"""Writes the small tokenizers the tokenizer parity test (tests/parity/test_tokenizers.py) runs ours against,
each trained here on a varied corpus (English, code, CJK, emoji with ZWJ sequences, combining marks in NFC and
NFD, whitespace runs, digits, contractions in every case) with the Python libraries themselves:

  gpt2-bytelevel/        tokenizers BPE, ByteLevel(use_regex=True) pre-tokenizer, merges as "a b" strings,
                         special tokens plus added tokens with single_word / lstrip / rstrip / normalized
  gpt2-prefix-nfkc/      ByteLevel(add_prefix_space=True) after an NFKC normalizer
  qwen2-style/           Qwen2's pipeline (NFC, Split(Qwen2 regex) + ByteLevel(use_regex=False)), saved by
                         transformers' Qwen2Tokenizer: tokenizer.json + tokenizer_config.json as on the Hub
  llama3-style/          Llama-3's split regex, ignore_merges, TemplateProcessing with <|begin_of_text|>
  clip-style/            CLIP's pipeline (NFC, Replace(\s+ -> " "), Lowercase; Split(CLIP regex, removed, inverted)
                         + ByteLevel; BPE with end_of_word_suffix "</w>"; RobertaProcessing), saved by
                         transformers' CLIPTokenizer
  spm-unigram/spiece.model     sentencepiece unigram with T5's ids (pad 0, eos 1, unk 2)
  spm-bpe/tokenizer.model      sentencepiece BPE with Llama's ids (unk 0, bos 1, eos 2), byte fallback,
                               a user-defined symbol

    .venv/bin/python tests/assets/tokenizers/make_tokenizers.py   # rewrites them; deterministic
"""
import json
import os
import random
import shutil
import tempfile

import sentencepiece as spm
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

HERE = os.path.dirname(os.path.abspath(__file__))

QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

CLIP_PATTERN = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""

FRAGMENTS = [
    "The quick brown fox jumps over the lazy dog.", "Whisk the eggs until smooth, then fold in the flour.",
    "I'm sure it's fine; they'll say we've done what I'd do.", "DON'T SHOUT! It's NOT what YOU'RE thinking.",
    "def tokenize(text: str) -> list[int]:\n    return [ord(c) for c in text]  # 42\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n", "if x != y && z >= 10 { println!(\"{}\", x); }",
    "東京は日本の首都です。", "我喜欢吃饺子和面条。", "한국어 문장도 있습니다.", "Привет, как дела? Всё хорошо.",
    "مرحبا بالعالم", "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️‍🔥 🇩🇪", "café naïve résumé Ångström", "cafe\u0301 nai\u0308ve re\u0301sume\u0301",
    "Prices: $3.50, €12,000.99, 1234567890 and 3.14159.", "Tabs\tand\t\tmore\ttabs", "line one\nline two\r\nline three\n\n",
    "many     spaces   here", "    indented code", "ﬁne ﬂour, ｆｕｌｌ ｗｉｄｔｈ, ² ½ Ⅻ", "e-mail: someone@example.com, url: https://x.y/z?q=1",
    "She said: \"Hello!\" — and left… ’twas 'quoted' text.", "WE'LL, We'Ll, we'LL, THEY'D, It'S", "x = [1, 2, 3]; y = {'a': 1}",
]


def corpus(n=3000, seed=0):
    rng = random.Random(seed)
    for _ in range(n):
        yield " ".join(rng.sample(FRAGMENTS, rng.randint(1, 4)))


def train_bpe(pre_tokenizer, normalizer=None, vocab_size=1200, special=()):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    return tokenizer


def rewrite_json(path, change):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    change(data)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=1)


def write_config(out, **config):
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def fresh(name):
    out = os.path.join(HERE, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    return out


def gpt2_bytelevel():
    out = fresh("gpt2-bytelevel")
    tokenizer = train_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                          special=["<|endoftext|>", "<|pad|>"])
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_tokens([AddedToken("[MASK]", lstrip=True, rstrip=True, normalized=False),
                          AddedToken("foo", single_word=True), AddedToken("wörld"), AddedToken("new token")])
    tokenizer.add_special_tokens([AddedToken("<|user|>", special=True)])
    path = os.path.join(out, "tokenizer.json")
    tokenizer.save(path)
    # Older tokenizers wrote merges as "a b" strings; keep that spelling in this file (the others have pairs).
    rewrite_json(path, lambda d: d["model"].update(merges=[" ".join(m) for m in d["model"]["merges"]]))
    write_config(out, tokenizer_class="PreTrainedTokenizerFast", eos_token="<|endoftext|>", pad_token="<|pad|>")


def gpt2_prefix_nfkc():
    out = fresh("gpt2-prefix-nfkc")
    tokenizer = train_bpe(pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True), normalizers.NFKC(),
                          vocab_size=800, special=["</s>"])
    tokenizer.add_tokens([AddedToken("ﬁ", normalized=True), AddedToken("Ⅻ", normalized=False)])
    tokenizer.save(os.path.join(out, "tokenizer.json"))


def qwen2_style():
    from transformers import Qwen2Tokenizer
    out = fresh("qwen2-style")
    trained = train_bpe(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), normalizers.NFC())
    data = json.loads(trained.to_str())
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in data["model"]["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=data["model"]["vocab"], merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.save_pretrained(out)
    for name in os.listdir(out):
        if name not in ("tokenizer.json", "tokenizer_config.json"):
            os.remove(os.path.join(out, name))


def llama3_style():
    out = fresh("llama3-style")
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    tokenizer = train_bpe(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), special=special)
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", tokenizer.token_to_id("<|begin_of_text|>"))])])
    path = os.path.join(out, "tokenizer.json")
    tokenizer.save(path)
    rewrite_json(path, lambda d: d["model"].update(ignore_merges=True))
    write_config(out, tokenizer_class="PreTrainedTokenizerFast", bos_token="<|begin_of_text|>",
                 eos_token="<|end_of_text|>")


def clip_style():
    from transformers import CLIPTokenizer
    out = fresh("clip-style")
    special = ["<|startoftext|>", "<|endoftext|>"]
    tokenizer = Tokenizer(models.BPE(end_of_word_suffix="</w>", unk_token="<|endoftext|>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                                 normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(CLIP_PATTERN), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=special, show_progress=False,
                                  end_of_word_suffix="</w>", initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    data = json.loads(tokenizer.to_str())
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in data["model"]["merges"]]
    CLIPTokenizer(vocab=data["model"]["vocab"], merges=merges).save_pretrained(out)
    for name in os.listdir(out):
        if name not in ("tokenizer.json", "tokenizer_config.json"):
            os.remove(os.path.join(out, name))


def sentencepiece_models():
    with tempfile.TemporaryDirectory() as tmp:
        text = os.path.join(tmp, "corpus.txt")
        with open(text, "w", encoding="utf-8") as f:
            for line in corpus(1500):
                f.write(line.replace("\n", " ") + "\n")
        out = fresh("spm-unigram")
        spm.SentencePieceTrainer.train(input=text, model_prefix=os.path.join(out, "spiece"), vocab_size=500,
                                       model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                       character_coverage=0.995, num_threads=1, minloglevel=2,
                                       hard_vocab_limit=False)
        out = fresh("spm-bpe")
        spm.SentencePieceTrainer.train(input=text, model_prefix=os.path.join(out, "tokenizer"), vocab_size=600,
                                       model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True,
                                       user_defined_symbols=["<sep>"], character_coverage=0.995, num_threads=1,
                                       minloglevel=2, hard_vocab_limit=False)
    for name in ("spm-unigram/spiece.vocab", "spm-bpe/tokenizer.vocab"):
        os.remove(os.path.join(HERE, name))


def main():
    gpt2_bytelevel()
    gpt2_prefix_nfkc()
    qwen2_style()
    llama3_style()
    clip_style()
    sentencepiece_models()


if __name__ == "__main__":
    main()
