"""The shipped tiny model directories are real Hugging Face directories: transformers builds the model from
their config.json, the Python tokenizer libraries load their tokenizers, and trainer reads the same model type
and family that transformers does."""
import json
import re

import pytest
import sentencepiece
import torch
import transformers
from tokenizers import Tokenizer

TINY = {"tiny-t5": "configs/tiny-t5.json", "tiny-qwen2": "configs/tiny-qwen2.json",
        "tiny-qwen3": "configs/tiny-qwen3.json", "tiny-gemma3": "configs/tiny-gemma3.json"}


def first_records(path, n=8):
    with open(path, encoding="utf-8") as f:
        return [json.loads(next(f)) for _ in range(n)]


@pytest.mark.parametrize("name", sorted(TINY))
def test_transformers_builds_the_tiny_model(root, name):
    model_dir = root / "configs" / "models" / name
    config = transformers.AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    if config.is_encoder_decoder:
        model = transformers.AutoModelForSeq2SeqLM.from_config(config)
        ids = torch.tensor([[5, 6, 7, 1]])
        out = model(input_ids=ids, labels=ids)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
        ids = torch.tensor([[5, 6, 7, 8]])
        out = model(input_ids=ids, labels=ids)
    assert out.logits.shape[-1] == config.vocab_size
    assert torch.isfinite(out.loss)


def test_tiny_t5_tokenizer_matches_its_config(root):
    model_dir = root / "configs" / "models" / "tiny-t5"
    config = transformers.AutoConfig.from_pretrained(model_dir)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_dir / "spiece.model"))
    assert (sp.pad_id(), sp.eos_id(), sp.unk_id()) == (config.pad_token_id, config.eos_token_id, 2)
    assert sp.get_piece_size() <= config.vocab_size
    for record in first_records(root / "data" / "demo" / "recipes-seq2seq.jsonl"):
        ids = sp.encode(record["input"])
        assert max(ids) < config.vocab_size
        assert sp.decode(ids) == record["input"]


def test_tiny_qwen2_tokenizer_matches_its_config(root):
    model_dir = root / "configs" / "models" / "tiny-qwen2"
    config = transformers.AutoConfig.from_pretrained(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == config.vocab_size
    assert tokenizer.token_to_id("<|endoftext|>") == config.eos_token_id
    for record in first_records(root / "data" / "demo" / "recipes-causal.jsonl"):
        text = record["prompt"] + record["completion"]
        encoding = tokenizer.encode(text)
        assert max(encoding.ids) < config.vocab_size
        assert tokenizer.decode(encoding.ids) == text


@pytest.mark.parametrize("name", sorted(TINY))
def test_trainer_reads_the_model_type_transformers_reads(root, run_trainer, name):
    config = transformers.AutoConfig.from_pretrained(root / "configs" / "models" / name)
    plan = run_trainer("--config", TINY[name], "--dry-run").stdout
    match = re.search(r"model\s+\S+ \((\w+), (\w+);", plan)
    assert match, plan
    assert match.group(1) == config.model_type
    assert match.group(2) == ("seq2seq" if config.is_encoder_decoder else "causal")


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-gemma3"])
def test_a_tiny_family_run_learns_and_saves_what_transformers_loads(root, run_trainer, tmp_path, name):
    out = tmp_path / "run"
    run_trainer("--config", TINY[name], "--set", "training.max_steps=6", "--set", "training.batch_size=8",
                "--set", "evaluation.every_steps=0", "--set", "evaluation.sample_prompts=[]", "--set",
                "logging.every_steps=1", "--set", f"checkpoint.output_dir={out}", "--set", "logging.progress=off")
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line and "eval_loss" not in line]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    config = transformers.AutoConfig.from_pretrained(root / "configs" / "models" / name)
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "final")
    assert type(model).__name__ == {"qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}[config.model_type]
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits).all()
