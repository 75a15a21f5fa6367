"""Batched generation against transformers' generate: the same new ids for several prompts of different lengths in
one batch (causal prompts padded on the left, T5 prompts on the right), greedy and beam search with
length_penalty, early_stopping and no_repeat_ngram_size, on the small random models of test_models.py.

EOS is set to the token the model emits most often under plain greedy decoding, so that rows finish at different
steps and beams end on EOS as well as at the length limit; the comparison covers those paths, not only runs to
max_new_tokens.
"""
import collections
import json
import subprocess

import pytest
import torch

from test_models import hf_model, make_model_dir

PROMPTS = [[5, 17, 42, 8, 9, 33], [7, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [40], [60, 61, 62]]
MAX_NEW = 12
PAD = 0

MODELS = ["t5-relu-tied", "flan-gated-gelu-untied", "qwen2-gqa-tied", "llama3-rope-biases", "mistral-sliding-window"]

SETTINGS = {
    "greedy": dict(num_beams=1),
    "greedy-no-repeat-2": dict(num_beams=1, no_repeat_ngram_size=2),
    "beams-3": dict(num_beams=3, length_penalty=1.0, early_stopping=False),
    "beams-4-early-no-repeat-2": dict(num_beams=4, length_penalty=0.6, early_stopping=True, no_repeat_ngram_size=2),
    "beams-2-never-long": dict(num_beams=2, length_penalty=2.0, early_stopping="never", no_repeat_ngram_size=3),
    "beams-3-short": dict(num_beams=3, length_penalty=-0.5, early_stopping=False),
}


def model_dir_for(name, path):
    # transformers' T5 cache assumes as many decoder layers as encoder layers (IndexError otherwise).
    overrides = {"num_decoder_layers": 2} if name.startswith(("t5", "flan")) else {}
    return make_model_dir(name, path, **overrides)


def padded(prompts, seq2seq):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if seq2seq:
            ids[i, :len(p)], mask[i, :len(p)] = torch.tensor(p), 1
        else:
            ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    return ids, mask


def transformers_generate(model, prompts, eos, **settings):
    """The new ids of each prompt: up to its first EOS (included) for greedy, the best beam's length for beams."""
    seq2seq = model.config.is_encoder_decoder
    ids, mask = padded(prompts, seq2seq)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                             pad_token_id=PAD, return_dict_in_generate=True, output_scores=True, **settings)
    start = 1 if seq2seq else ids.shape[1]
    results = []
    for i, row in enumerate(out.sequences.tolist()):
        new = row[start:]
        if settings.get("num_beams", 1) > 1:
            new = new[:int((out.beam_indices[i] >= 0).sum())]
        elif eos in new:
            new = new[:new.index(eos) + 1]
        results.append(new)
    return results


def ours_generate(tool, model_dir, tmp_path, prompts, eos, **settings):
    request = dict(prompts=prompts, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=PAD, **settings)
    (tmp_path / "request.json").write_text(json.dumps(request))
    result = subprocess.run([str(tool), "generate", model_dir, tmp_path / "request.json", tmp_path / "out.json"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads((tmp_path / "out.json").read_text())["outputs"]


def frequent_token(model):
    """The token plain greedy decoding emits most often over the prompts (never the padding)."""
    ids, mask = padded(PROMPTS, model.config.is_encoder_decoder)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=PAD)
    start = 1 if model.config.is_encoder_decoder else ids.shape[1]
    counts = collections.Counter(t for row in out[:, start:].tolist() for t in row if t != PAD)
    return counts.most_common(1)[0][0]


@pytest.fixture(scope="module")
def parity_tool(built_tool):
    return built_tool("trainer_parity", "TRAINER_PARITY")


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("name", MODELS)
def test_batched_generation_matches_transformers(name, setting, tmp_path, parity_tool):
    assert_generation_matches_transformers(name, setting, PROMPTS, tmp_path, parity_tool)


def assert_generation_matches_transformers(name, setting, prompts, tmp_path, parity_tool):
    model_dir = model_dir_for(name, tmp_path / "model")
    model = hf_model(model_dir)
    eos = frequent_token(model)
    theirs = transformers_generate(model, prompts, eos, **SETTINGS[setting])
    ours = ours_generate(parity_tool, model_dir, tmp_path, prompts, eos, **SETTINGS[setting])
    assert ours == theirs


def test_eos_paths_are_exercised(tmp_path):
    """The EOS choice must make some rows stop early, else the tests above only cover runs to the limit."""
    model = hf_model(model_dir_for("qwen2-gqa-tied", tmp_path / "model"))
    eos = frequent_token(model)
    rows = transformers_generate(model, PROMPTS, eos, num_beams=1)
    assert any(len(r) < MAX_NEW for r in rows)


@pytest.mark.parametrize("name", ["t5-relu-tied", "qwen2-gqa-tied"])
def test_batch_gives_each_prompt_what_it_gets_alone(name, tmp_path, parity_tool):
    model_dir = model_dir_for(name, tmp_path / "model")
    model = hf_model(model_dir)
    eos = frequent_token(model)
    together = ours_generate(parity_tool, model_dir, tmp_path, PROMPTS, eos, num_beams=3)
    alone = [ours_generate(parity_tool, model_dir, tmp_path, [p], eos, num_beams=3)[0] for p in PROMPTS]
    assert together == alone


def test_sampling_is_seeded_and_top_k_1_is_greedy(tmp_path, parity_tool):
    model_dir = model_dir_for("qwen2-gqa-tied", tmp_path / "model")
    model = hf_model(model_dir)
    eos = frequent_token(model)
    sampled = dict(do_sample=True, temperature=1.5, top_p=0.95, top_k=0, seed=11)
    a = ours_generate(parity_tool, model_dir, tmp_path, PROMPTS, eos, **sampled)
    b = ours_generate(parity_tool, model_dir, tmp_path, PROMPTS, eos, **sampled)
    assert a == b
    c = ours_generate(parity_tool, model_dir, tmp_path, PROMPTS, eos, **{**sampled, "seed": 12})
    assert c != a
    greedy = ours_generate(parity_tool, model_dir, tmp_path, PROMPTS, eos, do_sample=True, top_k=1, seed=3)
    assert greedy == transformers_generate(model, PROMPTS, eos, num_beams=1)


# Long and short prompts in one batch: trainer prefills them in two groups of similar length (kv_cache.h's
# prefill_groups), each padded to its own longest prompt; the answers must still be transformers' (one batch padded
# to the longest prompt). The short prompts above all run as one group.
LONG_AND_SHORT = [[(7 * i) % 90 + 3 for i in range(40)], [60, 61, 62], [(11 * i) % 80 + 5 for i in range(36)], [9, 4], [40]]


@pytest.mark.parametrize("setting", ["greedy", "beams-3"])
@pytest.mark.parametrize("name", MODELS)
def test_prompts_prefilled_in_groups_match_transformers(name, setting, tmp_path, parity_tool):
    assert_generation_matches_transformers(name, setting, LONG_AND_SHORT, tmp_path, parity_tool)
