"""QLoRA (model.quantize) against transformers + bitsandbytes 0.50.2 + PEFT themselves, on the CPU.

bitsandbytes runs 4-bit layers on the CPU: its gemm_4bit dequantizes the weight to the input's dtype and calls an
ordinary linear, and MatMul4Bit's backward multiplies by the dequantized weight again: what trainer's Linear4bit does.
Quantization itself is bit for bit bitsandbytes' (tests/parity/test_quantization.py), so the 4-bit weights are the
same bits on both sides and fp32 results differ only by summation order: within 1e-4 absolute + 1e-4 relative, as
the model and LoRA parity tests. Two things bitsandbytes does differently on an AVX-512 CPU are undone on the
reference side (bnb_reference.py): its CPU library decodes weights whose rows are not whole blocks wrongly (the
definition replaces it there, so both sides compute with the format's values), and with AVX512-BF16 its inference
repacks weights for a bf16 GEMM (kept on the dequantize-and-matmul path).

(a) 4-bit forward (NF4 and FP4, with and without double quantization): trainer's logits equal transformers'
    load_in_4bit model's, and quantization changes the logits by far more than the tolerance;
(b) a few SGD steps of LoRA on every linear layer over the 4-bit base, from the same adapter: losses and adapter
    weights equal PEFT's over bitsandbytes' Linear4bit (a mixture of experts: on its 4-bit experts too);
(c) `trainer quantize` writes the tensors transformers + bitsandbytes save, byte for byte, and transformers loads
    the directory with the same logits; trainer loads a directory transformers saved in 4 bits with its logits;
(d) `trainer merge --quantize nf4` and a QLoRA training run with --merge give full-precision models with PEFT's
    adapted logits over the 4-bit base.
"""
import json
import os

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import bitsandbytes.functional as bnb_functional

from bnb_reference import definition, plain_linear4bit, reference_cpu_kernels
from test_models import MODELS, make_batch, make_model_dir, parity_tool, real_positions, run_parity_tool  # noqa: F401

NAMES = ["qwen2-gqa-tied", "llama", "flan-gated-gelu-untied"]
TARGETS = {"qwen2-gqa-tied": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "flan-gated-gelu-untied": ["q", "k", "v", "o", "wi_0", "wi_1", "wo"],
           # A decoder family whose 4-bit layers are fused projections (Phi-3's qkv_proj and gate_up_proj); the other
           # families quantize the same Linear layers (checked once: Gemma 2 and Qwen3 passed too, 50 s each); Gemma 4
           # adds its per-layer input projections.
           "phi3-partial-longrope": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
           "gemma4-shared-kv-ple": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           # A mixture of experts: LoRA on the attention and on the experts (PARAMETERS), which are 4-bit too
           # (below); its router is not.
           "qwen3-moe-dense-layer": ["q_proj", "k_proj", "v_proj", "o_proj"]}
# PEFT's target_parameters: the experts' stacked parameters, adapted over their 4-bit values.
PARAMETERS = {"qwen3-moe-dense-layer": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
FAMILY_NAMES = ["phi3-partial-longrope", "gemma4-shared-kv-ple", "qwen3-moe-dense-layer"]
MIN_EFFECT = 1e-3
LR = 0.3


def close(ours, theirs, msg=None):
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4, msg=msg)


def model_class(path):
    config = transformers.AutoConfig.from_pretrained(path)
    return config, (transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder
                    else transformers.AutoModelForCausalLM)


def bnb_model(path, quant_type="nf4", double_quant=True, experts_in_4bit=True):
    """transformers' load_in_4bit model: quantized on load when `path` is full precision, as saved otherwise; a
    mixture of experts' experts with trainer's 4-bit values (four_bit_experts) unless told not to."""
    reference_cpu_kernels()
    config, cls = model_class(path)
    kwargs = {}
    if not hasattr(config, "quantization_config"):
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double_quant,
            bnb_4bit_compute_dtype=torch.float32)
    model = cls.from_pretrained(path, dtype=torch.float32, device_map="cpu", attn_implementation="eager", **kwargs)
    model.eval()
    if "quantization_config" in kwargs and experts_in_4bit:
        four_bit_experts(model, quant_type, double_quant)
    return plain_linear4bit(model)


def four_bit_experts(model, quant_type, double_quant):
    """transformers' bitsandbytes integration keeps a mixture of experts' experts (3D parameters) in full precision;
    QLoRA in trainer holds them in 4 bits too (they are most of the weights), each expert's gate, up and down
    projection quantized as its own tensor, as the files store them. The reference's experts become those 4-bit
    weights' values: bitsandbytes' quantization of each, decoded by the format's definition."""
    def four_bit(w):
        packed, state = bnb_functional.quantize_4bit(w.contiguous(), blocksize=64, quant_type=quant_type,
                                                     compress_statistics=double_quant)
        return definition(packed, state)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("experts.gate_up_proj"):
                half = p.shape[1] // 2
                for e in range(p.shape[0]):
                    p[e] = torch.cat([four_bit(p[e, :half]), four_bit(p[e, half:])])
            elif name.endswith("experts.down_proj"):
                for e in range(p.shape[0]):
                    p[e] = four_bit(p[e])


def full_model(path):
    _, cls = model_class(path)
    model = cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return model


def bnb_logits(model, batch):
    # With gradients on: bitsandbytes' dequantize-and-matmul path whatever the CPU (see the module docstring).
    return model(**batch).logits.detach()


def our_run(parity_tool, model_dir, batch_path, out_dir, name, steps, lr=LR, **quantize):
    settings = {"r": 4, "alpha": 8, "target_modules": TARGETS[name], "target_parameters": PARAMETERS.get(name, []),
                "steps": steps, "lr": lr, "seed": 3, **quantize}
    run_parity_tool(parity_tool, "lora-train", model_dir, batch_path, out_dir, json.dumps(settings))
    return load_file(out_dir / "logits.safetensors")


def setup(name, tmp_path):
    model_dir = make_model_dir(name, tmp_path / "model")
    config = transformers.AutoConfig.from_pretrained(model_dir)
    batch = make_batch(config.is_encoder_decoder)
    save_file(batch, tmp_path / "batch.safetensors")
    return model_dir, config, batch


@pytest.mark.parametrize("quant_type,double_quant", [("nf4", True), ("fp4", True), ("nf4", False)])
@pytest.mark.parametrize("name", NAMES)
def test_4bit_logits_match_transformers_with_bitsandbytes(name, quant_type, double_quant, tmp_path, parity_tool):
    model_dir, config, batch = setup(name, tmp_path)
    # No steps: the adapter's B is zero, so these are the 4-bit base's logits.
    ours = our_run(parity_tool, model_dir, tmp_path / "batch.safetensors", tmp_path / "ours", name, 0,
                   quantize=quant_type, double_quant=double_quant)["logits"]
    theirs = bnb_logits(bnb_model(model_dir, quant_type, double_quant), batch)
    with torch.no_grad():
        full = full_model(model_dir)(**batch).logits
    real = real_positions(config, batch)
    assert (theirs[real] - full[real]).abs().max() > MIN_EFFECT, "4 bits change nothing: the test proves nothing"
    close(ours[real], theirs[real])


@pytest.mark.parametrize("name", NAMES + FAMILY_NAMES)
def test_qlora_steps_match_peft_over_bitsandbytes(name, tmp_path, parity_tool):
    model_dir, config, batch = setup(name, tmp_path)
    batch_path = tmp_path / "batch.safetensors"
    our_run(parity_tool, model_dir, batch_path, tmp_path / "start", name, 0, quantize="nf4")
    # Gemma 4 at random init is chaotic under SGD at 0.3: transformers' own run moves 1e-3 apart in two steps from a
    # perturbation of 4e-6 of the adapters (Qwen2's stays at 4e-6); two steps at 0.1 are tame enough to compare.
    gemma4 = config.model_type == "gemma4_text"
    steps, lr = (2, 0.1) if gemma4 else (3, LR)
    ours = our_run(parity_tool, model_dir, batch_path, tmp_path / "ours", name, steps, lr=lr, quantize="nf4")

    model = peft.PeftModel.from_pretrained(bnb_model(model_dir), tmp_path / "start", is_trainable=True)
    model.eval()  # no dropout, as trainer's tool runs
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        losses.append(loss.item())
        loss.backward()
        with torch.no_grad():
            for p in trainable.values():
                p -= lr * p.grad
                p.grad = None
    close(ours["losses"], torch.tensor(losses, dtype=torch.float64))
    assert losses[-1] < losses[0] - 1e-3, "training did not move the loss: the test proves nothing"
    saved = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    start = load_file(tmp_path / "start" / "adapter_model.safetensors")
    assert len(saved) == len(trainable)
    # Three SGD steps at lr 0.3 move the adapters by O(0.1). Qwen2 and Llama agree within 1e-4 after them. This tiny
    # T5 (unscaled attention) amplifies fp32 reduction-order differences through training: plain LoRA on the
    # full-precision model, no quantization anywhere, ends 3.9e-4 apart on the logits after the same three steps
    # (measured against PEFT), so T5 is compared at 1e-3 after training, far below the movement.
    # Gemma 4's adapters agree within 1e-4 after its two steps, its logits within 3.5e-4 (the same sensitivity):
    # the T5 bound.
    atol = 1e-3 if config.is_encoder_decoder or gemma4 else 1e-4
    moved = max((p.detach() - start[n.replace(".default.", ".")]).abs().max().item() for n, p in trainable.items())
    assert moved > (0.005 if gemma4 else 0.02), f"the adapters moved by {moved} only"
    for n, p in trainable.items():
        key = n.replace(".default.", ".")
        torch.testing.assert_close(saved[key], p.detach(), atol=atol, rtol=1e-3, msg=lambda m, k=key: f"{k}: {m}")
    with torch.no_grad():
        theirs = model(**batch).logits
    real = real_positions(config, batch)
    torch.testing.assert_close(ours["logits"][real], theirs[real], atol=atol, rtol=1e-4)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("name", ["qwen2-gqa-tied", "flan-gated-gelu-untied", "qwen3-moe-dense-layer"])
def test_trainer_quantize_writes_what_transformers_saves(name, quant_type, tmp_path, run_trainer):
    """A mixture of experts too: its experts and router stay in full precision, as transformers writes them."""
    model_dir, config, batch = setup(name, tmp_path)
    run_trainer("quantize", "--model", model_dir, "--output", tmp_path / "ours", "--type", quant_type)
    reference = bnb_model(model_dir, quant_type, experts_in_4bit=False)
    reference.save_pretrained(tmp_path / "theirs")
    ours, theirs = (load_file(tmp_path / d / "model.safetensors") for d in ("ours", "theirs"))
    assert set(ours) == set(theirs)
    assert any(k.endswith(f"quant_state.bitsandbytes__{quant_type}") for k in ours)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    loaded = bnb_model(tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["quantization_config"]["load_in_4bit"]
    real = real_positions(config, batch)
    torch.testing.assert_close(bnb_logits(loaded, batch)[real], bnb_logits(reference, batch)[real], atol=0, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_trainer_loads_a_4bit_model_transformers_saved(name, tmp_path, parity_tool):
    model_dir, config, batch = setup(name, tmp_path)
    reference = bnb_model(model_dir)
    reference.save_pretrained(tmp_path / "saved")
    ours = our_run(parity_tool, tmp_path / "saved", tmp_path / "batch.safetensors", tmp_path / "ours", name, 0)
    real = real_positions(config, batch)
    close(ours["logits"][real], bnb_logits(reference, batch)[real])


# A mixture of experts with adapters on its experts: they are merged over the 4-bit values they were trained on.
@pytest.mark.parametrize("name", ["qwen2-gqa-tied", "flan-gated-gelu-untied", "qwen3-moe-dense-layer"])
def test_merge_with_a_4bit_base_gives_peft_adapted_logits(name, tmp_path, run_trainer):
    model_dir, config, batch = setup(name, tmp_path)
    base = bnb_model(model_dir)
    task = "SEQ_2_SEQ_LM" if config.is_encoder_decoder else "CAUSAL_LM"
    model = peft.get_peft_model(base, peft.LoraConfig(task_type=task, r=4, lora_alpha=8, lora_dropout=0.0,
                                                      target_modules=TARGETS[name],
                                                      target_parameters=PARAMETERS.get(name)))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    model.save_pretrained(tmp_path / "adapter")
    model.eval()
    adapted = bnb_logits(model, batch)
    run_trainer("merge", "--adapter", tmp_path / "adapter", "--base", model_dir, "--quantize", "nf4", "--output",
                tmp_path / "merged")
    merged_config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in merged_config
    assert all(t.dtype == torch.float32 for t in load_file(tmp_path / "merged" / "model.safetensors").values())
    with torch.no_grad():
        ours = full_model(tmp_path / "merged")(**batch).logits
    real = real_positions(config, batch)
    with torch.no_grad():
        full = full_model(model_dir)(**batch).logits
    assert (adapted[real] - full[real]).abs().max() > MIN_EFFECT
    close(ours[real], adapted[real])


def test_a_qlora_training_run_writes_an_adapter_peft_loads_over_the_4bit_base(root, tmp_path, run_trainer):
    out = tmp_path / "run"
    run_trainer("--config", "configs/tiny-qwen2.json", "--set", "lora.enabled=true", "--set", "model.quantize=nf4",
                "--set", "lora.target_modules=" + json.dumps(TARGETS["qwen2-gqa-tied"]),
                "--set", "training.max_steps=6", "--set", "evaluation.every_steps=0", "--set",
                f"checkpoint.output_dir={out}", "--set", "lora.alpha=64", "--set", "optimizer.lr=0.05", "--merge")
    base_dir = json.loads((out / "final" / "adapter_config.json").read_text())["base_model_name_or_path"]
    # A random-weight base is saved as it was trained on: in 4 bits, which transformers loads as it is.
    assert json.loads((out / "base" / "config.json").read_text())["quantization_config"]["bnb_4bit_quant_type"] == "nf4"
    config = transformers.AutoConfig.from_pretrained(base_dir)
    batch = make_batch(config.is_encoder_decoder)
    base = bnb_model(base_dir)
    base_logits = bnb_logits(base, batch)
    model = peft.PeftModel.from_pretrained(base, out / "final")
    model.eval()
    theirs = bnb_logits(model, batch)
    with torch.no_grad():
        ours = full_model(out / "final-merged")(**batch).logits
    real = real_positions(config, batch)
    assert (theirs[real] - base_logits[real]).abs().max() > 1e-2, "training changed nothing"
    scale = theirs[real].abs().max().item()
    torch.testing.assert_close(ours[real], theirs[real], atol=2e-5 * max(scale, 1.0), rtol=1e-4)


def qlora_run(out, quant_type="nf4"):
    return ["--config", "configs/tiny-qwen2.json", "--set", "lora.enabled=true", "--set", f"model.quantize={quant_type}",
            "--set", "lora.target_modules=" + json.dumps(TARGETS["qwen2-gqa-tied"]), "--set", "training.max_steps=3",
            "--set", "evaluation.every_steps=0", "--set", "evaluation.sample_prompts=[]", "--set",
            f"checkpoint.output_dir={out}", "--set", "optimizer.lr=0.05"]


def kernels_line(stderr):
    return next(line.split("4-bit layers: ", 1)[1] for line in stderr.splitlines() if "4-bit layers: " in line)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_bitsandbytes_kernels_and_aten_ops_train_the_same_adapter(quant_type, tmp_path, run_trainer, monkeypatch):
    """4-bit layers dequantize with bitsandbytes' own CPU library, found beside torch in this environment, where its
    start-up check passed, or with ATen ops (TRAINER_BITSANDBYTES=none): the same values, so the same adapter, bit
    for bit."""
    import bitsandbytes
    found = run_trainer(*qlora_run(tmp_path / "library", quant_type))
    line = kernels_line(found.stderr)
    assert line.startswith("bitsandbytes' kernels from "), line
    # On an AVX-512 CPU the line goes on: "; ATen ops for weights with rows that are not whole blocks (...)".
    library = line.removeprefix("bitsandbytes' kernels from ").split("; ")[0]
    assert os.path.samefile(library, os.path.join(os.path.dirname(bitsandbytes.__file__), "libbitsandbytes_cpu.so"))
    monkeypatch.setenv("TRAINER_BITSANDBYTES", "none")
    aten = run_trainer(*qlora_run(tmp_path / "aten", quant_type))
    assert kernels_line(aten.stderr) == "ATen ops (TRAINER_BITSANDBYTES=none)"
    ours, theirs = (load_file(tmp_path / side / "final" / "adapter_model.safetensors") for side in ("library", "aten"))
    assert ours.keys() == theirs.keys() and ours
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_a_bitsandbytes_library_that_is_missing_or_lacks_a_function_is_named(tmp_path, run_trainer, monkeypatch):
    monkeypatch.setenv("TRAINER_BITSANDBYTES", str(tmp_path / "nowhere"))
    r = run_trainer(*qlora_run(tmp_path / "run"), check=False)
    assert r.returncode == 2, r.stderr
    assert f"TRAINER_BITSANDBYTES={tmp_path / 'nowhere'}: no bitsandbytes library" in r.stderr, r.stderr
    assert "bitsandbytes==0.50.2" in r.stderr and "TRAINER_BITSANDBYTES=none" in r.stderr, r.stderr
    # A shared library that is not bitsandbytes' (torch's own libc10): the first missing function is named.
    other = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    monkeypatch.setenv("TRAINER_BITSANDBYTES", other)
    r = run_trainer(*qlora_run(tmp_path / "run"), check=False)
    assert r.returncode == 2, r.stderr
    assert f"bitsandbytes' library {other} (TRAINER_BITSANDBYTES) has no function cdequantize_blockwise_cpu_nf4_fp32" \
        in r.stderr, r.stderr


def test_a_library_that_decodes_some_shapes_wrongly_serves_only_the_shapes_its_start_up_check_passed(
        trainer_binary, tmp_path, run_trainer, monkeypatch):
    """bitsandbytes 0.50.2's CPU library decodes weights whose rows are not whole blocks wrongly on an AVX-512 CPU.
    trainer checks each function it calls against the format's definition when it loads the library, and decodes
    what the library got wrong with ATen ops. On any CPU: a stand-in library with that fault
    (tests/parity/fake_bitsandbytes.cpp). In blocks of 128, tiny-qwen2's layers of 64 inputs are not whole blocks and
    its down_proj (128 inputs) is: the line names the fallback, and the adapter equals the ATen run's bit for bit
    (with the stand-in's values for the 64-input layers it would not: they use the first row's scales for every row)."""
    fake = trainer_binary.parent / "libtrainer_fake_bitsandbytes.so"
    assert fake.exists(), f"{fake} is missing: cmake --build build --target trainer_fake_bitsandbytes"
    args = qlora_run(tmp_path / "fake") + ["--set", "model.quantize_block_size=128"]
    monkeypatch.setenv("TRAINER_BITSANDBYTES", str(fake))
    line = kernels_line(run_trainer(*args).stderr)
    assert line.startswith(f"bitsandbytes' kernels from {fake}; ATen ops for weights with rows that are not whole "
                           "blocks (the library's start-up check: cdequantize_blockwise_cpu_"), line
    assert "rows of whole blocks" not in line, line
    monkeypatch.setenv("TRAINER_BITSANDBYTES", "none")
    run_trainer(*qlora_run(tmp_path / "aten") + ["--set", "model.quantize_block_size=128"])
    ours, theirs = (load_file(tmp_path / side / "final" / "adapter_model.safetensors") for side in ("fake", "aten"))
    assert ours.keys() == theirs.keys() and ours
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
