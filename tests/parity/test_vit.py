"""Our ViT (src/models/image/vit.cpp) against transformers' ViTForImageClassification on the same weights and images:
fp32 logits, loss and every gradient within 1e-4; position embeddings interpolated for another image size as
transformers' interpolate_pos_encoding; what we save loads in transformers with the same logits and classes.
The C++ side runs through build/trainer_vit_parity."""
import json
import os
import pathlib
import re
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4

CONFIGS = {
    # name: (config overrides, input height, input width)
    "tiny": ({}, 16, 16),
    "no-qkv-bias-8px-patches": ({"qkv_bias": False, "patch_size": 8, "image_size": 32, "layer_norm_eps": 1e-6,
                                 "num_labels": 7}, 32, 32),
    "interpolated-24x20": ({}, 24, 20),
    "gelu-tanh-two-classes-one-layer": ({"hidden_act": "gelu_pytorch_tanh", "num_labels": 2, "num_hidden_layers": 1},
                                        16, 16),
}


def vit_config(**overrides):
    from transformers import ViTConfig
    base = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, image_size=16,
                patch_size=4, num_channels=3, num_labels=5, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)
    base.update(overrides)
    return ViTConfig(**base)


@pytest.fixture(scope="session")
def vit_tool():
    binary = os.environ.get("TRAINER_BINARY", str(ROOT / "build" / "trainer"))
    path = pathlib.Path(binary).parent / "trainer_vit_parity"
    if not path.exists():
        pytest.fail(f"{path} does not exist: build first (cmake --build build)")
    return path


def run(tool, *args):
    result = subprocess.run([str(tool), *map(str, args)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"trainer_vit_parity {' '.join(map(str, args))}: {result.stderr}"


def make_batch(path, num_labels, height, width, batch=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(batch, 3, height, width, generator=generator)
    labels = torch.randint(0, num_labels, (batch,), generator=generator)
    save_file({"pixel_values": pixels.contiguous(), "labels": labels}, str(path))
    return pixels, labels


def hf_name(model, name):
    """The transformers parameter of a checkpoint name (transformers 5 renames the layers in memory)."""
    params = dict(model.named_parameters())
    if name in params:
        return name
    mapped = re.sub(r"vit\.encoder\.layer\.(\d+)\.", r"vit.layers.\1.", name)
    for old, new in ((".attention.attention.query.", ".attention.q_proj."),
                     (".attention.attention.key.", ".attention.k_proj."),
                     (".attention.attention.value.", ".attention.v_proj."),
                     (".attention.output.dense.", ".attention.o_proj."),
                     (".intermediate.dense.", ".mlp.fc1."), (".output.dense.", ".mlp.fc2.")):
        mapped = mapped.replace(old, new)
    assert mapped in params, f"no transformers parameter for {name} (tried {mapped})"
    return mapped


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp32_logits_loss_and_gradients_match_transformers(name, tmp_path, vit_tool):
    from transformers import ViTForImageClassification
    overrides, height, width = CONFIGS[name]
    torch.manual_seed(1)
    model = ViTForImageClassification(vit_config(**overrides)).eval()
    model.save_pretrained(tmp_path / "model")
    pixels, labels = make_batch(tmp_path / "batch.safetensors", model.config.num_labels, height, width)
    run(vit_tool, "forward", tmp_path / "model", tmp_path / "batch.safetensors", tmp_path / "out.safetensors")
    ours = load_file(str(tmp_path / "out.safetensors"))

    interpolate = (height, width) != (model.config.image_size,) * 2
    output = model(pixel_values=pixels, labels=labels, interpolate_pos_encoding=interpolate)
    output.loss.backward()
    assert torch.allclose(ours["logits"], output.logits.detach(), atol=TOLERANCE, rtol=0), \
        (ours["logits"] - output.logits).abs().max()
    assert abs(ours["loss"].item() - output.loss.item()) < TOLERANCE
    grads = {k[len("grad."):]: v for k, v in ours.items() if k.startswith("grad.")}
    params = dict(model.named_parameters())
    assert len(grads) == len(params), f"{len(grads)} gradients for {len(params)} parameters"
    for our_name, grad in grads.items():
        theirs = params[hf_name(model, our_name)].grad
        assert grad.shape == theirs.shape, our_name
        difference = (grad - theirs).abs().max().item()
        assert difference < TOLERANCE, f"{our_name}: gradient differs by {difference}"


def test_saved_model_reloads_in_transformers_with_the_same_logits(tmp_path, vit_tool):
    from transformers import ViTForImageClassification
    torch.manual_seed(2)
    ViTForImageClassification(vit_config()).save_pretrained(tmp_path / "model")
    pixels, _ = make_batch(tmp_path / "batch.safetensors", 5, 16, 16)
    run(vit_tool, "train-step", tmp_path / "model", tmp_path / "batch.safetensors", tmp_path / "out", 0.5)
    ours = load_file(str(tmp_path / "out" / "logits.safetensors"))["logits"]
    reloaded = ViTForImageClassification.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        theirs = reloaded(pixel_values=pixels).logits
    assert torch.allclose(ours, theirs, atol=TOLERANCE, rtol=0)
    before = ViTForImageClassification.from_pretrained(tmp_path / "model").eval()
    with torch.no_grad():
        assert not torch.allclose(before(pixel_values=pixels).logits, theirs, atol=1e-3), "the step changed nothing"


def test_backbone_checkpoint_gets_a_new_head_with_our_classes(tmp_path, vit_tool):
    """A ViTModel checkpoint (no "vit." prefix, a pooler, no classifier) loads with a new head for the given
    classes; the saved classifier has them as id2label/label2id and transformers loads it."""
    from transformers import ViTForImageClassification, ViTModel
    torch.manual_seed(3)
    backbone = ViTModel(vit_config())
    backbone.save_pretrained(tmp_path / "backbone")
    classes = ["circle-red", "square-green", "triangle-blue"]
    pixels, _ = make_batch(tmp_path / "batch.safetensors", len(classes), 16, 16)
    run(vit_tool, "train-step", tmp_path / "backbone", tmp_path / "batch.safetensors", tmp_path / "out", 0.0,
        ",".join(classes))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["id2label"] == {str(i): c for i, c in enumerate(classes)}
    assert config["label2id"] == {c: i for i, c in enumerate(classes)}
    reloaded = ViTForImageClassification.from_pretrained(tmp_path / "out").eval()
    assert reloaded.config.num_labels == 3
    with torch.no_grad():
        theirs = reloaded(pixel_values=pixels).logits
        # lr 0: the backbone is the checkpoint's, so transformers' ViTModel gives the same class-token features.
        features = backbone.eval()(pixel_values=pixels).last_hidden_state[:, 0]
        expected = features @ reloaded.classifier.weight.T + reloaded.classifier.bias
    ours = load_file(str(tmp_path / "out" / "logits.safetensors"))["logits"]
    assert torch.allclose(ours, theirs, atol=TOLERANCE, rtol=0)
    assert torch.allclose(theirs, expected, atol=TOLERANCE, rtol=0)


def test_predict_gives_transformers_probabilities(tmp_path, run_trainer):
    """`trainer predict` on demo images (JPEG, PNG, grayscale, palette, CMYK, EXIF-rotated): the top-k classes and
    probabilities of transformers' ViTImageProcessorPil + ViTForImageClassification on Pillow's decoding."""
    import sys
    from PIL import Image, ImageOps
    from transformers import ViTForImageClassification
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil
    images = tmp_path / "images"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_demo_images.py"), "--out", str(images),
                    "--classes", "6", "--per-class", "4", "--validation-per-class", "0"], check=True,
                   capture_output=True)
    classes = sorted(p.name for p in (images / "train").iterdir())
    files = sorted((images / "train").rglob("*.*"))
    torch.manual_seed(4)
    config = vit_config(image_size=32, patch_size=8, num_labels=len(classes))
    config.id2label = dict(enumerate(classes))
    config.label2id = {c: i for i, c in enumerate(classes)}
    model = ViTForImageClassification(config).eval()
    model.save_pretrained(tmp_path / "model")
    processor_config = {"image_processor_type": "ViTImageProcessor", "size": {"height": 32, "width": 32},
                        "resample": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    (tmp_path / "model" / "preprocessor_config.json").write_text(json.dumps(processor_config))
    processor = ViTImageProcessorPil(**{k: v for k, v in processor_config.items() if k != "image_processor_type"})
    args = ["predict", "--model", tmp_path / "model", "--top-k", 3, "--json"]
    for f in files:
        args += ["--image", f]
    lines = run_trainer(*args).stdout.strip().splitlines()
    assert len(lines) == len(files)
    for f, line in zip(files, lines):
        ours = json.loads(line)
        assert ours["image"] == str(f)
        with Image.open(f) as image:
            rgb = ImageOps.exif_transpose(image).convert("RGB")
        with torch.no_grad():
            logits = model(**processor(rgb, return_tensors="pt")).logits[0]
        probabilities = torch.softmax(logits, -1)
        top = torch.topk(probabilities, 3)
        assert [p["label"] for p in ours["predictions"]] == [classes[i] for i in top.indices.tolist()], f
        for p, q in zip(ours["predictions"], top.values.tolist()):
            assert abs(p["probability"] - q) < TOLERANCE, f
    # A bad image: exit 3 naming it.
    (tmp_path / "bad.jpg").write_bytes(b"not a jpeg")
    result = run_trainer("predict", "--model", tmp_path / "model", "--image", tmp_path / "bad.jpg", check=False)
    assert result.returncode == 3 and str(tmp_path / "bad.jpg") in result.stderr, result.stderr


def test_dropout_and_activation_checkpointing_apply_from_outside(tmp_path, vit_tool):
    """With dropout on (keyed masks), activation checkpointing installed from outside changes nothing: the same
    logits and gradients as without it; and dropout does act (the logits differ from evaluation mode)."""
    from transformers import ViTForImageClassification
    torch.manual_seed(6)
    ViTForImageClassification(vit_config(hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.2)).save_pretrained(
        tmp_path / "model")
    make_batch(tmp_path / "batch.safetensors", 5, 16, 16)
    outputs = {}
    for mode in (["train"], ["train", "checkpointing"], []):
        out = tmp_path / f"out-{'-'.join(mode) or 'eval'}.safetensors"
        run(vit_tool, "forward", tmp_path / "model", tmp_path / "batch.safetensors", out, *mode)
        outputs["-".join(mode) or "eval"] = load_file(str(out))
    plain, checkpointed = outputs["train"], outputs["train-checkpointing"]
    assert plain.keys() == checkpointed.keys()
    for key in plain:
        assert torch.allclose(plain[key], checkpointed[key], atol=1e-6, rtol=0), key
    assert not torch.allclose(plain["logits"], outputs["eval"]["logits"], atol=1e-3), "dropout did nothing"


def test_predict_without_processor_file_uses_the_model_size(tmp_path, run_trainer):
    """No preprocessor_config.json: ViTImageProcessor's defaults (bilinear, mean/std 0.5) at config.json's
    image_size, so the position embeddings need no interpolation."""
    from PIL import Image
    from transformers import ViTForImageClassification
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil
    torch.manual_seed(8)
    model = ViTForImageClassification(vit_config(image_size=24, patch_size=8, num_labels=3)).eval()
    model.save_pretrained(tmp_path / "model")
    rng = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (37, 53, 3), generator=rng, dtype=torch.uint8).numpy()
    Image.fromarray(pixels).save(tmp_path / "noise.png")
    ours = json.loads(run_trainer("predict", "--model", tmp_path / "model", "--image", tmp_path / "noise.png",
                                  "--json", "--top-k", 3).stdout)
    processor = ViTImageProcessorPil(size={"height": 24, "width": 24})
    with torch.no_grad():
        probabilities = torch.softmax(model(**processor(Image.fromarray(pixels), return_tensors="pt")).logits[0], -1)
    for p in ours["predictions"]:
        assert abs(p["probability"] - probabilities[p["id"]].item()) < TOLERANCE
