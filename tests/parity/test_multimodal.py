"""A multimodal checkpoint of a decoder family (Gemma 3: Gemma3ForConditionalGeneration, what Gemma-3-4B-it and
larger are) trains its language model on text, and every other tensor (the vision tower, the projector) is carried
into the saved model unchanged: transformers loads the result as the original class, the text logits are
transformers' own (fp32, 1e-4) before and after a training step, and each non-text tensor is byte-identical."""
import json

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from test_models import make_batch, parity_tool, run_parity_tool  # noqa: F401 (fixture)

VOCAB = 96


def make_gemma3(path, tie=True):
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=4, layer_types=["sliding_attention",
                                                                                    "full_attention"],
                final_logit_softcapping=5.0)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=90, boi_token_index=91, eoi_token_index=92,
                                       tie_word_embeddings=tie)
    torch.manual_seed(1234)
    transformers.Gemma3ForConditionalGeneration(config).save_pretrained(path)
    return path


def text_logits(model_dir, batch):
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(model_dir, attn_implementation="eager")
    model.eval()
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    with torch.no_grad():
        return model(**batch).logits


def tensors(path):
    out = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            out[name] = f.get_tensor(name)
    return out


@pytest.mark.parametrize("tie", [True, False])
def test_gemma3_multimodal_trains_its_text_and_carries_the_towers(tie, tmp_path, parity_tool):
    model_dir = make_gemma3(tmp_path / "model", tie)
    batch = make_batch(False)
    # Text only: no image, begin-of-image or end-of-image token (transformers gives those their own attention).
    for key in ("input_ids", "labels"):
        batch[key] = batch[key].masked_fill((batch[key] >= 90) & (batch[key] <= 92), 7)
    save_file(batch, tmp_path / "batch.safetensors")
    run_parity_tool(parity_tool, "forward", model_dir, tmp_path / "batch.safetensors", tmp_path / "ours.safetensors")
    real = batch["attention_mask"].bool()
    ours = load_file(tmp_path / "ours.safetensors")
    before = text_logits(model_dir, batch)
    torch.testing.assert_close(ours["logits"][real], before[real], atol=1e-4, rtol=1e-4)

    out = tmp_path / "stepped"
    run_parity_tool(parity_tool, "train-step", model_dir, tmp_path / "batch.safetensors", out, 0.5)
    after = text_logits(out, batch)
    stepped = load_file(out / "logits.safetensors")["logits"]
    assert not torch.allclose(after[real], before[real], atol=1e-3), "the step changed nothing"
    torch.testing.assert_close(stepped[real], after[real], atol=1e-4, rtol=1e-4)

    original, saved = tensors(model_dir), tensors(out)
    assert set(saved) == set(original)
    carried = [n for n in original if not n.startswith("language_model.")]
    assert any(n.startswith("vision_tower.") for n in carried) and any("projector" in n for n in carried)
    for name in carried:
        assert saved[name].dtype == original[name].dtype and torch.equal(saved[name], original[name]), name
    assert json.loads((out / "config.json").read_text())["model_type"] == "gemma3"


def test_peft_loads_our_lora_adapter_of_the_multimodal_gemma3(tmp_path, parity_tool):
    """PEFT's names for the language model's layers (base_model.model.model.language_model...), the vision tower's
    projections of the same names left alone."""
    import peft
    model_dir = make_gemma3(tmp_path / "model")
    batch = make_batch(False)
    for key in ("input_ids", "labels"):
        batch[key] = batch[key].masked_fill((batch[key] >= 90) & (batch[key] <= 92), 7)
    save_file(batch, tmp_path / "batch.safetensors")
    settings = {"r": 4, "alpha": 8, "rslora": False, "target_modules": ["q_proj", "v_proj", "down_proj"], "steps": 3,
                "lr": 2.0, "seed": 3}
    run_parity_tool(parity_tool, "lora-train", model_dir, tmp_path / "batch.safetensors", tmp_path / "adapter",
                    json.dumps(settings))
    ours = load_file(tmp_path / "adapter" / "logits.safetensors")["logits"]
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved and all(k.startswith("base_model.model.model.language_model.layers.") for k in saved), list(saved)
    base = transformers.Gemma3ForConditionalGeneration.from_pretrained(model_dir, attn_implementation="eager")
    base.eval()
    with torch.no_grad():
        base_logits = base(**batch).logits
    model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    model.eval()
    adapted = {n for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert adapted and all(".language_model." in n for n in adapted), sorted(adapted)
    with torch.no_grad():
        theirs = model(**batch).logits
    real = batch["attention_mask"].bool()
    assert (theirs[real] - base_logits[real]).abs().max() > 1e-2, "the adapter changes nothing"
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-4, rtol=1e-4)
