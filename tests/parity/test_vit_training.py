"""Image-classification training end to end: `trainer --config configs/tiny-vit.json` trains the tiny ViT on the
demo images, and what it saves is a directory transformers loads (ViTForImageClassification.from_pretrained,
ViTImageProcessor.from_pretrained) with the same logits as ours, the classes in id2label/label2id, and the
evaluation's loss, top-1 and top-5 accuracy recomputed by transformers on the validation images."""
import json
import os
import pathlib
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = pathlib.Path(__file__).resolve().parents[2]
VALIDATION = ROOT / "data" / "demo" / "images" / "validation"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, trainer_binary):
    out = tmp_path_factory.mktemp("tiny-vit")
    result = subprocess.run([str(trainer_binary), "--config", "configs/tiny-vit.json", "--set",
                             f"checkpoint.output_dir={out}", "--set", "training.epochs=3", "--set",
                             "checkpoint.every_steps=0"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return out, result


def validation_images():
    from PIL import Image
    classes = sorted(p.name for p in VALIDATION.iterdir() if p.is_dir())
    images, labels = [], []
    for label, name in enumerate(classes):
        for path in sorted((VALIDATION / name).iterdir()):
            image = Image.open(path)
            from PIL import ImageOps
            images.append(ImageOps.exif_transpose(image).convert("RGB"))
            labels.append(label)
    return classes, images, torch.tensor(labels)


def test_saved_classifier_loads_in_transformers_with_our_logits_and_classes(trained, tmp_path):
    from transformers import ViTForImageClassification
    out, _ = trained
    final = out / "final"
    config = json.loads((final / "config.json").read_text())
    classes = sorted(p.name for p in VALIDATION.iterdir() if p.is_dir())
    assert config["id2label"] == {str(i): c for i, c in enumerate(classes)}
    assert config["label2id"] == {c: i for i, c in enumerate(classes)}
    assert (final / "preprocessor_config.json").exists()
    model = ViTForImageClassification.from_pretrained(final).eval()
    assert model.config.num_labels == len(classes)
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(4, 3, 32, 32, generator=generator)
    save_file({"pixel_values": pixels, "labels": torch.zeros(4, dtype=torch.long)}, str(tmp_path / "batch.safetensors"))
    tool = pathlib.Path(os.environ.get("TRAINER_BINARY", str(ROOT / "build" / "trainer"))).parent / "trainer_vit_parity"
    subprocess.run([str(tool), "forward", str(final), str(tmp_path / "batch.safetensors"),
                    str(tmp_path / "ours.safetensors")], check=True, capture_output=True, timeout=300)
    ours = load_file(str(tmp_path / "ours.safetensors"))["logits"]
    with torch.no_grad():
        theirs = model(pixel_values=pixels).logits
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (ours - theirs).abs().max()


def test_evaluation_metrics_are_what_transformers_computes(trained):
    """The last evaluation (at the last step, on the final weights) against transformers' image processor and model
    on the same validation images: loss within 1e-3 (our resize is within one grey level of Pillow's), top-1 and
    top-5 exactly, and the model learned (top-1 well above chance)."""
    from transformers import ViTForImageClassification, ViTImageProcessor
    out, result = trained
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_top1" in r]
    assert evals, "no evaluation in metrics.jsonl"
    last = evals[-1]
    assert last["step"] == max(r["step"] for r in records)
    classes, images, labels = validation_images()
    assert last["eval_images"] == len(images)
    processor = ViTImageProcessor.from_pretrained(out / "final")
    model = ViTForImageClassification.from_pretrained(out / "final").eval()
    with torch.no_grad():
        logits = model(pixel_values=processor(images, return_tensors="pt")["pixel_values"]).logits
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    top1 = (logits.argmax(1) == labels).float().mean().item()
    top5 = (logits.topk(min(5, logits.shape[1]), 1).indices == labels[:, None]).any(1).float().mean().item()
    assert abs(last["eval_loss"] - loss) < 1e-3
    assert abs(last["eval_top1"] - top1) < 1e-6
    assert abs(last["eval_top5"] - top5) < 1e-6
    assert top1 > 0.4, f"top-1 {top1} after training: chance is {1 / len(classes)}"
    assert "top-1" in result.stderr + result.stdout


def test_lora_adapter_with_the_head_in_modules_to_save_loads_in_peft(tmp_path, trainer_binary):
    """lora.enabled=true: adapters on query/value and the head trained in full, saved as a PEFT adapter whose head
    is in modules_to_save. peft.PeftModel.from_pretrained on transformers' classifier (the saved random base) loads
    it, and its loss and accuracy on the validation images are the last evaluation's (on the final weights); the
    adapter changed the base's predictions."""
    from peft import PeftModel
    from transformers import ViTForImageClassification, ViTImageProcessor
    out = tmp_path / "lora"
    result = subprocess.run([str(trainer_binary), "--config", "configs/tiny-vit.json", "--set",
                             f"checkpoint.output_dir={out}", "--set", "training.epochs=3", "--set",
                             "checkpoint.every_steps=0", "--set", "lora.enabled=true", "--set", "lora.r=4",
                             "--set", "lora.target_modules=[\"query\",\"value\",\"output.dense\"]",
                             "--set", "optimizer.lr=5e-3"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["classifier"]
    assert sorted(config["target_modules"]) == ["fc2", "o_proj", "q_proj", "v_proj"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "eval_top1" in r][-1]
    classes, images, labels = validation_images()
    processor = ViTImageProcessor.from_pretrained(out / "final")
    pixels = processor(images, return_tensors="pt")["pixel_values"]
    base = ViTForImageClassification.from_pretrained(out / "base").eval()
    with torch.no_grad():
        base_logits = base(pixel_values=pixels).logits.clone()
    model = PeftModel.from_pretrained(base, out / "final").eval()
    with torch.no_grad():
        logits = model(pixel_values=pixels).logits
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    top1 = (logits.argmax(1) == labels).float().mean().item()
    assert abs(last["eval_loss"] - loss) < 1e-3, (last, loss)
    assert abs(last["eval_top1"] - top1) < 1e-6
    assert not torch.allclose(base_logits, logits, atol=1e-3), "the adapter changed nothing"


def test_clip_vision_classifier_trains_and_transformers_agrees(tmp_path, trainer_binary):
    """The CLIP vision tower as an image classifier (issue 20): a CLIPVisionModel directory (what a CLIP checkpoint's
    vision half is) trains through the same command with a new head for the demo classes; the result loads in
    transformers' CLIPForImageClassification, whose loss and accuracy on the validation images, preprocessed by
    CLIPImageProcessor, are the last evaluation's."""
    from transformers import CLIPForImageClassification, CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel
    torch.manual_seed(0)
    base = tmp_path / "clip-vision"
    config = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=32, patch_size=8, hidden_act="quick_gelu")
    CLIPVisionModel(config).save_pretrained(base)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(base)
    out = tmp_path / "run"
    result = subprocess.run([str(trainer_binary), "--config", "configs/tiny-vit.json", "--set", f"model.path={base}",
                             "--set", "model.init=pretrained", "--set", f"checkpoint.output_dir={out}", "--set",
                             "training.epochs=3", "--set", "checkpoint.every_steps=0"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "eval_top1" in r][-1]
    classes, images, labels = validation_images()
    model = CLIPForImageClassification.from_pretrained(out / "final").eval()
    assert model.config.id2label == {i: c for i, c in enumerate(classes)}
    processor = CLIPImageProcessor.from_pretrained(out / "final")
    with torch.no_grad():
        logits = model(pixel_values=processor(images, return_tensors="pt")["pixel_values"]).logits
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    top1 = (logits.argmax(1) == labels).float().mean().item()
    assert abs(last["eval_loss"] - loss) < 1e-3, (last, loss)
    assert abs(last["eval_top1"] - top1) < 1e-6
    assert top1 > 1 / len(classes), f"top-1 {top1} after training: chance is {1 / len(classes)}"


@pytest.mark.parametrize("source", ["clip", "clip_vision"])
def test_clip_classifier_lora_adapter_loads_in_peft(tmp_path, trainer_binary, source):
    """lora.enabled=true on the CLIP vision classifier, from a CLIPModel checkpoint (what CLIP checkpoints are) or a
    CLIPVisionModel directory (then the classifier is saved to output_dir/base and the adapter points there):
    adapters on CLIP's q_proj/v_proj by default (PEFT's names in CLIPForImageClassification) and the new head
    trained in full in modules_to_save. peft.PeftModel.from_pretrained on transformers' CLIPForImageClassification
    of the same base (with the run's classes) loads it, and its loss and accuracy on the validation images,
    preprocessed by CLIPImageProcessor, are the last evaluation's; the adapter changed the base's logits."""
    from peft import PeftModel
    from transformers import CLIPConfig, CLIPForImageClassification, CLIPImageProcessor, CLIPModel, CLIPVisionModel
    torch.manual_seed(0)
    base = tmp_path / "clip"
    config = CLIPConfig(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=32, patch_size=8),
                        text_config=dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                         num_attention_heads=2, vocab_size=40, eos_token_id=39),
                        projection_dim=8)
    if source == "clip":
        CLIPModel(config).save_pretrained(base)
    else:
        CLIPVisionModel(config.vision_config).save_pretrained(base)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(base)
    out = tmp_path / "run"
    result = subprocess.run([str(trainer_binary), "--config", "configs/tiny-vit.json", "--set", f"model.path={base}",
                             "--set", "model.init=pretrained", "--set", f"checkpoint.output_dir={out}", "--set",
                             "training.epochs=3", "--set", "checkpoint.every_steps=0", "--set", "lora.enabled=true",
                             "--set", "lora.r=4", "--set", "optimizer.lr=5e-3"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    adapter = json.loads((out / "final" / "adapter_config.json").read_text())
    assert adapter["modules_to_save"] == ["classifier"]
    assert sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "eval_top1" in r][-1]
    classes, images, labels = validation_images()
    processor = CLIPImageProcessor.from_pretrained(out / "final")
    pixels = processor(images, return_tensors="pt")["pixel_values"]
    if source == "clip":
        assert adapter["base_model_name_or_path"] == str(base)
    else:
        assert adapter["base_model_name_or_path"] == str(out / "base")
        base = out / "base"
    model = CLIPForImageClassification.from_pretrained(base, id2label=dict(enumerate(classes)),
                                                       label2id={c: i for i, c in enumerate(classes)}).eval()
    with torch.no_grad():
        base_logits = model(pixel_values=pixels).logits.clone()
    model = PeftModel.from_pretrained(model, out / "final").eval()
    with torch.no_grad():
        logits = model(pixel_values=pixels).logits
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    top1 = (logits.argmax(1) == labels).float().mean().item()
    assert abs(last["eval_loss"] - loss) < 1e-3, (last, loss)
    assert abs(last["eval_top1"] - top1) < 1e-6
    assert not torch.allclose(base_logits, logits, atol=1e-3), "the adapter changed nothing"
