#!/usr/bin/env python3
"""The Python side of scripts/bench/clip_vs_hf.py: a plain transformers/PyTorch CLIP training loop, the whole
effective batch in one autograd graph (no caching): CLIPImageProcessor and the model directory's tokenizer on the
image-caption JSONL, CLIPModel(return_loss=True) forward, backward, gradient clipping at 1.0, AdamW (constant lr).
Records are taken in file order, wrapping around.

    hf_clip_loop.py memory SPEC.json   # per batch size: peak live tensor bytes over two steps; one JSON line each,
                                       # stopping after the first batch whose peak exceeds cap_bytes
    hf_clip_loop.py speed SPEC.json    # one JSON line per step: {"step": n, "seconds": s, "loss": l}

Peak live tensor bytes: the parameters, buffers and (after the first step) AdamW's moments that are live when a
step begins, plus the running sum of the CPU allocator's allocations and frees recorded by torch.profiler
(profile_memory=True) during the step, at its highest. Inputs are copied into tensors inside the measured region,
so the batch's pixels and ids count as they do in trainer's budget."""
import json
import os
import sys
import time

import torch
from PIL import Image, ImageOps
from torch.profiler import ProfilerActivity, profile
from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel


def load_records(path):
    base = os.path.dirname(os.path.abspath(path))
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [(os.path.join(base, r["image"]), r["caption"]) for r in records]


class Loop:
    def __init__(self, spec):
        self.spec = spec
        self.records = load_records(spec["train_file"])
        self.processor = CLIPImageProcessor.from_pretrained(spec["model_dir"])
        self.tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
        self.cursor = 0

    def fresh_model(self):
        torch.manual_seed(self.spec["seed"])
        model = CLIPModel.from_pretrained(self.spec["model_dir"]).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.spec["lr"], weight_decay=0.0, eps=1e-8)
        return model, optimizer

    def next_batch(self, batch):
        chosen = [self.records[(self.cursor + i) % len(self.records)] for i in range(batch)]
        self.cursor = (self.cursor + batch) % len(self.records)
        images = [ImageOps.exif_transpose(Image.open(path)).convert("RGB") for path, _ in chosen]
        pixels = torch.tensor(self.processor(images, return_tensors="np")["pixel_values"])
        text = self.tokenizer([caption for _, caption in chosen], padding=True, truncation=True,
                              max_length=self.spec["max_length"], return_tensors="np")
        return pixels, torch.tensor(text["input_ids"]), torch.tensor(text["attention_mask"])

    def step(self, model, optimizer, batch):
        pixels, ids, mask = self.next_batch(batch)
        loss = model(pixel_values=pixels, input_ids=ids, attention_mask=mask, return_loss=True).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()


def live_bytes(model, optimizer):
    """Bytes of the distinct storages of the parameters, buffers and optimizer state live now."""
    seen, total = set(), 0
    tensors = list(model.parameters()) + list(model.buffers())
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def peak_during(fn):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def memory(spec):
    loop = Loop(spec)
    for batch in spec["batches"]:
        model, optimizer = loop.fresh_model()
        loop.cursor = 0
        peaks = []
        for _ in range(2):  # the second step has AdamW's moments live during forward and backward
            before = live_bytes(model, optimizer)
            peaks.append(before + peak_during(lambda: loop.step(model, optimizer, batch)))
        peak = max(peaks)
        print(json.dumps({"batch": batch, "peak_bytes": peak, "weights_bytes": live_bytes(model, optimizer)}),
              flush=True)
        del model, optimizer
        if peak > spec["cap_bytes"]:
            break


def speed(spec):
    loop = Loop(spec)
    model, optimizer = loop.fresh_model()
    for n in range(1, spec["steps"] + 1):
        start = time.perf_counter()
        loss = loop.step(model, optimizer, spec["batch"])
        print(json.dumps({"step": n, "seconds": time.perf_counter() - start, "loss": loss}), flush=True)


if __name__ == "__main__":
    with open(sys.argv[2]) as f:
        spec = json.load(f)
    {"memory": memory, "speed": speed}[sys.argv[1]](spec)
