"""Chat templates that rendering prefix by prefix cannot split, swapped for trainer's training versions as TRL's
SFTTrainer(assistant_only_loss=True) swaps them (trl.chat_template_utils.get_training_chat_template), TRL 1.16.

The model templates are TRL's own copies, read from the installed trl package at test time (TRL recognises a model
by the exact text, as trainer does). For each family trainer knows:
(1) `trainer data --dump` renders the conversation as transformers renders TRL's training version (which keeps
    reasoning the original drops; where it drops nothing, as the original), and names the swap in its log;
(2) the ids and labels equal SFTTrainer(assistant_only_loss=True)'s input_ids and labels (its assistant masks);
(3) DPO pairs equal DPOTrainer's, which renders with the model's own template (TRL swaps nothing there);
(4) a template one byte away from a known one is not recognised: it keeps the refusal, whose hint names the families;
    and train_on=all keeps the model's own rendering (TRL swaps only for assistant_only_loss).
"""
import json
import pathlib
import shutil

import datasets
import pytest
import torch
import transformers
import trl
from trl.chat_template_utils import get_training_chat_template

TRL_TEMPLATES = pathlib.Path(trl.__file__).parent / "chat_templates"
FAMILIES = {"Qwen3": "qwen3", "Qwen3-Instruct-2507": "qwen3_instruct_2507",
            "DeepSeek-R1-Distill": "deepseek_r1_distill", "Gemma 3": "gemma3", "gpt-oss": "gptoss"}
# Families whose training version renders what the original renders (only the marks differ).
SAME_RENDERING = {"Qwen3-Instruct-2507", "Gemma 3", "gpt-oss"}


def original(family):
    return (TRL_TEMPLATES / f"{FAMILIES[family]}.jinja").read_text(encoding="utf-8")


def conversations(family):
    """Multi-turn conversations whose earlier assistant turns carry reasoning (in the content, where the template
    reads it from there): what the originals of Qwen3 and DeepSeek-R1-Distill re-render."""
    think = family in ("Qwen3", "DeepSeek-R1-Distill")
    def answer(reasoning, text):
        return f"<think>\n{reasoning}\n</think>\n\n{text}" if think else text
    return [
        [{"role": "user", "content": "Soup?"}, {"role": "assistant", "content": answer("Water boils.", "Boil water.")}],
        [{"role": "user", "content": "Soup?"}, {"role": "assistant", "content": answer("Water first.", "Boil water.")},
         {"role": "user", "content": "Then?"},
         {"role": "assistant", "content": answer("Salt last.", "Add salt, crème fraîche 🍲.")}],
        [{"role": "system", "content": "You cook."}, {"role": "user", "content": "Bread?"},
         {"role": "assistant", "content": "Knead it."}, {"role": "user", "content": "How long?"},
         {"role": "assistant", "content": answer("Gluten needs time.", "Ten minutes.")},
         {"role": "user", "content": "Oven?"}, {"role": "assistant", "content": "220 degrees."}],
    ]


def model_dir(root, path, template, weights=False):
    """The tiny Qwen2 (tokenizer, and random weights when a TRL trainer needs a model) with `template`."""
    tiny = root / "configs" / "models" / "tiny-qwen2"
    path.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, path / name)
    (path / "chat_template.jinja").write_text(template, encoding="utf-8")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["bos_token"] = "<|endoftext|>"  # DeepSeek's template opens with bos_token
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if weights:
        torch.manual_seed(1234)
        transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tiny)).save_pretrained(path)
    return path


def dump(run_trainer, tmp_path, directory, rows, train_on="assistant", extra=None, check=True):
    data = tmp_path / f"data-{train_on}.jsonl"
    data.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    config = {"model": {"path": str(directory), "init": "random"},
              "data": {"train_files": [str(data)], "train_on": train_on, "max_length": 100000,
                       "on_bad_record": "skip"},
              "device": {"type": "cpu"}}
    for section, values in (extra or {}).items():
        config.setdefault(section, {}).update(values)
    path = tmp_path / f"config-{train_on}.json"
    path.write_text(json.dumps(config))
    result = run_trainer("data", "--config", path, "--dump", len(rows), check=check)
    lines = [json.loads(line) for line in result.stdout.split("\n") if line.startswith("{")]
    return lines, result


def trained(labels):
    return [int(label != -100) for label in labels]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_trl_recognises_the_template_and_prefix_rendering_cannot_split_it(family, root, tmp_path):
    """The premise: TRL swaps this exact text for a training version."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir(root, tmp_path / "m", original(family)))
    assert get_training_chat_template(tokenizer) is not None


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sft_ids_and_labels_equal_trls_assistant_only_loss(family, root, tmp_path, run_trainer):
    directory = model_dir(root, tmp_path / "model", original(family), weights=True)
    rows = [{"messages": messages} for messages in conversations(family)]
    ours, result = dump(run_trainer, tmp_path, directory, rows)
    # (1) the swap is named in the log
    assert f"is the {family} template" in result.stdout + result.stderr
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    training = get_training_chat_template(tokenizer)
    for row, got in zip(rows, ours):
        assert "skipped" not in got, got
        # (1) the rendering is transformers' rendering of TRL's training version ...
        assert got["text"] == tokenizer.apply_chat_template(row["messages"], tokenize=False, chat_template=training)
        # ... which is the original's where the training version changes nothing but the marks, and for Qwen3's
        # one-turn conversation (the original keeps the reasoning of turns after the last user message)
        if family in SAME_RENDERING or (family == "Qwen3" and len(row["messages"]) == 2):
            assert got["text"] == tokenizer.apply_chat_template(row["messages"], tokenize=False)
    # (2) SFTTrainer itself, assistant-only loss
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), assistant_only_loss=True, report_to=[], use_cpu=True,
                         bf16=False, max_length=None)
    sft = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=tokenizer)
    theirs = list(sft.train_dataset)
    assert len(theirs) == len(ours)
    for got, expected in zip(ours, theirs):
        assert got["input_ids"] == expected["input_ids"]
        assert got["labels"] == expected["labels"]  # SFTTrainer's labels: -100 outside the assistant mask
        assert 0 < sum(trained(expected["labels"])) < len(expected["labels"])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_train_on_all_keeps_the_models_rendering(family, root, tmp_path, run_trainer):
    directory = model_dir(root, tmp_path / "model", original(family))
    rows = [{"messages": messages} for messages in conversations(family)]
    ours, result = dump(run_trainer, tmp_path, directory, rows, train_on="all")
    assert "training template" not in result.stdout + result.stderr
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    for row, got in zip(rows, ours):
        assert got["text"] == tokenizer.apply_chat_template(row["messages"], tokenize=False)
        assert got["labels"] == got["input_ids"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dpo_pairs_equal_dpotrainers(family, root, tmp_path, run_trainer):
    """DPOTrainer renders prompt and prompt + completion with the model's template and starts the completion where
    their tokens part: no swap, and a template that re-renders earlier turns is no problem there."""
    directory = model_dir(root, tmp_path / "model", original(family), weights=True)
    rows = []
    for messages in conversations(family):
        prompt = messages[:-1]
        rows.append({"prompt": prompt, "chosen": [messages[-1]],
                     "rejected": [{"role": "assistant", "content": "No idea."}]})
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    config = tmp_path / "dpo.json"
    config.write_text(json.dumps({
        "model": {"path": str(directory), "init": "pretrained"},
        "data": {"train_files": [str(data)], "max_length": 1024},
        "training": {"objective": "dpo"}, "device": {"type": "cpu"}}))
    result = run_trainer("data", "--config", config, "--dump", len(rows))
    assert "training template" not in result.stdout + result.stderr
    ours = [json.loads(line) for line in result.stdout.split("\n") if line.startswith("{")]
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, max_length=1024)
    dpo = trl.DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=tokenizer)
    theirs = list(dpo.train_dataset)
    assert len(ours) == len(theirs) == len(rows)
    for a, b in zip(ours, theirs):
        prompt = b["prompt_ids"]
        for side, ids_key, labels_key in [("chosen", "input_ids", "labels"),
                                          ("rejected", "rejected_ids", "rejected_labels")]:
            assert a[ids_key] == prompt + b[f"{side}_ids"], side
            assert a[labels_key] == [-100] * len(prompt) + b[f"{side}_ids"], side


def test_a_template_one_byte_away_keeps_the_refusal(root, tmp_path, run_trainer):
    changed = original("Qwen3").replace("# Tools", "# Tools:")
    assert changed != original("Qwen3")
    directory = model_dir(root, tmp_path / "model", changed)
    rows = [{"messages": conversations("Qwen3")[1]}]
    ours, result = dump(run_trainer, tmp_path, directory, rows)
    assert "training template" not in result.stdout + result.stderr
    assert "cannot find the span" in ours[0].get("skipped", ""), ours
    # With data.on_bad_record=error the message carries the hint, which names the recognised families.
    _, failed = dump(run_trainer, tmp_path, directory, rows, extra={"data": {"on_bad_record": "error"}}, check=False)
    assert failed.returncode != 0
    assert "Qwen3, Qwen3-Instruct-2507, DeepSeek-R1-Distill, Gemma 3, gpt-oss" in failed.stderr, failed.stderr
