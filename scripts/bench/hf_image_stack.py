#!/usr/bin/env python3
"""The Python stack the image benchmarks compare trainer against, written the way users write it: an ImageFolder
over the class folders with transformers' image processor as the per-image transform, a torch DataLoader with
worker processes, ViTForImageClassification and transformers' `Trainer`. Run by scripts/bench/vit_vs_hf.py in a
process of its own:

    hf_image_stack.py train SPEC.json     # fine-tune (random init from MODEL_DIR/config.json)

SPEC: model_dir, train_folder, batch_size, max_steps, lr, seed, workers, precision ("fp32" | "bf16-mixed"),
output_dir; gradient_checkpointing; measure_memory (print each step's peak of live tensor bytes: `BENCH memory step N peak_bytes B`, for
vit_vs_hf.py --cap). Benchmark instrumentation stays out of the user's code path: a TrainerCallback prints `BENCH step N
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

    class Memory(TrainerCallback):
        """measure_memory: the peak of live tensor bytes of each step, as trainer's memory budget counts them: the
        parameters, buffers and optimizer state live when the step begins, the step's batch (already collated
        then: its pixels and labels, from their shapes), plus the highest running sum of the CPU allocator's
        allocations and frees that torch.profiler records (profile_memory=True) from the step's beginning to its
        end (forward, backward, clipping, the AdamW update, zeroing the gradients)."""
        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            from torch.profiler import ProfilerActivity, profile
            pixels = config.num_channels * config.image_size ** 2 * 4  # float32 pixels, int64 labels
            batch = spec["batch_size"] * (pixels + 8)
            self.before = live_bytes([model], optimizer) + batch
            self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.profiler.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            self.profiler.__exit__(None, None, None)
            events = [e for e in self.profiler.profiler.kineto_results.events()
                      if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")]
            current = peak = 0
            for e in sorted(events, key=lambda e: e.start_ns()):
                current += e.nbytes()
                peak = max(peak, current)
            print(f"BENCH memory step {state.global_step} peak_bytes {self.before + peak}", flush=True)

    arguments = TrainingArguments(
        output_dir=spec["output_dir"], per_device_train_batch_size=spec["batch_size"], max_steps=spec["max_steps"],
        learning_rate=spec["lr"], lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        seed=spec["seed"], logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        train_sampling_strategy="sequential", dataloader_num_workers=spec["workers"], use_cpu=True,
        bf16=spec["precision"] == "bf16-mixed", remove_unused_columns=False,
        gradient_checkpointing=spec.get("gradient_checkpointing", False))
    callbacks = [Report()] + ([Memory()] if spec.get("measure_memory") else [])
    trainer = Trainer(model=model, args=arguments, train_dataset=ImageFolder(), callbacks=callbacks)
    trainer.train()
    print("BENCH done", flush=True)


def live_bytes(modules, optimizer):
    """Bytes of the distinct storages of the modules' parameters and buffers and the optimizer's state."""
    import torch
    tensors = [t for m in modules for t in list(m.parameters()) + list(m.buffers())]
    for state in (optimizer.state.values() if optimizer is not None else []):
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "train":
        train(sys.argv[2])
    else:
        sys.exit(__doc__)
