"""LoRA against PEFT itself, on the shipped tiny models (configs/models/tiny-t5, tiny-qwen2) with random weights.

(a) PEFT loads the adapter trainer saves and reproduces trainer's adapted logits;
(b) trainer loads an adapter PEFT made (non-zero B, rsLoRA, a rank_pattern) and reproduces PEFT's logits, loss and
    adapter gradients;
(c) trainer's merged model loads in transformers and reproduces the adapted logits;
(d) a real training run with lora.enabled writes an adapter PEFT loads, and --merge a model transformers loads.
fp32 throughout: within 1e-4 absolute + 1e-4 relative, as the model parity tests.
"""
import json

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from test_models import FAMILIES, checkpoint_names, hf_model, make_batch, make_model_dir, parity_tool, real_positions, run_parity_tool  # noqa: F401,E501 (fixture)

TINY = ["tiny-t5", "tiny-qwen2"]
# Attention and MLP projections of each family; the rank_pattern entry gives one module a rank of its own.
TARGETS = {"tiny-t5": ["q", "k", "v", "o", "wi_0", "wo"],
           "tiny-qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
RANK_PATTERN = {"tiny-t5": {"decoder.block.1.layer.1.EncDecAttention.v": 2},
                "tiny-qwen2": {"model.layers.1.self_attn.v_proj": 2}}
# The adapters must move the logits by far more than the tolerance, or agreement proves nothing.
MIN_EFFECT = 1e-2


def tolerance_close(ours, theirs, msg=None):
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4, msg=msg)


def make_tiny_dir(root, name, path):
    """The tiny model's config.json with transformers' random initialisation, saved with save_pretrained."""
    config = transformers.AutoConfig.from_pretrained(root / "configs" / "models" / name)
    torch.manual_seed(1234)
    cls = transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else transformers.AutoModelForCausalLM
    cls.from_config(config).save_pretrained(path)
    return path


def random_peft_adapter(base, config, adapter_dir):
    """`config`'s PEFT adapter on `base` with every LoRA weight random (B too, so it changes the logits), saved to
    `adapter_dir`; the PEFT model in eval mode."""
    model = peft.get_peft_model(base, config)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "lora_" in param_name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    model.save_pretrained(adapter_dir)
    model.eval()
    return model


def peft_made_adapter(name, model_dir, adapter_dir):
    """A PEFT adapter with every weight random (B too), rsLoRA and a per-module rank; returns the PEFT model."""
    base = hf_model(model_dir)
    config = peft.LoraConfig(task_type="SEQ_2_SEQ_LM" if base.config.is_encoder_decoder else "CAUSAL_LM", r=4,
                             lora_alpha=8, lora_dropout=0.1, target_modules=TARGETS[name], use_rslora=True,
                             rank_pattern=RANK_PATTERN[name])
    return random_peft_adapter(base, config, adapter_dir)


def batch_for(model_dir, tmp_path):
    config = transformers.AutoConfig.from_pretrained(model_dir)
    batch = make_batch(config.is_encoder_decoder)
    save_file(batch, tmp_path / "batch.safetensors")
    return config, batch


def train_ours_load_in_peft(parity_tool, model_dir, batch, tmp_path, settings):
    """trainer's LoRA steps (the parity tool, batch.safetensors in tmp_path), then PEFT over transformers' base loads
    the adapter: our adapted logits, the base's logits and the PEFT model (eval mode)."""
    run_parity_tool(parity_tool, "lora-train", model_dir, tmp_path / "batch.safetensors", tmp_path / "adapter",
                    json.dumps(settings))
    ours = load_file(tmp_path / "adapter" / "logits.safetensors")["logits"]
    base = hf_model(model_dir)
    with torch.no_grad():
        base_logits = base(**batch).logits
    model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    model.eval()
    return ours, base_logits, model


@pytest.mark.parametrize("rslora", [False, True])
@pytest.mark.parametrize("name", TINY)
def test_peft_loads_our_adapter_and_reproduces_our_logits(name, rslora, root, tmp_path, parity_tool):
    model_dir = make_tiny_dir(root, name, tmp_path / "model")
    config, batch = batch_for(model_dir, tmp_path)
    settings = {"r": 4, "alpha": 8, "rslora": rslora, "target_modules": TARGETS[name], "steps": 3, "lr": 2.0,
                "seed": 3}
    ours, base_logits, model = train_ours_load_in_peft(parity_tool, model_dir, batch, tmp_path, settings)
    loaded = model.peft_config["default"]
    assert (loaded.r, loaded.lora_alpha, loaded.use_rslora) == (4, 8, rslora)
    assert loaded.task_type == ("SEQ_2_SEQ_LM" if config.is_encoder_decoder else "CAUSAL_LM")
    assert set(loaded.target_modules) == set(TARGETS[name])
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    adapted = {n for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert {k[len("base_model.model."):-len(".lora_A.weight")] for k in saved if k.endswith("lora_A.weight")} == \
        {n[len("base_model.model."):] for n in adapted}
    with torch.no_grad():
        theirs = model(**batch).logits
    real = real_positions(config, batch)
    assert (theirs[real] - base_logits[real]).abs().max() > MIN_EFFECT, "the adapter changes nothing"
    tolerance_close(ours[real], theirs[real])


def peft_adapter_forward_both_ways(model_dir, make_adapter, tmp_path, parity_tool):
    """PEFT's adapter (made by `make_adapter` into tmp_path/adapter) and trainer's load of it, on one batch: the
    adapter must change the logits, and trainer's logits and loss must be PEFT's. Returns the PEFT model (its LoRA
    gradients from the loss's backward) and trainer's outputs (logits, loss, grad.*)."""
    config, batch = batch_for(model_dir, tmp_path)
    with torch.no_grad():
        base_logits = hf_model(model_dir)(**batch).logits
    model = make_adapter()
    theirs = model(**batch)
    theirs.loss.backward()
    run_parity_tool(parity_tool, "lora-forward", model_dir, tmp_path / "adapter", tmp_path / "batch.safetensors",
                    tmp_path / "ours.safetensors")
    ours = load_file(tmp_path / "ours.safetensors")
    real = real_positions(config, batch)
    assert (theirs.logits[real] - base_logits[real]).abs().max() > MIN_EFFECT, "the adapter changes nothing"
    tolerance_close(ours["logits"][real], theirs.logits.detach()[real])
    tolerance_close(ours["loss"][0], theirs.loss.detach())
    return model, ours


@pytest.mark.parametrize("name", TINY)
def test_we_load_a_peft_adapter_and_reproduce_its_logits_loss_and_gradients(name, root, tmp_path, parity_tool):
    model_dir = make_tiny_dir(root, name, tmp_path / "model")
    model, ours = peft_adapter_forward_both_ways(
        model_dir, lambda: peft_made_adapter(name, model_dir, tmp_path / "adapter"), tmp_path, parity_tool)
    # PEFT's parameter names carry the adapter name ("lora_A.default.weight"); its saved keys, and ours, do not.
    expected = {n.replace(".default.", "."): p.grad for n, p in model.named_parameters() if "lora_" in n}
    grads = {n[len("grad."):]: g for n, g in ours.items() if n.startswith("grad.")}
    assert set(grads) == set(expected)
    ranks = {n: g.shape[0] for n, g in grads.items() if n.endswith("lora_A.weight")}
    assert sorted(set(ranks.values())) == [2, 4], "the rank_pattern module has its own rank"
    for param_name, grad in grads.items():
        tolerance_close(grad, expected[param_name], msg=lambda m, n=param_name: f"gradient of {n}: {m}")


@pytest.mark.parametrize("name", TINY)
def test_our_merged_model_loads_in_transformers_and_reproduces_the_adapted_logits(name, root, tmp_path, run_trainer):
    model_dir = make_tiny_dir(root, name, tmp_path / "model")
    config, batch = batch_for(model_dir, tmp_path)
    model = peft_made_adapter(name, model_dir, tmp_path / "adapter")
    with torch.no_grad():
        adapted = model(**batch).logits
    result = run_trainer("merge", "--adapter", tmp_path / "adapter", "--base", model_dir, "--output",
                         tmp_path / "merged")
    assert "Merged" in result.stdout
    merged = hf_model(tmp_path / "merged")
    with torch.no_grad():
        ours = merged(**batch).logits
    real = real_positions(config, batch)
    tolerance_close(ours[real], adapted[real])
    # The same weights PEFT's own merge gives.
    theirs = model.merge_and_unload().state_dict()
    for key, value in load_file(tmp_path / "merged" / "model.safetensors").items():
        tolerance_close(value, theirs[key], msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("name", TINY)
def test_a_lora_training_run_writes_an_adapter_peft_loads_and_a_merged_model(name, root, tmp_path, run_trainer):
    out = tmp_path / "run"
    run_trainer("--config", f"configs/{name}.json", "--set", "lora.enabled=true", "--set", "training.max_steps=6",
                "--set", "evaluation.every_steps=0", "--set", f"checkpoint.output_dir={out}", "--set",
                "lora.alpha=64", "--set", "optimizer.lr=0.05", "--merge")
    adapter_config = json.loads((out / "final" / "adapter_config.json").read_text())
    base_dir = adapter_config["base_model_name_or_path"]
    assert base_dir == str(out / "base")
    config, batch = batch_for(base_dir, tmp_path)
    base = hf_model(base_dir)
    with torch.no_grad():
        base_logits = base(**batch).logits
    model = peft.PeftModel.from_pretrained(base, out / "final")
    model.eval()
    merged = hf_model(out / "final-merged")
    with torch.no_grad():
        theirs = model(**batch).logits
        ours = merged(**batch).logits
    real = real_positions(config, batch)
    assert (theirs[real] - base_logits[real]).abs().max() > MIN_EFFECT, "training changed nothing"
    # Both sides run in transformers; they differ only by W + s*B@A summed into one fp32 weight or applied apart.
    # With this large adapter (lr 0.05, alpha 64) that rounding reaches ~1e-5 of the logits' scale (1.4e-4 on logits
    # of ~12 was seen): the bound is relative to that scale, far below MIN_EFFECT.
    scale = theirs[real].abs().max().item()
    torch.testing.assert_close(ours[real], theirs[real], atol=2e-5 * max(scale, 1.0), rtol=1e-4)


# The decoder families (test_models.FAMILIES): every linear layer of the family under LoRA, with transformers'
# (and so PEFT's) names: Phi-3's fused qkv_proj and gate_up_proj, the q/k norms and the extra norms untouched.
FAMILY_TARGETS = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                  # Mixtures of experts: the attention (the experts are not PEFT modules in transformers 5: they are
                  # target_parameters, tested below).
                  **{t: ["q_proj", "k_proj", "v_proj", "o_proj"] for t in ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe")}}
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_peft_loads_our_adapter_of_each_decoder_family(name, tmp_path, parity_tool):
    model_dir = make_model_dir(name, tmp_path / "model")
    config, batch = batch_for(model_dir, tmp_path)
    targets = FAMILY_TARGETS.get(config.model_type, LLAMA_TARGETS)
    # Granite's multipliers (residual 0.5, logits / 2) damp what three steps change: a larger step shows it.
    lr = 8.0 if config.model_type == "granite" else 2.0
    settings = {"r": 4, "alpha": 8, "rslora": False, "target_modules": targets, "steps": 3, "lr": lr, "seed": 3}
    ours, base_logits, model = train_ours_load_in_peft(parity_tool, model_dir, batch, tmp_path, settings)
    assert set(model.peft_config["default"].target_modules) == set(targets)
    with torch.no_grad():
        theirs = model(**batch).logits
    real = real_positions(config, batch)
    assert (theirs[real] - base_logits[real]).abs().max() > MIN_EFFECT, "the adapter changes nothing"
    tolerance_close(ours[real], theirs[real])


@pytest.mark.parametrize("name", ["phi3-partial-longrope", "gemma2-softcaps", "qwen3-headdim-untied"])
def test_we_load_a_peft_adapter_of_a_decoder_family(name, tmp_path, parity_tool):
    model_dir = make_model_dir(name, tmp_path / "model")
    config, batch = batch_for(model_dir, tmp_path)
    base = hf_model(model_dir)
    lora = peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=FAMILY_TARGETS.get(
        config.model_type, LLAMA_TARGETS))
    model = peft.get_peft_model(base, lora)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "lora_" in param_name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    model.save_pretrained(tmp_path / "adapter")
    model.eval()
    run_parity_tool(parity_tool, "lora-forward", model_dir, tmp_path / "adapter", tmp_path / "batch.safetensors",
                    tmp_path / "ours.safetensors")
    ours = load_file(tmp_path / "ours.safetensors")
    theirs = model(**batch)
    real = real_positions(config, batch)
    tolerance_close(ours["logits"][real], theirs.logits.detach()[real])
    tolerance_close(ours["loss"][0], theirs.loss.detach())


# LoRA on a mixture of experts' experts: PEFT's target_parameters over transformers 5's stacked parameters (its
# ParamWrapper: lora_A (r * E, in), lora_B (out, r * E), gate_up_proj's nested under down_proj's "base_layer"), beside
# the attention's target_modules. Each family of test_models.FAMILIES with experts (a dense layer among sparse ones,
# Mixtral's names, Qwen2-MoE's shared expert, OLMoE).
MOE = ["qwen3-moe-dense-layer", "mixtral-sliding", "qwen2-moe-shared-expert", "olmoe-clip-qkv"]
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def lora_keys(model):
    """The PEFT model's LoRA weights under their saved names (no adapter name, no base_model.model. prefix)."""
    return {n[len("base_model.model."):].replace(".default.", "."): p for n, p in model.named_parameters()
            if "lora_" in n}


def peft_expert_adapter(model_dir, adapter_dir, parameters=EXPERT_PARAMETERS):
    """A PEFT adapter on the attention and the experts, every weight random (B too), rsLoRA; the PEFT model."""
    base = hf_model(model_dir)
    config = peft.LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4, lora_dropout=0.0, use_rslora=True,
                             target_modules=["q_proj", "v_proj"], target_parameters=parameters)
    return random_peft_adapter(base, config, adapter_dir)


@pytest.mark.parametrize("name", MOE)
def test_peft_loads_our_expert_adapter_and_reproduces_our_logits(name, tmp_path, parity_tool):
    model_dir = make_model_dir(name, tmp_path / "model")
    config, batch = batch_for(model_dir, tmp_path)
    settings = {"r": 2, "alpha": 16, "target_modules": ["q_proj"], "target_parameters": EXPERT_PARAMETERS,
                "steps": 3, "lr": 10.0, "seed": 3}
    ours, base_logits, model = train_ours_load_in_peft(parity_tool, model_dir, batch, tmp_path, settings)
    assert set(model.peft_config["default"].target_parameters) == set(EXPERT_PARAMETERS)
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert {k[len("base_model.model."):] for k in saved} == set(lora_keys(model))
    sparse = [n for n in lora_keys(model) if ".mlp.experts.base_layer.lora_A" in n]
    assert sparse and len(sparse) == len([n for n in lora_keys(model) if ".mlp.experts.lora_A" in n])
    # The experts trained: every B moved from zero.
    for key in saved:
        if ".experts." in key and key.endswith("lora_B.weight"):
            assert saved[key].abs().max() > 0, key
    with torch.no_grad():
        theirs = model(**batch).logits
    real = real_positions(config, batch)
    assert (theirs[real] - base_logits[real]).abs().max() > MIN_EFFECT, "the adapter changes nothing"
    tolerance_close(ours[real], theirs[real])
    # The experts' part alone changes the logits too (the attention's adapters off, PEFT's experts' on).
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, peft.tuners.lora.Linear):
                module.lora_B["default"].weight.zero_()
        experts_only = model(**batch).logits
    assert (experts_only[real] - base_logits[real]).abs().max() > MIN_EFFECT, "the experts' adapters change nothing"


@pytest.mark.parametrize("name", ["qwen3-moe-dense-layer", "mixtral-sliding"])
def test_we_load_a_peft_expert_adapter_and_reproduce_its_logits_loss_and_gradients(name, tmp_path, parity_tool):
    model_dir = make_model_dir(name, tmp_path / "model")
    model, ours = peft_adapter_forward_both_ways(
        model_dir, lambda: peft_expert_adapter(model_dir, tmp_path / "adapter"), tmp_path, parity_tool)
    expected = {n: p.grad for n, p in lora_keys(model).items()}
    grads = {n[len("grad.base_model.model."):]: g for n, g in ours.items() if n.startswith("grad.")}
    assert set(grads) == set(expected)
    assert any(".experts.base_layer." in n for n in grads)
    for param_name, grad in grads.items():
        tolerance_close(grad, expected[param_name], msg=lambda m, n=param_name: f"gradient of {n}: {m}")


@pytest.mark.parametrize("parameters", [EXPERT_PARAMETERS, ["down_proj"]])
def test_our_merge_of_an_expert_adapter_loads_in_transformers(parameters, tmp_path, run_trainer):
    model_dir = make_model_dir("qwen2-moe-shared-expert", tmp_path / "model")
    config, batch = batch_for(model_dir, tmp_path)
    model = peft_expert_adapter(model_dir, tmp_path / "adapter", parameters)
    with torch.no_grad():
        adapted = model(**batch).logits
    run_trainer("merge", "--adapter", tmp_path / "adapter", "--base", model_dir, "--output", tmp_path / "merged")
    merged = hf_model(tmp_path / "merged")
    with torch.no_grad():
        ours = merged(**batch).logits
    real = real_positions(config, batch)
    tolerance_close(ours[real], adapted[real])
    # The same weights PEFT's own merge gives, under the files' per-expert names.
    theirs = checkpoint_names(model.merge_and_unload().state_dict(), config)
    written = load_file(tmp_path / "merged" / "model.safetensors")
    assert set(written) == set(theirs)
    for key, value in written.items():
        tolerance_close(value, theirs[key], msg=lambda m, k=key: f"{k}: {m}")


def test_a_lora_training_run_on_the_experts_writes_an_adapter_peft_loads_and_a_merged_model(tmp_path, run_trainer):
    """The real binary: micro-batches of two with activation checkpointing (the experts' hooks recomputed), the
    adapter saved with target_parameters, and --merge's model equal to PEFT's adapted logits."""
    from test_family_training import examples  # pre-tokenized records of a few lengths, prompts masked
    model_dir = make_model_dir("qwen3-moe-dense-layer", tmp_path / "model")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in examples()))
    out = tmp_path / "run"
    config = {
        "model": {"path": str(model_dir), "init": "pretrained"},
        "data": {"train_files": [str(data)], "max_length": 32},
        "training": {"batch_size": 4, "micro_batch_size": 2, "max_steps": 3, "seed": 1,
                     "activation_checkpointing": True},
        "optimizer": {"name": "adamw", "lr": 0.05},
        "precision": {"mode": "fp32"},
        "device": {"type": "cpu"},
        "lora": {"enabled": True, "r": 2, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"],
                 "target_parameters": EXPERT_PARAMETERS},
        "checkpoint": {"output_dir": str(out), "every_steps": 0},
        "logging": {"progress": "off"},
    }
    (tmp_path / "run.json").write_text(json.dumps(config))
    result = run_trainer("--config", tmp_path / "run.json", "--merge")
    assert "experts' stacked parameters" in result.stderr + result.stdout
    adapter_config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert adapter_config["target_parameters"] == EXPERT_PARAMETERS and adapter_config["lora_dropout"] == 0
    hf_config, batch = batch_for(model_dir, tmp_path)
    base = hf_model(model_dir)
    with torch.no_grad():
        base_logits = base(**batch).logits
    model = peft.PeftModel.from_pretrained(base, out / "final")
    model.eval()
    with torch.no_grad():
        theirs = model(**batch).logits
        ours = hf_model(out / "final-merged")(**batch).logits
    real = real_positions(hf_config, batch)
    assert (theirs[real] - base_logits[real]).abs().max() > MIN_EFFECT, "training changed nothing"
    scale = theirs[real].abs().max().item()
    torch.testing.assert_close(ours[real], theirs[real], atol=2e-5 * max(scale, 1.0), rtol=1e-4)
    # A dropout PEFT refuses on parameters is refused before training, naming the key and the fix.
    config["lora"]["dropout"] = 0.05
    (tmp_path / "bad.json").write_text(json.dumps(config))
    refused = run_trainer("--config", tmp_path / "bad.json", check=False)
    assert refused.returncode != 0 and "lora.dropout" in refused.stderr and "lora.dropout=0" in refused.stderr
