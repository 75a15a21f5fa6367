"""DPO (training.objective=dpo) against TRL's DPOTrainer itself (trl 1.16, transformers 5), fp32 on the CPU.

(a) `trainer data --dump` gives the ids and completion labels DPOTrainer tokenizes, for standard, conversational and
    implicit-prompt records, with its truncation (keep_start) and its dropping of prompts that fill max_length;
(b) three optimizer steps on the same pairs give TRL's loss, every reward metric (rewards/*, logps/*, logits/*) and
    the weights after them within 1e-5, for LoRA (the reference is the base with the adapters off) and a full
    fine-tune (a frozen copy), on a tiny Qwen2 and a tiny Llama, for each loss type; trainer splits each step into
    micro-batches of 3 pairs while TRL runs the 8 pairs in one (the loss is a mean over pairs: the split is exact);
(c) dpo.precompute_reference=true against TRL's precompute_ref_log_probs=True (train and evaluation), and the pass's
    file in checkpoint.output_dir/dpo-reference: reused, never recomputed, by a second run or a resume; a pass killed
    after some chunks goes on from them; other data computes it again.
DPOConfig defaults to bf16 on a CPU that supports it: bf16=False here, as the issue's facts say.
"""
import json
import shutil

import datasets
import peft
import pytest
import torch
import transformers
import trl
from safetensors.torch import load_file

TOL = dict(atol=1e-5, rtol=1e-5)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEED = 3


def make_model_dir(root, path, arch):
    """A tiny causal model (transformers' random initialisation) with the tiny Qwen2's tokenizer and chat template."""
    tiny = root / "configs" / "models" / "tiny-qwen2"
    if arch == "qwen2":
        config = transformers.AutoConfig.from_pretrained(tiny)
    elif arch == "gemma2":
        # A decoder family whose logits are soft-capped (inside the fused loss and the log-probabilities), with
        # soft-capped attention scores and a sliding window shorter than the pairs.
        config = transformers.Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           query_pre_attn_scalar=16, sliding_window=8, attn_logit_softcapping=5.0,
                                           final_logit_softcapping=3.0, bos_token_id=509, eos_token_id=509,
                                           pad_token_id=None, max_position_embeddings=1024)
    else:
        config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                          bos_token_id=509, eos_token_id=509, max_position_embeddings=1024)
    torch.manual_seed(1234)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    for name in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]:
        shutil.copy(tiny / name, path / name)
    return path


def records(kind):
    """Eight pairs of one format (TRL decides the format per dataset)."""
    out = []
    for i in range(8):
        dish = ["soup", "stew", "salad", "pie", "bread", "curry", "tart", "chili"][i]
        good = f"Simmer the {dish} for {10 + i} minutes, then season it." + " Stir well." * (i % 3)
        bad = ["Just cook it.", f"Burn the {dish}.", "No idea."][i % 3]
        question = f"How do I cook a {dish}?" + " Quickly, please." * (i % 2)
        if kind == "standard":
            out.append({"prompt": f"Recipe for {dish}:", "chosen": " " + good, "rejected": " " + bad})
        elif kind == "conversational":
            out.append({"prompt": [{"role": "user", "content": question}],
                        "chosen": [{"role": "assistant", "content": good}],
                        "rejected": [{"role": "assistant", "content": bad}]})
        else:  # implicit prompt: whole conversations sharing the user turn
            user = {"role": "user", "content": question}
            out.append({"chosen": [user, {"role": "assistant", "content": good}],
                        "rejected": [user, {"role": "assistant", "content": bad}]})
    return out


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trl_args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=8, gradient_accumulation_steps=1, max_steps=3,
                learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
                adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, logging_steps=1, bf16=False, fp16=False,
                report_to=[], save_strategy="no", use_cpu=True, seed=SEED, max_length=192, dataloader_drop_last=False)
    base.update(kw)
    return trl.DPOConfig(**base)


def trainer_config(tmp_path, model_dir, train_file, out, *, lora, loss_type=("sigmoid",), loss_weights=(),
                   label_smoothing=0.0, beta=0.1, max_length=192, validation_file=None, reference_model="",
                   precompute=False, every_steps=0, max_steps=3, micro_batch_size=3):
    config = {
        "model": {"path": str(model_dir), "init": "pretrained"},
        "data": {"train_files": [str(train_file)],
                 "validation_files": [str(validation_file)] if validation_file else [], "max_length": max_length,
                 "num_workers": 1},
        "training": {"objective": "dpo", "batch_size": 8, "micro_batch_size": micro_batch_size, "max_steps": max_steps,
                     "seed": SEED,
                     "max_grad_norm": 1.0},
        "dpo": {"beta": beta, "loss_type": list(loss_type), "loss_weights": list(loss_weights),
                "label_smoothing": label_smoothing, "reference_model": str(reference_model),
                "precompute_reference": precompute},
        "lora": {"enabled": lora, "r": 8, "alpha": 16, "dropout": 0.0, "target_modules": TARGETS},
        "evaluation": {"every_steps": 3 if validation_file else 0, "micro_batch_size": 3},
        "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
        "scheduler": {"name": "constant", "warmup_steps": 0},
        "precision": {"mode": "fp32"},
        "device": {"type": "cpu"},
        "checkpoint": {"output_dir": str(out), "every_steps": every_steps},
        "logging": {"every_steps": 1, "tensorboard": False},
    }
    path = tmp_path / "dpo.json"
    path.write_text(json.dumps(config))
    return path


def our_initial_lora_a(model):
    """trainer's LoRA A at the start (src/models/lora.cpp): uniform in +-1/sqrt(in) from a CPU generator seeded with
    training.seed, drawn per adapted layer in the model's order."""
    generator = torch.Generator().manual_seed(SEED)
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in TARGETS:
            bound = 1.0 / module.in_features ** 0.5
            out[name] = torch.empty(8, module.in_features).uniform_(-bound, bound, generator=generator)
    return out


def run_trl(tmp_path, model_dir, rows, *, lora, eval_rows=None, ref_dir=None, **kw):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    initial = our_initial_lora_a(model) if lora else None
    peft_config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS,
                                  task_type="CAUSAL_LM") if lora else None
    eval_dataset = datasets.Dataset.from_list(eval_rows) if eval_rows else None
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32) if ref_dir else None
    dpo = trl.DPOTrainer(model=model, ref_model=ref_model,
                         args=trl_args(tmp_path / "trl", per_device_eval_batch_size=8, **kw),
                         train_dataset=datasets.Dataset.from_list(rows), eval_dataset=eval_dataset,
                         processing_class=tokenizer, peft_config=peft_config)
    if lora:
        with torch.no_grad():
            for name, module in dpo.model.named_modules():
                if isinstance(module, peft.tuners.lora.LoraLayer):
                    base_name = name.removeprefix("base_model.model.")
                    module.lora_A["default"].weight.copy_(initial[base_name])
    dpo.train()
    return dpo


def step_logs(dpo):
    return [entry for entry in dpo.state.log_history if "loss" in entry and "train_runtime" not in entry]


METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected"]


def compare_run(ours_dir, dpo, lora):
    ours = [json.loads(line) for line in (ours_dir / "metrics.jsonl").read_text().splitlines()]
    ours = [r for r in ours if "loss" in r]
    theirs = step_logs(dpo)
    assert len(ours) == len(theirs) == 3
    for step, (a, b) in enumerate(zip(ours, theirs), start=1):
        for key in ["loss", *METRICS]:
            assert a[key] == pytest.approx(b[key], abs=1e-5, rel=1e-5), f"step {step} {key}: {a[key]} vs {b[key]}"
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], abs=1e-5, rel=1e-4), f"step {step} grad_norm"
    # The steps must have moved the weights by far more than the tolerance, or agreement proves nothing.
    assert abs(ours[-1]["rewards/margins"]) > 1e-3
    if lora:
        theirs_state = peft.get_peft_model_state_dict(dpo.model)
        saved = load_file(ours_dir / "final" / "adapter_model.safetensors")
        assert set(saved) == set(theirs_state)
        for name, value in theirs_state.items():
            torch.testing.assert_close(saved[name], value.detach(), **TOL, msg=name)
    else:
        saved = load_file(ours_dir / "final" / "model.safetensors")
        state = dpo.model.state_dict()
        for name, value in saved.items():
            torch.testing.assert_close(value, state[name].detach(), **TOL, msg=name)


@pytest.fixture(scope="module")
def models(root, tmp_path_factory):
    base = tmp_path_factory.mktemp("dpo-models")
    return {arch: make_model_dir(root, base / arch, arch) for arch in ["qwen2", "llama", "gemma2"]}


@pytest.mark.parametrize("kind", ["standard", "conversational", "implicit"])
def test_dumped_pairs_are_trls_tokenized_pairs(kind, models, tmp_path, run_trainer):
    rows = records(kind)
    # A prompt longer than max_length: TRL drops it, trainer skips it (counted as too long).
    long_prompt = "word " * 80
    if kind == "standard":
        rows.append({"prompt": long_prompt, "chosen": " yes", "rejected": " no"})
    elif kind == "conversational":
        rows.append({"prompt": [{"role": "user", "content": long_prompt}],
                     "chosen": [{"role": "assistant", "content": "yes"}],
                     "rejected": [{"role": "assistant", "content": "no"}]})
    max_length = 40  # cuts some completions: keep_start truncation
    model_dir = models["qwen2"]
    train_file = write_jsonl(tmp_path / "pairs.jsonl", rows)
    config = trainer_config(tmp_path, model_dir, train_file, tmp_path / "run", lora=True, max_length=max_length)
    dump = run_trainer("data", "--config", config, "--dump", "100")
    ours = [json.loads(line) for line in dump.stdout.splitlines() if line.startswith("{")]
    assert len(ours) == len(rows)

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dpo = trl.DPOTrainer(model=model, args=trl_args(tmp_path / "trl", max_length=max_length),
                         train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
    theirs = list(dpo.train_dataset)
    kept = [entry for entry in ours if "skipped" not in entry]
    assert len(kept) == len(theirs), [entry.get("skipped") for entry in ours]
    if kind != "implicit":
        assert "prompt alone" in ours[-1]["skipped"]
    for a, b in zip(kept, theirs):
        prompt = b["prompt_ids"]
        for side, ids_key, labels_key in [("chosen", "input_ids", "labels"),
                                          ("rejected", "rejected_ids", "rejected_labels")]:
            whole = (prompt + b[f"{side}_ids"])[:max_length]
            assert a[ids_key] == whole, side
            completion = ([0] * len(prompt) + [1] * len(b[f"{side}_ids"]))[:max_length]
            assert a[labels_key] == [t if m else -100 for t, m in zip(whole, completion)], side


@pytest.mark.parametrize("arch,kind,lora", [("qwen2", "conversational", True), ("qwen2", "standard", False),
                                            ("llama", "implicit", True), ("llama", "standard", False),
                                            ("gemma2", "conversational", True), ("gemma2", "standard", False)])
def test_three_steps_equal_trls(arch, kind, lora, models, tmp_path, run_trainer):
    rows = records(kind)
    train_file = write_jsonl(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "ours"
    run_trainer("--config", trainer_config(tmp_path, models[arch], train_file, out, lora=lora))
    compare_run(out, run_trl(tmp_path, models[arch], rows, lora=lora), lora)


def test_evaluation_after_three_steps_equals_trls(models, tmp_path, run_trainer):
    """The validation pairs' loss and metrics after three steps (trainer: evaluation in micro-batches of 3)."""
    rows, held_out = records("conversational"), records("implicit")
    train_file = write_jsonl(tmp_path / "pairs.jsonl", rows)
    validation_file = write_jsonl(tmp_path / "validation.jsonl", held_out)
    out = tmp_path / "ours"
    run_trainer("--config", trainer_config(tmp_path, models["qwen2"], train_file, out, lora=True,
                                           validation_file=validation_file))
    dpo = run_trl(tmp_path, models["qwen2"], rows, lora=True, eval_rows=held_out)
    theirs = dpo.evaluate()
    ours = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    ours = [r for r in ours if "eval_loss" in r][-1]
    assert ours["step"] == 3 and ours["eval_pairs"] == 8
    for key in ["loss", *METRICS]:
        assert ours["eval_" + key] == pytest.approx(theirs["eval_" + key], abs=1e-5, rel=1e-5), key


@pytest.mark.parametrize("lora", [True, False])
def test_a_separate_reference_model_equals_trls_ref_model(lora, root, models, tmp_path, run_trainer):
    """dpo.reference_model: another Qwen2 (other random weights) as the reference, TRL's ref_model."""
    other = tmp_path / "reference"
    config = transformers.AutoConfig.from_pretrained(models["qwen2"])
    torch.manual_seed(99)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(other)
    rows = records("conversational")
    train_file = write_jsonl(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "ours"
    run_trainer("--config", trainer_config(tmp_path, models["qwen2"], train_file, out, lora=lora,
                                           reference_model=other))
    dpo = run_trl(tmp_path, models["qwen2"], rows, lora=lora, ref_dir=other)
    compare_run(out, dpo, lora)
    # Another reference than the start: the rewards at step 1 are not zero (with the start they are, at LoRA's B = 0).
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(first["rewards/chosen"]) > 1e-3


def test_bad_records_name_their_file_and_line(models, tmp_path, run_trainer):
    rows = records("standard")
    lines = [json.dumps(r) for r in rows]
    lines[4] = json.dumps({"prompt": "a", "chosen": "b"})
    train_file = tmp_path / "pairs.jsonl"
    train_file.write_text("\n".join(lines) + "\n")
    config = trainer_config(tmp_path, models["qwen2"], train_file, tmp_path / "run", lora=True)
    result = run_trainer("--config", config, check=False)
    assert result.returncode == 3, result.stderr
    assert f"{train_file}:5: no \"rejected\" field" in result.stderr, result.stderr
    skipped = run_trainer("--config", config, "--set", "data.on_bad_record=skip", "--set", "checkpoint.output_dir=" +
                          str(tmp_path / "skip"))
    assert f"data: skipped {train_file}:5: no \"rejected\" field" in skipped.stderr, skipped.stderr
    assert "bad records skipped 0" not in skipped.stdout, skipped.stdout


@pytest.mark.parametrize("loss_type,weights,smoothing", [(["hinge"], [], 0.0), (["ipo"], [], 0.0),
                                                         (["robust"], [], 0.2), (["sigmoid", "sft"], [1.0, 0.5], 0.0)])
def test_each_loss_type_equals_trls(loss_type, weights, smoothing, models, tmp_path, run_trainer):
    rows = records("conversational")
    train_file = write_jsonl(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "ours"
    run_trainer("--config", trainer_config(tmp_path, models["qwen2"], train_file, out, lora=True, loss_type=loss_type,
                                           loss_weights=weights, label_smoothing=smoothing))
    dpo = run_trl(tmp_path, models["qwen2"], rows, lora=True, loss_type=loss_type,
                  loss_weights=weights or None, label_smoothing=smoothing)
    compare_run(out, dpo, True)


@pytest.mark.parametrize("lora", [True, False])
def test_a_precomputed_reference_equals_trls_precompute_ref_log_probs(lora, models, tmp_path, run_trainer):
    """dpo.precompute_reference against TRL's precompute_ref_log_probs=True: TRL computes the reference's log-probs of
    the train and eval datasets once before training (batches of per_device_train/eval_batch_size, padded per batch,
    the policy with its adapters off or, for a full fine-tune without ref_model, the policy itself before its first
    step) and keeps no reference model; trainer's pass runs in pieces of training.batch_size pairs. Training and the
    evaluation after three steps give TRL's loss, metrics and weights. Micro-batches of all 8 pairs here, padded as
    the pass pads them: at step 1 the policy is the reference (LoRA's B = 0; a full fine-tune's start), every reward
    is 0 in TRL and rewards/accuracies counts chosen > rejected, which rounding of other padding (3 pairs) flips."""
    rows, held_out = records("conversational"), records("implicit")
    train_file = write_jsonl(tmp_path / "pairs.jsonl", rows)
    validation_file = write_jsonl(tmp_path / "validation.jsonl", held_out)
    out = tmp_path / "ours"
    result = run_trainer("--config", trainer_config(tmp_path, models["qwen2"], train_file, out, lora=lora,
                                                    validation_file=validation_file, precompute=True,
                                                    micro_batch_size=8))
    assert "DPO reference: 16 pairs computed" in result.stderr, result.stderr
    if not lora:  # no frozen copy while training
        assert "a frozen copy" not in result.stderr, result.stderr
    reference = out / "dpo-reference"
    assert (reference / "complete.json").is_file() and (reference / "train-000000.bin").is_file()
    assert (reference / "validation-000000.bin").is_file()
    dpo = run_trl(tmp_path, models["qwen2"], rows, lora=lora, eval_rows=held_out, precompute_ref_log_probs=True)
    assert dpo.ref_model is None and dpo.precompute_ref_logps
    compare_run(out, dpo, lora)
    theirs = dpo.evaluate()
    ours = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    ours = [r for r in ours if "eval_loss" in r][-1]
    assert ours["step"] == 3 and ours["eval_pairs"] == 8
    for key in ["loss", *METRICS]:
        assert ours["eval_" + key] == pytest.approx(theirs["eval_" + key], abs=1e-5, rel=1e-5), key


def test_a_precomputed_reference_equals_the_reference_computed_while_training(models, tmp_path, run_trainer):
    """A full fine-tune: the precomputed values are the frozen copy's (same metrics and weights within 1e-5; one
    micro-batch of 8 pairs, for rewards/accuracies' ties at step 1 as above)."""
    rows = records("standard")
    train_file = write_jsonl(tmp_path / "pairs.jsonl", rows)
    runs = {}
    for precompute in [False, True]:
        out = tmp_path / f"precompute-{precompute}"
        run_trainer("--config", trainer_config(tmp_path, models["llama"], train_file, out, lora=False,
                                               precompute=precompute, micro_batch_size=8))
        runs[precompute] = ([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()],
                            load_file(out / "final" / "model.safetensors"))
    (fly, fly_weights), (pre, pre_weights) = runs[False], runs[True]
    for a, b in zip(fly, pre):
        for key in ["loss", *METRICS]:
            if key in a:
                assert a[key] == pytest.approx(b[key], abs=1e-5, rel=1e-5), key
    for name, value in fly_weights.items():
        torch.testing.assert_close(pre_weights[name], value, **TOL, msg=name)


def many_records(n):
    return [{"prompt": f"Question {i}:", "chosen": f" answer {i} is right.", "rejected": f" no {i}."} for i in range(n)]


def chunk_times(directory):
    return {path.name: path.stat().st_mtime_ns for path in sorted(directory.glob("*.bin"))}


def test_the_precomputed_reference_is_reused_by_a_resume_and_never_recomputed(models, tmp_path, run_trainer):
    """Two steps with a checkpoint at each, then the run resumed to three: the resume reuses the complete file (its
    chunks untouched) and ends at the weights of three steps run straight."""
    rows = records("standard")
    train_file = write_jsonl(tmp_path / "pairs.jsonl", rows)
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_trainer("--config", trainer_config(tmp_path, models["qwen2"], train_file, straight, lora=False,
                                           precompute=True))
    first = run_trainer("--config", trainer_config(tmp_path, models["qwen2"], train_file, split, lora=False,
                                                   precompute=True, every_steps=1, max_steps=2))
    assert "DPO reference: 8 pairs computed" in first.stderr, first.stderr
    before = chunk_times(split / "dpo-reference")
    assert before
    resumed = run_trainer("--config", trainer_config(tmp_path, models["qwen2"], train_file, split, lora=False,
                                                     precompute=True, every_steps=1, max_steps=3), "--resume")
    assert "resuming from" in resumed.stderr, resumed.stderr
    assert "DPO reference: reusing" in resumed.stderr and "pairs computed" not in resumed.stderr, resumed.stderr
    assert chunk_times(split / "dpo-reference") == before
    a = load_file(straight / "final" / "model.safetensors")
    b = load_file(split / "final" / "model.safetensors")
    for name, value in a.items():
        torch.testing.assert_close(b[name], value, atol=0, rtol=0, msg=name)


def test_a_pass_killed_after_some_chunks_goes_on_from_them(models, tmp_path, run_trainer):
    """1100 pairs are three chunks of the pass (512 pairs each). What a kill -9 during the third leaves (two chunk
    files, the third's temporary file, no complete.json) is made from a finished pass; the next run computes the
    third chunk alone, to the same bytes, and trains."""
    train_file = write_jsonl(tmp_path / "pairs.jsonl", many_records(1100))
    out = tmp_path / "run"
    config = trainer_config(tmp_path, models["qwen2"], train_file, out, lora=True, precompute=True, max_steps=1,
                            max_length=32)
    run_trainer("--config", config)
    reference = out / "dpo-reference"
    whole = {name: (reference / name).read_bytes() for name in chunk_times(reference)}
    assert sorted(whole) == ["train-000000.bin", "train-000001.bin", "train-000002.bin"]
    shutil.rmtree(out / "final")
    (reference / "complete.json").unlink()
    (reference / "train-000002.bin").rename(reference / "train-000002.bin.tmp")
    kept = chunk_times(reference)
    again = run_trainer("--config", config)
    assert "after 2 train and 0 validation chunks" in again.stderr, again.stderr
    assert "DPO reference: 76 pairs computed" in again.stderr, again.stderr
    assert {name: t for name, t in chunk_times(reference).items() if name in kept} == kept
    assert {name: (reference / name).read_bytes() for name in whole} == whole
    assert (reference / "complete.json").is_file()


def test_other_data_computes_the_reference_again(models, tmp_path, run_trainer):
    """A run over the same output directory with a pair more: the stored values belong to other data, so the pass
    runs again (with a warning naming the change); without a change it is reused."""
    rows = records("standard")
    train_file = write_jsonl(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "run"
    config = trainer_config(tmp_path, models["qwen2"], train_file, out, lora=True, precompute=True, max_steps=1)
    run_trainer("--config", config)
    reused = run_trainer("--config", config)
    assert "DPO reference: reusing" in reused.stderr, reused.stderr
    write_jsonl(train_file, rows + many_records(1))
    changed = run_trainer("--config", config)
    assert "was computed for other data or another reference" in changed.stderr, changed.stderr
    assert "pairs.jsonl" in changed.stderr and "DPO reference: 9 pairs computed" in changed.stderr, changed.stderr


def read_chunks(directory, split="train"):
    """{key: (chosen, rejected)} of a dpo-reference directory's chunk files (header: magic, position, count)."""
    import struct
    out = {}
    for path in sorted(directory.glob(f"{split}-*.bin")):
        data = path.read_bytes()
        assert data[:8] == b"TRDPORF1"
        position, count = struct.unpack_from("<QQ", data, 8)
        for i in range(count):
            key, chosen, rejected = struct.unpack_from("<Qdd", data, 24 + 24 * i)
            out[key] = (chosen, rejected)
    return out


def test_out_of_memory_in_the_pass_halves_its_pieces_and_gives_the_same_values(tmp_path, run_trainer):
    """The pass under memory.limit=4MiB (CPU budget: 32 pairs of a forward do not fit) halves its pieces, says so, and
    stores the values of the pass without a limit (other padding: rounding only)."""
    rows = [{"prompt": f"Question {i} about soups and stews and the way they simmer:",
             "chosen": f" answer {i} is right and long enough to matter here.", "rejected": f" no {i}."}
            for i in range(64)]
    train_file = write_jsonl(tmp_path / "pairs.jsonl", rows)
    tables = {}
    for limit in ["2GiB", "4MiB"]:
        out = tmp_path / limit
        result = run_trainer("--config", "configs/tiny-qwen2-dpo.json", "--set", f"data.train_files=[\"{train_file}\"]",
                             "--set", "data.validation_files=[]", "--set", "training.batch_size=32", "--set",
                             "training.micro_batch_size=1", "--set", "training.max_steps=1", "--set",
                             "dpo.precompute_reference=true", "--set", "lora.enabled=false", "--set",
                             f"memory.limit={limit}", "--set", f"checkpoint.output_dir={out}")
        halved = "DPO reference: out of memory with 32 pairs in a forward; going on with 16" in result.stderr
        assert halved == (limit == "4MiB"), result.stderr
        tables[limit] = read_chunks(out / "dpo-reference")
    free, constrained = tables["2GiB"], tables["4MiB"]
    assert len(free) == 64 and set(free) == set(constrained)
    for key, (chosen, rejected) in free.items():
        assert constrained[key][0] == pytest.approx(chosen, rel=1e-6)
        assert constrained[key][1] == pytest.approx(rejected, rel=1e-6)


def test_the_plan_counts_no_reference_with_a_precomputed_one(run_trainer):
    """A full fine-tune: `trainer plan` counts the frozen copy, and with dpo.precompute_reference neither it nor the
    reference's forward (preference_example_shape)."""
    plans = {p: run_trainer("plan", "--config", "configs/tiny-qwen2-dpo.json", "--set", "lora.enabled=false", "--set",
                            f"dpo.precompute_reference={p}").stdout for p in ["false", "true"]}
    assert "of which the DPO reference" in plans["false"], plans["false"]
    assert "DPO reference" not in plans["true"], plans["true"]
