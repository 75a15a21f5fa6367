#!/usr/bin/env python3
"""Writes the tiny model directories the CPU configs use: config.json (made by transformers itself, so it is a
real Hugging Face config) and a tokenizer trained on the demo data (tiny-qwen2's with Qwen2.5's chat template).
No weights: the tiny configs initialise randomly (model.init = "random").

    scripts/make_tiny_models.py            # rewrites configs/models/tiny-t5, tiny-qwen2, tiny-qwen3, tiny-gemma3

Deterministic: the same data gives the same tokenizers.
"""
import argparse
import json
import os
import tempfile

import sentencepiece as spm
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import Gemma3TextConfig, Qwen2Config, Qwen2Tokenizer, Qwen3Config, T5Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def texts(path, fields):
    with open(path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            for field in fields:
                yield record[field]


def tiny_t5(out_dir, data):
    os.makedirs(out_dir, exist_ok=True)
    vocab = 256
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.txt")
        with open(corpus, "w", encoding="utf-8") as f:
            for text in texts(data, ["input", "target"]):
                f.write(text + "\n")
        # T5's special ids: pad 0, eos 1, unk 2, no bos.
        spm.SentencePieceTrainer.train(input=corpus, model_prefix=os.path.join(out_dir, "spiece"),
                                       vocab_size=vocab, model_type="unigram", pad_id=0, eos_id=1, unk_id=2,
                                       bos_id=-1, character_coverage=1.0, num_threads=1, minloglevel=2, shuffle_input_sentence=False,
                                       hard_vocab_limit=False)  # the corpus is small; config keeps 256
    os.remove(os.path.join(out_dir, "spiece.vocab"))
    # FLAN-T5 shape in miniature: gated-gelu, untied lm_head.
    T5Config(vocab_size=vocab, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
             relative_attention_num_buckets=8, relative_attention_max_distance=32, dropout_rate=0.1,
             feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
             pad_token_id=0, eos_token_id=1).save_pretrained(out_dir)


# Qwen2's pre-tokenizer split pattern (its tokenizer.json on the Hub); transformers' Qwen2Tokenizer rebuilds this
# pipeline whatever the file says, so the tiny model's tokenizer must have it for both to agree.
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


# Qwen2.5-Instruct's chat template (ChatML with tools), so the tiny Qwen2 trains on chat records
# (configs/tiny-qwen2-chat.json) and `trainer generate --chat` speaks it, as the real model does.
QWEN25_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""


def tiny_qwen2(out_dir, data):
    os.makedirs(out_dir, exist_ok=True)
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.NFC()
    trained.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=512 - len(special), special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    trained.train_from_iterator(texts(data, ["prompt", "completion"]), trainer=trainer)
    vocab_merges = json.loads(trained.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in vocab_merges["merges"]]
    # Saved by transformers' own Qwen2Tokenizer, so tokenizer.json and tokenizer_config.json are as on the Hub.
    tokenizer = Qwen2Tokenizer(vocab=vocab_merges["vocab"], merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": special[1:]})
    tokenizer.save_pretrained(out_dir)
    for name in os.listdir(out_dir):
        if name not in ("tokenizer.json", "tokenizer_config.json"):
            os.remove(os.path.join(out_dir, name))
    with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(QWEN25_CHAT_TEMPLATE)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    # Qwen2 in miniature: q/k/v biases, grouped-query attention, tied embeddings.
    Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=eos,
                eos_token_id=eos).save_pretrained(out_dir)


def with_tiny_qwen2_tokenizer(out_dir, qwen2_dir, config):
    """A decoder family in miniature on tiny-qwen2's tokenizer and chat template (the tiny configs' demo data)."""
    os.makedirs(out_dir, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        with open(os.path.join(qwen2_dir, name), encoding="utf-8") as src, \
                open(os.path.join(out_dir, name), "w", encoding="utf-8") as dst:
            dst.write(src.read())
    with open(os.path.join(qwen2_dir, "config.json"), encoding="utf-8") as f:
        qwen2 = json.load(f)
    config(vocab_size=qwen2["vocab_size"], bos_token_id=qwen2["eos_token_id"],
           eos_token_id=qwen2["eos_token_id"]).save_pretrained(out_dir)


def tiny_qwen3(out_dir, qwen2_dir):
    # Qwen3 in miniature: q/k norms per head, head_dim 32 (not hidden / heads), grouped-query attention, untied.
    with_tiny_qwen2_tokenizer(out_dir, qwen2_dir, lambda **kw: Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=1024, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6, tie_word_embeddings=False, **kw))


def tiny_gemma3(out_dir, qwen2_dir):
    # Gemma 3's text model in miniature: a sliding layer (window 64) with its local RoPE, then a full one; q/k norms,
    # (1 + weight) norms, scaled embeddings, tied.
    with_tiny_qwen2_tokenizer(out_dir, qwen2_dir, lambda **kw: Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, query_pre_attn_scalar=16, sliding_window=64, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=1024, pad_token_id=None, **kw))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "configs", "models"))
    args = parser.parse_args()
    tiny_t5(os.path.join(args.out, "tiny-t5"), os.path.join(ROOT, "data", "demo", "recipes-seq2seq.jsonl"))
    tiny_qwen2(os.path.join(args.out, "tiny-qwen2"), os.path.join(ROOT, "data", "demo", "recipes-causal.jsonl"))
    tiny_qwen3(os.path.join(args.out, "tiny-qwen3"), os.path.join(args.out, "tiny-qwen2"))
    tiny_gemma3(os.path.join(args.out, "tiny-gemma3"), os.path.join(args.out, "tiny-qwen2"))


if __name__ == "__main__":
    main()
