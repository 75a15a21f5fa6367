"""CLIP contrastive training end to end: `trainer --config configs/tiny-clip.json` trains the tiny CLIP on the demo
image-caption pairs; what it saves is a directory transformers loads (CLIPModel, CLIPProcessor) with our logits, and
the evaluation's loss, image->text and text->image recall@1/5/10 and zero-shot top-1 are what transformers' image
processor, tokenizer and model compute on the validation pairs."""
import json
import os
import pathlib
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEMO = ROOT / "data" / "demo" / "images"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, trainer_binary):
    out = tmp_path_factory.mktemp("tiny-clip")
    result = subprocess.run([str(trainer_binary), "--config", "configs/tiny-clip.json", "--set",
                             f"checkpoint.output_dir={out}", "--set", "training.epochs=4", "--set",
                             "checkpoint.every_steps=0"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return out, result


def test_saved_clip_loads_in_transformers_with_our_logits(trained, tmp_path):
    from transformers import AutoTokenizer, CLIPModel
    out, _ = trained
    final = out / "final"
    model = CLIPModel.from_pretrained(final).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    text = tokenizer(["a photo of a small red circle on the left", "a photo of a large blue triangle"],
                     padding=True, return_tensors="pt")
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    save_file({"pixel_values": pixels, "input_ids": text["input_ids"], "attention_mask": text["attention_mask"]},
              str(tmp_path / "batch.safetensors"))
    tool = pathlib.Path(os.environ.get("TRAINER_BINARY", str(ROOT / "build" / "trainer"))).parent / "trainer_clip_parity"
    subprocess.run([str(tool), "forward", str(final), str(tmp_path / "batch.safetensors"),
                    str(tmp_path / "ours.safetensors")], check=True, capture_output=True, timeout=300)
    ours = load_file(str(tmp_path / "ours.safetensors"))["logits_per_image"]
    with torch.no_grad():
        theirs = model(pixel_values=pixels, **text).logits_per_image
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (ours - theirs).abs().max()
    assert model.logit_scale.item() <= 4.605170185988092 + 1e-6  # clamped after every step


def transformers_features(model, directory, images, captions, classes):
    """Normalised image, caption and class-prompt embeddings of `model` (transformers, with the image processor and
    tokenizer saved in `directory`), and the evaluation loss: the mean over chunks of one training batch (16)."""
    from transformers import AutoTokenizer, CLIPImageProcessor
    processor = CLIPImageProcessor.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    with torch.no_grad():
        image = model.get_image_features(pixel_values=processor(images, return_tensors="pt")["pixel_values"])
        text = model.get_text_features(**tokenizer(captions, padding=True, return_tensors="pt"))
        prompts = model.get_text_features(**tokenizer([f"a photo of a {c}." for c in classes], padding=True,
                                                      return_tensors="pt"))
        image = getattr(image, "pooler_output", image)
        text = getattr(text, "pooler_output", text)
        prompts = getattr(prompts, "pooler_output", prompts)
        image = image / image.norm(dim=1, keepdim=True)
        text = text / text.norm(dim=1, keepdim=True)
        prompts = prompts / prompts.norm(dim=1, keepdim=True)
        scale = model.logit_scale.exp()
        loss, n = 0.0, len(captions)
        for begin in range(0, n, 16):
            logits = scale * image[begin:begin + 16] @ text[begin:begin + 16].T
            target = torch.arange(logits.shape[0])
            chunk = (torch.nn.functional.cross_entropy(logits, target) +
                     torch.nn.functional.cross_entropy(logits.T, target)) / 2
            loss += chunk.item() * logits.shape[0]
    return image, text, prompts, loss / n


def validation_pairs():
    from PIL import Image, ImageOps
    pairs = [json.loads(line) for line in (DEMO / "validation-captions.jsonl").read_text().splitlines()]
    images = [ImageOps.exif_transpose(Image.open(DEMO / p["image"])).convert("RGB") for p in pairs]
    return pairs, images, [p["caption"] for p in pairs], sorted({p["label"] for p in pairs})


def recall(scores, group, k):
    best = scores.topk(min(k, scores.shape[1]), 1).indices
    return sum(any(group[j] == group[i] for j in row.tolist()) for i, row in enumerate(best)) / scores.shape[0]


def test_evaluation_metrics_are_what_transformers_computes(trained):
    """The last evaluation (at the last step) against transformers on the same validation pairs: loss within 1e-3
    (our resize is within one grey level of Pillow's), recall and zero-shot accuracy exactly; and the model learned
    (text->image recall@10 above what chance gives)."""
    from transformers import CLIPModel
    out, result = trained
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_i2t_r1" in r]
    assert evals, "no evaluation in metrics.jsonl"
    last = evals[-1]
    assert last["step"] == max(r["step"] for r in records)
    pairs, images, captions, classes = validation_pairs()
    assert last["eval_pairs"] == len(pairs)
    labels = torch.tensor([classes.index(p["label"]) for p in pairs])
    final = out / "final"
    model = CLIPModel.from_pretrained(final).eval()
    image, text, prompts, loss = transformers_features(model, final, images, captions, classes)
    ids = {}
    group = [ids.setdefault(c, len(ids)) for c in captions]
    similarity = image @ text.T
    assert abs(last["eval_loss"] - loss) < 1e-3
    for k in (1, 5, 10):
        assert abs(last[f"eval_i2t_r{k}"] - recall(similarity, group, k)) < 1e-6, k
        assert abs(last[f"eval_t2i_r{k}"] - recall(similarity.T, group, k)) < 1e-6, k
    zero_shot = ((image @ prompts.T).argmax(1) == labels).float().mean().item()
    assert abs(last["eval_zero_shot_top1"] - zero_shot) < 1e-6
    assert last["eval_t2i_r10"] > 0.4, last
    assert "image->text R@1/5/10" in result.stderr + result.stdout


@pytest.mark.parametrize("lock_image_tower", [False, True])
def test_lora_adapter_loads_in_peft_and_gives_the_last_evaluation(tmp_path, trainer_binary, lock_image_tower):
    """lora.enabled=true with training.objective=contrastive: adapters on both towers (or the text tower alone when
    the image tower is locked), the rest frozen; final/ is a PEFT adapter whose base (the random tiny CLIP, saved to
    output_dir/base) transformers loads; PEFT on that base gives the last evaluation's loss (1e-3), and the adapter
    changed the base's embeddings."""
    from peft import PeftModel
    from transformers import CLIPModel
    out = tmp_path / "run"
    result = subprocess.run([str(trainer_binary), "--config", "configs/tiny-clip.json", "--set",
                             f"checkpoint.output_dir={out}", "--set", "training.epochs=3", "--set",
                             "checkpoint.every_steps=0", "--set", "lora.enabled=true", "--set", "lora.r=4", "--set",
                             "optimizer.lr=5e-3", "--set", f"contrastive.freeze_image_tower={str(lock_image_tower).lower()}"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    adapter = json.loads((out / "final" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(out / "base")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "eval_loss" in r][-1]
    pairs, images, captions, classes = validation_pairs()
    base = CLIPModel.from_pretrained(out / "base").eval()
    base_image, base_text, _, _ = transformers_features(base, out / "final", images, captions, classes)
    model = PeftModel.from_pretrained(base, out / "final").eval()
    image, text, _, loss = transformers_features(model, out / "final", images, captions, classes)
    assert abs(last["eval_loss"] - loss) < 1e-3, (last, loss)
    assert not torch.allclose(base_text, text, atol=1e-4), "the text adapters changed nothing"
    if lock_image_tower:
        assert torch.equal(base_image, image), "the locked image tower has no adapters"
        names = load_file(str(out / "final" / "adapter_model.safetensors")).keys()
        assert names and not any("vision_model" in k for k in names), sorted(names)
    else:
        assert not torch.allclose(base_image, image, atol=1e-4), "the image adapters changed nothing"
