"""A multimodal checkpoint of a decoder family (Gemma 3: Gemma3ForConditionalGeneration, what Gemma-3-4B-it and
larger are; Gemma 4: Gemma4ForConditionalGeneration, every Gemma 4 release) trains its language model on text, and every other tensor (the vision tower, the projector) is carried
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


def make_gemma4(path, tie=True):
    """Gemma 4's text model with per-layer inputs and its last layer reusing layer 1's keys and values; the files
    name it model.language_model.* (transformers 5's own tree)."""
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=4, num_kv_shared_layers=1,
                hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, final_logit_softcapping=5.0,
                layer_types=["sliding_attention", "full_attention", "full_attention"])
    vision = transformers.Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                                       image_token_id=90, boi_token_id=91, eoi_token_id=92, video_token_id=93,
                                       boa_token_id=94, eoa_token_index=95, audio_token_id=89,
                                       tie_word_embeddings=tie)
    torch.manual_seed(1234)
    transformers.Gemma4ForConditionalGeneration(config).save_pretrained(path)
    return path


MAKE = {"gemma3": make_gemma3, "gemma4": make_gemma4}
CLASSES = {"gemma3": "Gemma3ForConditionalGeneration", "gemma4": "Gemma4ForConditionalGeneration"}
TEXT_PREFIX = {"gemma3": "language_model.", "gemma4": "model.language_model."}  # the text model's names in the files


def text_only_batch():
    """No image, video, audio or begin/end marker token (transformers gives those their own attention)."""
    batch = make_batch(False)
    for key in ("input_ids", "labels"):
        batch[key] = batch[key].masked_fill((batch[key] >= 89) & (batch[key] <= 95), 7)
    return batch


def text_logits(model_dir, batch, family="gemma3"):
    cls = getattr(transformers, CLASSES[family])
    model = cls.from_pretrained(model_dir, attn_implementation="eager")
    model.eval()
    assert type(model).__name__ == CLASSES[family]
    with torch.no_grad():
        return model(**batch).logits


def tensors(path):
    out = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            out[name] = f.get_tensor(name)
    return out


@pytest.mark.parametrize("family,tie", [("gemma3", True), ("gemma3", False), ("gemma4", True)])
def test_a_multimodal_gemma_trains_its_text_and_carries_the_towers(family, tie, tmp_path, parity_tool):
    model_dir = MAKE[family](tmp_path / "model", tie)
    batch = text_only_batch()
    save_file(batch, tmp_path / "batch.safetensors")
    run_parity_tool(parity_tool, "forward", model_dir, tmp_path / "batch.safetensors", tmp_path / "ours.safetensors")
    real = batch["attention_mask"].bool()
    ours = load_file(tmp_path / "ours.safetensors")
    before = text_logits(model_dir, batch, family)
    torch.testing.assert_close(ours["logits"][real], before[real], atol=1e-4, rtol=1e-4)

    out = tmp_path / "stepped"
    run_parity_tool(parity_tool, "train-step", model_dir, tmp_path / "batch.safetensors", out, 0.5)
    after = text_logits(out, batch, family)
    stepped = load_file(out / "logits.safetensors")["logits"]
    assert not torch.allclose(after[real], before[real], atol=1e-3), "the step changed nothing"
    torch.testing.assert_close(stepped[real], after[real], atol=1e-4, rtol=1e-4)

    original, saved = tensors(model_dir), tensors(out)
    assert set(saved) == set(original)
    carried = [n for n in original if not n.startswith(TEXT_PREFIX[family]) or n.endswith("layer_scalar")]
    assert any("vision_tower." in n for n in carried)
    assert any("projector" in n or "embed_vision" in n for n in carried)
    for name in carried:
        assert saved[name].dtype == original[name].dtype and torch.equal(saved[name], original[name]), name
    assert json.loads((out / "config.json").read_text())["model_type"] == family


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_peft_loads_our_lora_adapter_of_a_multimodal_gemma(family, tmp_path, parity_tool):
    """PEFT's names for the language model's layers (base_model.model.model.language_model...), the vision tower's
    projections of the same names left alone."""
    import peft
    model_dir = MAKE[family](tmp_path / "model")
    batch = text_only_batch()
    save_file(batch, tmp_path / "batch.safetensors")
    settings = {"r": 4, "alpha": 8, "rslora": False, "target_modules": ["q_proj", "v_proj", "down_proj"], "steps": 3,
                "lr": 2.0, "seed": 3}
    run_parity_tool(parity_tool, "lora-train", model_dir, tmp_path / "batch.safetensors", tmp_path / "adapter",
                    json.dumps(settings))
    ours = load_file(tmp_path / "adapter" / "logits.safetensors")["logits"]
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved and all(k.startswith("base_model.model.model.language_model.layers.") for k in saved), list(saved)
    base = getattr(transformers, CLASSES[family]).from_pretrained(model_dir, attn_implementation="eager")
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
