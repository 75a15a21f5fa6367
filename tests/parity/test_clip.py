"""Our CLIP (src/models/image/clip.cpp) against transformers on the same weights and inputs: CLIPModel(return_loss=True)
logits, embeddings, loss and every gradient within 1e-4 (quick_gelu and gelu, positions interpolated for other
image sizes, legacy eos_token_id 2 pooling, several projection sizes); the vision classifier against
CLIPForImageClassification; what we save loads in transformers with the same logits; caption ids from our
tokenizer are CLIPTokenizer's and give transformers' text features. The C++ side runs through
build/trainer_clip_parity."""
import json
import os
import pathlib
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4
CLIP_TOKENIZER = ROOT / "tests" / "assets" / "tokenizers" / "clip-style"

VOCAB = 40
CONFIGS = {
    # name: (text overrides, vision overrides, top-level overrides, input height, input width)
    "quick-gelu": ({}, {}, {}, 12, 12),
    "gelu-interpolated-20x16": ({"hidden_act": "gelu"}, {"hidden_act": "gelu"}, {"projection_dim": 6}, 20, 16),
    "legacy-eos-2-patch-3-interpolated-15": ({"eos_token_id": 2, "layer_norm_eps": 1e-6},
                                             {"patch_size": 3, "image_size": 9, "layer_norm_eps": 1e-6},
                                             {"projection_dim": 16}, 15, 15),
    "one-layer-scale-at-cap": ({"num_hidden_layers": 1}, {"num_hidden_layers": 1, "hidden_act": "gelu_pytorch_tanh"},
                               {"projection_dim": 5, "logit_scale_init_value": 4.6052}, 12, 12),
}


def clip_config(text=None, vision=None, **top):
    from transformers import CLIPConfig
    text_config = dict(hidden_size=16, intermediate_size=24, num_attention_heads=2, num_hidden_layers=2,
                       vocab_size=VOCAB, max_position_embeddings=12, eos_token_id=VOCAB - 1, bos_token_id=0,
                       pad_token_id=1, attention_dropout=0.0)
    text_config.update(text or {})
    vision_config = dict(hidden_size=20, intermediate_size=28, num_attention_heads=2, num_hidden_layers=2,
                         image_size=12, patch_size=4, attention_dropout=0.0)
    vision_config.update(vision or {})
    base = dict(projection_dim=8)
    base.update(top)
    return CLIPConfig(text_config=text_config, vision_config=vision_config, **base)


@pytest.fixture(scope="session")
def clip_tool():
    binary = os.environ.get("TRAINER_BINARY", str(ROOT / "build" / "trainer"))
    path = pathlib.Path(binary).parent / "trainer_clip_parity"
    if not path.exists():
        pytest.fail(f"{path} does not exist: build first (cmake --build build)")
    return path


def run(tool, *args):
    result = subprocess.run([str(tool), *map(str, args)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"trainer_clip_parity {' '.join(map(str, args))}: {result.stderr}"


def make_batch(path, height, width, batch=4, seed=0, eos=VOCAB - 1, num_labels=None):
    """Pixels, right-padded captions of different lengths ending in the end-of-text id (the largest id, so the
    legacy argmax pooling finds it too), their attention mask, and class labels."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(batch, 3, height, width, generator=generator)
    length = 10
    ids = torch.full((batch, length), 1, dtype=torch.long)
    mask = torch.zeros(batch, length, dtype=torch.long)
    for i in range(batch):
        n = 3 + (i * 3) % (length - 2)
        ids[i, :n - 1] = torch.randint(3, VOCAB - 2, (n - 1,), generator=generator)
        ids[i, n - 1] = eos
        mask[i, :n] = 1
    tensors = {"pixel_values": pixels.contiguous(), "input_ids": ids, "attention_mask": mask}
    if num_labels:
        tensors["labels"] = torch.randint(0, num_labels, (batch,), generator=generator)
    save_file(tensors, str(path))
    return tensors


def compare_gradients(ours, model):
    grads = {k[len("grad."):]: v for k, v in ours.items() if k.startswith("grad.")}
    # Parameters the output does not depend on (the classifier's post_layernorm) have no gradient on either side.
    params = {name: p for name, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(params), set(grads) ^ set(params)
    for name, grad in grads.items():
        theirs = params[name].grad
        assert grad.shape == theirs.shape, name
        difference = (grad - theirs).abs().max().item()
        assert difference < TOLERANCE, f"{name}: gradient differs by {difference}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_clip_logits_loss_and_gradients_match_transformers(name, tmp_path, clip_tool):
    from transformers import CLIPModel
    text, vision, top, height, width = CONFIGS[name]
    torch.manual_seed(1)
    model = CLIPModel(clip_config(text, vision, **top)).eval()
    model.save_pretrained(tmp_path / "model")
    # The captions end in VOCAB - 1, the largest id: where legacy configs (eos_token_id 2) pool too.
    batch = make_batch(tmp_path / "batch.safetensors", height, width)
    run(clip_tool, "forward", tmp_path / "model", tmp_path / "batch.safetensors", tmp_path / "out.safetensors")
    ours = load_file(str(tmp_path / "out.safetensors"))

    interpolate = (height, width) != (model.config.vision_config.image_size,) * 2
    output = model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"],
                   attention_mask=batch["attention_mask"], return_loss=True, interpolate_pos_encoding=interpolate)
    output.loss.backward()
    for key in ("logits_per_image", "image_embeds", "text_embeds"):
        difference = (ours[key] - getattr(output, key).detach()).abs().max().item()
        assert difference < TOLERANCE, f"{key} differs by {difference}"
    assert abs(ours["loss"].item() - output.loss.item()) < TOLERANCE
    compare_gradients(ours, model)


def test_text_pooling_follows_the_eos_rule(tmp_path, clip_tool):
    """eos_token_id other than 2: the first end-of-text position, even when a larger id comes later (the legacy
    argmax would pick that one); the texts' embeddings of the two rules differ, so the test can fail."""
    from transformers import CLIPModel
    torch.manual_seed(5)
    model = CLIPModel(clip_config({"eos_token_id": 7})).eval()
    model.save_pretrained(tmp_path / "model")
    batch = make_batch(tmp_path / "batch.safetensors", 12, 12, eos=7)
    batch["input_ids"][:, -1] = VOCAB - 1  # a larger id after the first EOS (in the padding)
    save_file(batch, str(tmp_path / "batch.safetensors"))
    run(clip_tool, "forward", tmp_path / "model", tmp_path / "batch.safetensors", tmp_path / "out.safetensors")
    ours = load_file(str(tmp_path / "out.safetensors"))
    with torch.no_grad():
        theirs = model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"],
                       attention_mask=batch["attention_mask"]).text_embeds
        assert torch.allclose(ours["text_embeds"], theirs, atol=TOLERANCE, rtol=0)
        hidden = model.text_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        at_argmax = model.text_projection(hidden[torch.arange(4), batch["input_ids"].argmax(-1)])
        at_argmax = at_argmax / at_argmax.norm(dim=-1, keepdim=True)
        assert not torch.allclose(at_argmax, theirs, atol=1e-3)


def test_saved_clip_reloads_in_transformers_sharded(tmp_path, clip_tool):
    """One SGD step, saved in shards (a small shard limit), loads with CLIPModel.from_pretrained: same logits."""
    from transformers import CLIPModel
    torch.manual_seed(2)
    CLIPModel(clip_config()).save_pretrained(tmp_path / "model")
    batch = make_batch(tmp_path / "batch.safetensors", 12, 12)
    run(clip_tool, "train-step", tmp_path / "model", tmp_path / "batch.safetensors", tmp_path / "out", 0.5, 20000)
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    ours = load_file(str(tmp_path / "out" / "logits.safetensors"))["logits"]
    reloaded = CLIPModel.from_pretrained(tmp_path / "out").eval()
    inputs = {k: batch[k] for k in ("input_ids", "pixel_values", "attention_mask")}
    with torch.no_grad():
        theirs = reloaded(**inputs).logits_per_image
        before = CLIPModel.from_pretrained(tmp_path / "model").eval()(**inputs).logits_per_image
    assert torch.allclose(ours, theirs, atol=TOLERANCE, rtol=0)
    assert not torch.allclose(before, theirs, atol=1e-3), "the step changed nothing"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["CLIPModel"]


@pytest.mark.parametrize("height,width", [(12, 12), (16, 20)])
def test_classifier_matches_clip_for_image_classification(height, width, tmp_path, clip_tool):
    from transformers import CLIPForImageClassification
    torch.manual_seed(3)
    config = clip_config(vision={"hidden_act": "quick_gelu"})
    config.num_labels = 5
    model = CLIPForImageClassification(config).eval()
    model.save_pretrained(tmp_path / "model")
    batch = make_batch(tmp_path / "batch.safetensors", height, width, num_labels=5)
    run(clip_tool, "classify", tmp_path / "model", tmp_path / "batch.safetensors", tmp_path / "out.safetensors")
    ours = load_file(str(tmp_path / "out.safetensors"))
    interpolate = (height, width) != (12, 12)
    output = model(pixel_values=batch["pixel_values"], labels=batch["labels"], interpolate_pos_encoding=interpolate)
    output.loss.backward()
    assert torch.allclose(ours["logits"], output.logits.detach(), atol=TOLERANCE, rtol=0)
    assert abs(ours["loss"].item() - output.loss.item()) < TOLERANCE
    compare_gradients(ours, model)


@pytest.mark.parametrize("source", ["CLIPVisionModel", "CLIPVisionModelWithProjection", "CLIPModel"])
def test_backbones_get_a_new_head_and_save_a_classifier_transformers_loads(source, tmp_path, clip_tool):
    """A CLIPVisionModel (transformers 5 saves it without the vision_model. prefix), a
    CLIPVisionModelWithProjection or a whole CLIPModel loads as a classifier with a new head for our classes
    (text tower and projections ignored); the saved directory is a CLIPForImageClassification with id2label that
    transformers loads, giving our logits, which are its backbone's mean patch features through the head."""
    import transformers
    from transformers import CLIPForImageClassification, CLIPVisionConfig, CLIPVisionModel
    torch.manual_seed(4)
    full = clip_config()
    if source == "CLIPModel":
        backbone_model = transformers.CLIPModel(full)
        backbone = backbone_model.vision_model
    else:
        vision_config = CLIPVisionConfig(**full.vision_config.to_dict())
        backbone_model = getattr(transformers, source)(vision_config)
        backbone = backbone_model if source == "CLIPVisionModel" else backbone_model.vision_model
    backbone_model.save_pretrained(tmp_path / "backbone")
    classes = ["circle-red", "square-green", "triangle-blue"]
    batch = make_batch(tmp_path / "batch.safetensors", 12, 12, num_labels=3)
    run(clip_tool, "classify-step", tmp_path / "backbone", tmp_path / "batch.safetensors", tmp_path / "out", 0.0,
        ",".join(classes))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["CLIPForImageClassification"] and config["model_type"] == "clip"
    assert config["id2label"] == {str(i): c for i, c in enumerate(classes)}
    assert config["label2id"] == {c: i for i, c in enumerate(classes)}
    reloaded = CLIPForImageClassification.from_pretrained(tmp_path / "out").eval()
    assert reloaded.config.num_labels == 3
    with torch.no_grad():
        theirs = reloaded(pixel_values=batch["pixel_values"]).logits
        features = backbone.eval()(pixel_values=batch["pixel_values"]).last_hidden_state[:, 1:].mean(1)
        expected = features @ reloaded.classifier.weight.T + reloaded.classifier.bias
    ours = load_file(str(tmp_path / "out" / "logits.safetensors"))["logits"]
    assert torch.allclose(ours, theirs, atol=TOLERANCE, rtol=0)
    assert torch.allclose(theirs, expected, atol=TOLERANCE, rtol=0)


def test_classifier_step_round_trip(tmp_path, clip_tool):
    """A trained classifier (SGD step) saved and reloaded by transformers gives our logits after the step."""
    from transformers import CLIPForImageClassification
    torch.manual_seed(6)
    config = clip_config()
    config.num_labels = 4
    CLIPForImageClassification(config).save_pretrained(tmp_path / "model")
    batch = make_batch(tmp_path / "batch.safetensors", 12, 12, num_labels=4)
    run(clip_tool, "classify-step", tmp_path / "model", tmp_path / "batch.safetensors", tmp_path / "out", 0.5)
    ours = load_file(str(tmp_path / "out" / "logits.safetensors"))["logits"]
    with torch.no_grad():
        theirs = CLIPForImageClassification.from_pretrained(tmp_path / "out").eval()(
            pixel_values=batch["pixel_values"]).logits
        before = CLIPForImageClassification.from_pretrained(tmp_path / "model").eval()(
            pixel_values=batch["pixel_values"]).logits
    assert torch.allclose(ours, theirs, atol=TOLERANCE, rtol=0)
    assert not torch.allclose(before, theirs, atol=1e-3), "the step changed nothing"


def test_dropout_and_activation_checkpointing_apply_from_outside(tmp_path, clip_tool):
    """Attention dropout on (keyed masks): activation checkpointing changes no logit or gradient; dropout acts."""
    from transformers import CLIPModel
    torch.manual_seed(7)
    CLIPModel(clip_config({"attention_dropout": 0.3}, {"attention_dropout": 0.3})).save_pretrained(tmp_path / "model")
    make_batch(tmp_path / "batch.safetensors", 12, 12)
    outputs = {}
    for mode in (["train"], ["train", "checkpointing"], []):
        out = tmp_path / f"out-{'-'.join(mode) or 'eval'}.safetensors"
        run(clip_tool, "forward", tmp_path / "model", tmp_path / "batch.safetensors", out, *mode)
        outputs["-".join(mode) or "eval"] = load_file(str(out))
    plain, checkpointed = outputs["train"], outputs["train-checkpointing"]
    assert plain.keys() == checkpointed.keys()
    for key in plain:
        assert torch.allclose(plain[key], checkpointed[key], atol=1e-6, rtol=0), key
    assert not torch.allclose(plain["logits_per_image"], outputs["eval"]["logits_per_image"], atol=1e-3)


def test_caption_ids_from_our_tokenizer_are_clip_tokenizers_and_give_its_text_features(tmp_path, clip_tool):
    """The CLIP-style tokenizer.json (lower-casing, CLIP's pre-tokenizer, <|startoftext|> ... <|endoftext|>): our
    ids and padding are transformers' CLIPTokenizer's, and our text features for them are get_text_features'."""
    from transformers import AutoTokenizer, CLIPModel
    tokenizer = AutoTokenizer.from_pretrained(CLIP_TOKENIZER)
    assert type(tokenizer).__name__.startswith("CLIPTokenizer")
    texts = ["A Photo of a CAR", "two dogs", "A RED car, parked!", "it's a cat's toy"]
    torch.manual_seed(8)
    config = clip_config({"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
                          "max_position_embeddings": 32})
    model = CLIPModel(config).eval()
    model.save_pretrained(tmp_path / "model")
    run(clip_tool, "text", tmp_path / "model", CLIP_TOKENIZER, tmp_path / "out.safetensors", *texts)
    ours = load_file(str(tmp_path / "out.safetensors"))
    theirs = tokenizer(texts, padding=True, return_tensors="pt")
    assert ours["input_ids"].tolist() == theirs["input_ids"].tolist()
    assert ours["attention_mask"].tolist() == theirs["attention_mask"].tolist()
    with torch.no_grad():
        features = model.get_text_features(input_ids=theirs["input_ids"], attention_mask=theirs["attention_mask"])
    features = getattr(features, "pooler_output", features)
    assert torch.allclose(ours["text_features"], features, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("with_processor_file", [True, False])
def test_predict_with_a_clip_classifier_gives_transformers_probabilities(with_processor_file, tmp_path, run_trainer):
    """`trainer predict` on a CLIPForImageClassification directory: CLIPImageProcessorPil's preprocessing (short side
    resized bicubically, centre crop, CLIP's mean and std; its defaults at the model's image size when the
    directory has no preprocessor_config.json) and the classifier's probabilities."""
    from PIL import Image
    from transformers import CLIPForImageClassification
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    torch.manual_seed(9)
    config = clip_config(vision={"image_size": 32, "patch_size": 8})
    config.id2label = {0: "cat", 1: "dog", 2: "car"}
    config.label2id = {"cat": 0, "dog": 1, "car": 2}
    model = CLIPForImageClassification(config).eval()
    model.save_pretrained(tmp_path / "model")
    processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    if with_processor_file:
        processor = CLIPImageProcessorPil(size={"shortest_edge": 40}, crop_size={"height": 32, "width": 32})
        (tmp_path / "model" / "preprocessor_config.json").write_text(json.dumps(
            {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 40},
             "crop_size": {"height": 32, "width": 32}, "do_center_crop": True, "resample": 3,
             "image_mean": processor.image_mean, "image_std": processor.image_std}))
    rng = torch.Generator().manual_seed(0)
    files = []
    for i, (h, w) in enumerate([(37, 53), (64, 48), (32, 32)]):
        pixels = torch.randint(0, 256, (h, w, 3), generator=rng, dtype=torch.uint8).numpy()
        files.append(tmp_path / f"noise{i}.png")
        Image.fromarray(pixels).save(files[-1])
    args = ["predict", "--model", tmp_path / "model", "--json", "--top-k", 3]
    for f in files:
        args += ["--image", f]
    lines = run_trainer(*args).stdout.strip().splitlines()
    assert len(lines) == len(files)
    for f, line in zip(files, lines):
        with Image.open(f) as image, torch.no_grad():
            probabilities = torch.softmax(model(**processor(image.convert("RGB"), return_tensors="pt")).logits[0], -1)
        for p in json.loads(line)["predictions"]:
            assert p["label"] == config.id2label[p["id"]]
            assert abs(p["probability"] - probabilities[p["id"]].item()) < TOLERANCE, f


def noise_images(directory, sizes, seed=0):
    from PIL import Image
    rng = torch.Generator().manual_seed(seed)
    files = []
    for i, (h, w) in enumerate(sizes):
        pixels = torch.randint(0, 256, (h, w, 3), generator=rng, dtype=torch.uint8).numpy()
        files.append(directory / f"noise{i}.png")
        Image.fromarray(pixels).save(files[-1])
    return files


def tiny_clip_with_tokenizer(directory, seed):
    """A random CLIPModel of 32 px images with the CLIP-style tokenizer and a preprocessor_config.json that resizes
    the short side to 40 and crops 32 (so resizing and cropping both act)."""
    import shutil
    from transformers import AutoTokenizer, CLIPModel
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    tokenizer = AutoTokenizer.from_pretrained(CLIP_TOKENIZER)
    torch.manual_seed(seed)
    config = clip_config({"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
                          "max_position_embeddings": 32}, {"image_size": 32, "patch_size": 8},
                         logit_scale_init_value=4.0)
    model = CLIPModel(config).eval()
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(CLIP_TOKENIZER / name, directory / name)
    processor = CLIPImageProcessorPil(size={"shortest_edge": 40}, crop_size={"height": 32, "width": 32})
    (directory / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 40},
         "crop_size": {"height": 32, "width": 32}, "do_center_crop": True, "resample": 3,
         "image_mean": processor.image_mean, "image_std": processor.image_std}))
    return model, tokenizer, processor


def test_predict_with_texts_gives_clips_zero_shot_probabilities(tmp_path, run_trainer):
    """`trainer predict --model CLIPModel --image F --text T ...`: for each image, every text's probability is
    transformers' softmax over the texts of CLIPModel's logits_per_image (CLIPTokenizer's ids, padded;
    CLIPImageProcessorPil's pixels) within 1e-4, listed from the most to the least probable; --top-k keeps the
    first k; the table form names each image and text."""
    from PIL import Image
    model, tokenizer, processor = tiny_clip_with_tokenizer(tmp_path / "model", seed=12)
    files = noise_images(tmp_path, [(37, 53), (64, 48), (32, 32)])
    texts = ["a photo of a red car", "a blue car", "two dogs", "A CAT's toy!", "a photo of a daisy."]
    args = ["predict", "--model", tmp_path / "model", "--json"]
    for f in files:
        args += ["--image", f]
    for t in texts:
        args += ["--text", t]
    lines = run_trainer(*args).stdout.strip().splitlines()
    assert len(lines) == len(files)
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    for f, line in zip(files, lines):
        record = json.loads(line)
        assert record["image"] == str(f)
        with Image.open(f) as image, torch.no_grad():
            pixels = processor(image.convert("RGB"), return_tensors="pt")["pixel_values"]
            logits = model(pixel_values=pixels, input_ids=encoded["input_ids"],
                           attention_mask=encoded["attention_mask"]).logits_per_image[0]
        theirs = torch.softmax(logits, -1)
        predictions = record["predictions"]
        assert [p["text"] for p in predictions] == [texts[i] for i in theirs.argsort(descending=True).tolist()]
        for p in predictions:
            assert p["text"] == texts[p["id"]]
            assert abs(p["probability"] - theirs[p["id"]].item()) < TOLERANCE, (f, p, theirs)
        assert theirs.max().item() - theirs.min().item() > 1e-3, "the texts score alike: the test could not fail"
    top = run_trainer(*args, "--top-k", 2).stdout.strip().splitlines()
    assert [len(json.loads(line)["predictions"]) for line in top] == [2] * len(files)
    table = run_trainer(*[a for a in args if a != "--json"]).stdout
    assert str(files[0]) in table and "a blue car" in table


def test_predict_refuses_a_clip_model_without_texts_and_texts_for_a_classifier(tmp_path, run_trainer):
    from transformers import CLIPForImageClassification
    tiny_clip_with_tokenizer(tmp_path / "model", seed=13)
    files = noise_images(tmp_path, [(32, 32)])
    result = run_trainer("predict", "--model", tmp_path / "model", "--image", files[0], check=False)
    assert result.returncode == 2, result.stderr
    assert "CLIPModel" in result.stderr and "--text" in result.stderr
    config = clip_config(vision={"image_size": 32, "patch_size": 8})
    config.id2label = {0: "cat", 1: "dog"}
    config.label2id = {"cat": 0, "dog": 1}
    CLIPForImageClassification(config).save_pretrained(tmp_path / "classifier")
    result = run_trainer("predict", "--model", tmp_path / "classifier", "--image", files[0], "--text", "a cat",
                         check=False)
    assert result.returncode == 2, result.stderr
    assert "--text needs a CLIPModel" in result.stderr


@pytest.mark.parametrize("towers,targets", [("vision", "q_proj,v_proj"), ("text", "q_proj,out_proj,fc2"),
                                            ("both", "q_proj,k_proj,v_proj,out_proj,fc1,fc2")])
def test_clip_lora_adapter_loads_in_peft_with_our_logits_and_gradients(towers, targets, tmp_path, clip_tool):
    """apply_clip_lora + write_clip_adapter: peft.PeftModel.from_pretrained on transformers' CLIPModel loads the
    adapter on exactly the same layers (one tower or both), computes our logits_per_image and loss, and the
    gradients of every adapter weight, within 1e-4."""
    from peft import PeftModel
    from transformers import CLIPModel
    torch.manual_seed(21)
    model = CLIPModel(clip_config()).eval()
    model.save_pretrained(tmp_path / "model")
    batch = make_batch(tmp_path / "batch.safetensors", 12, 12)
    with torch.no_grad():
        base_logits = model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"],
                            attention_mask=batch["attention_mask"]).logits_per_image.clone()
    run(clip_tool, "lora", tmp_path / "model", tmp_path / "batch.safetensors", tmp_path / "adapter", towers, 4,
        targets)
    ours = load_file(str(tmp_path / "adapter" / "out.safetensors"))
    peft_model = PeftModel.from_pretrained(model, tmp_path / "adapter", is_trainable=True).eval()
    output = peft_model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"],
                        attention_mask=batch["attention_mask"], return_loss=True)
    output.loss.backward()
    assert (ours["logits_per_image"] - output.logits_per_image.detach()).abs().max().item() < TOLERANCE
    assert abs(ours["loss"].item() - output.loss.item()) < TOLERANCE
    assert not torch.allclose(base_logits, output.logits_per_image.detach(), atol=1e-3), "the adapter changed nothing"
    theirs = {name[len("base_model.model."):].replace(".default", ""): p.grad
              for name, p in peft_model.named_parameters() if "lora_" in name}
    grads = {k[len("grad."):]: v for k, v in ours.items() if k.startswith("grad.")}
    assert set(grads) == set(theirs), set(grads) ^ set(theirs)
    wanted = {"vision": ("vision_model.",), "text": ("text_model.",), "both": ("vision_model.", "text_model.")}[towers]
    assert all(name.startswith(wanted) for name in grads)
    assert {name.split(".")[-3] for name in grads} == set(targets.split(","))
    for name, grad in grads.items():
        assert theirs[name] is not None, name
        assert (grad - theirs[name]).abs().max().item() < TOLERANCE, name
