#!/usr/bin/env python3
"""The Python stack the image benchmarks compare trainer against, written the way users write it: an ImageFolder
over the class folders with transformers' image processor as the per-image transform, a torch DataLoader with
worker processes, ViTForImageClassification and transformers' `Trainer`. Run by scripts/bench/vit_vs_hf.py in a
process of its own:

    hf_image_stack.py train SPEC.json     # fine-tune (random init from MODEL_DIR/config.json)

SPEC: model_dir, train_folder, batch_size, max_steps, lr, seed, workers, precision ("fp32" | "bf16-mixed"),
output_dir. Benchmark instrumentation stays out of the user's code path: a TrainerCallback prints `BENCH step N
loss L` when a step is logged (the parent timestamps the lines).
"""
import json
import os
import sys


def train(spec_path):
    with open(spec_path) as f:
        spec = json.load(f)
    print("BENCH start", flush=True)
    import torch
    from PIL import Image, ImageOps
    from transformers import (AutoConfig, Trainer, TrainerCallback, TrainingArguments, ViTForImageClassification,
                              set_seed)
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    set_seed(spec["seed"])
    root = spec["train_folder"]
    classes = sorted(d.name for d in os.scandir(root) if d.is_dir())
    samples = [(os.path.join(root, c, f), i) for i, c in enumerate(classes)
               for f in sorted(os.listdir(os.path.join(root, c)))]
    processor = ViTImageProcessorPil.from_pretrained(spec["model_dir"])

    class ImageFolder(torch.utils.data.Dataset):  # torchvision's ImageFolder listing, the processor as transform
        def __len__(self):
            return len(samples)

        def __getitem__(self, i):
            path, label = samples[i]
            with Image.open(path) as image:
                rgb = ImageOps.exif_transpose(image).convert("RGB")
            pixels = processor(rgb, return_tensors="pt")["pixel_values"][0]
            return {"pixel_values": pixels, "labels": label}

    config = AutoConfig.from_pretrained(spec["model_dir"], num_labels=len(classes),
                                        id2label=dict(enumerate(classes)),
                                        label2id={c: i for i, c in enumerate(classes)})
    model = ViTForImageClassification(config)

    class Report(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                print(f"BENCH step {state.global_step} loss {logs['loss']:.6f}", flush=True)

    arguments = TrainingArguments(
        output_dir=spec["output_dir"], per_device_train_batch_size=spec["batch_size"], max_steps=spec["max_steps"],
        learning_rate=spec["lr"], lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        seed=spec["seed"], logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        train_sampling_strategy="sequential", dataloader_num_workers=spec["workers"], use_cpu=True,
        bf16=spec["precision"] == "bf16-mixed", remove_unused_columns=False)
    trainer = Trainer(model=model, args=arguments, train_dataset=ImageFolder(), callbacks=[Report()])
    trainer.train()
    print("BENCH done", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "train":
        train(sys.argv[2])
    else:
        sys.exit(__doc__)
