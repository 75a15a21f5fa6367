#!/usr/bin/env python3
"""The Python stack the benchmarks compare trainer against, written the way users write it: `datasets` +
the fast tokenizer + `DataCollatorForSeq2Seq(padding="longest")`, and transformers' `Trainer` /
`Seq2SeqTrainer`. Run by the benchmark scripts in a process of its own:

    hf_stack.py loader FORM JSONL MODEL_DIR BATCH      # JSONL -> padded batches; prints one JSON line
    hf_stack.py train SPEC.json                        # fine-tune (random init from MODEL_DIR/config.json)

Benchmark instrumentation is kept out of the user's code path: `train` prints `BENCH ...` lines from a
TrainerCallback (the parent timestamps them), and the target tokens of every step are counted from the
tokenized dataset (the sampler is sequential, so step N trains on rows (N-1)*B .. N*B-1).
"""
import json
import os
import resource
import sys
import time


def tokenize_function(tok, form, max_input_length=None, max_target_length=None, max_length=None):
    """Tokenization as trainer's loader does it. seq2seq: input and target each end in </s>, each cut to its
    maximum keeping the </s>. causal: prompt + completion + EOS, prompt masked with -100, cut to max_length."""
    if form == "seq2seq":
        def tokenize(batch):
            enc = tok(batch["input"], truncation=max_input_length is not None, max_length=max_input_length)
            enc["labels"] = tok(text_target=batch["target"], truncation=max_target_length is not None,
                                max_length=max_target_length)["input_ids"]
            return enc
        return tokenize

    def tokenize(batch):
        prompts = tok(batch["prompt"])["input_ids"]
        completions = tok(batch["completion"], add_special_tokens=False)["input_ids"]
        ids, labels = [], []
        for p, c in zip(prompts, completions):
            ids.append((p + c + [tok.eos_token_id])[:max_length])
            labels.append(([-100] * len(p) + c + [tok.eos_token_id])[:max_length])
        return {"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids], "labels": labels}
    return tokenize


def loader(form, path, model, batch_size):
    start = time.perf_counter()
    import datasets
    import torch
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq
    datasets.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(model)
    # The builder by the file's kind (scripts/bench/parquet_loader.py reads Parquet; loader.py JSONL).
    builder = "parquet" if path.endswith(".parquet") else "json"
    ds = datasets.load_dataset(builder, data_files=path, split="train")
    ds = ds.map(tokenize_function(tok, form), batched=True, remove_columns=ds.column_names)
    collator = DataCollatorForSeq2Seq(tok, padding="longest")
    loader = torch.utils.data.DataLoader(ds, batch_size=int(batch_size), shuffle=True, collate_fn=collator,
                                         generator=torch.Generator().manual_seed(1))
    examples = tokens = 0
    for batch in loader:
        examples += batch["input_ids"].shape[0]
        tokens += int(batch["attention_mask"].sum()) + int(
            (batch["labels"] != -100).sum() if form == "seq2seq" else batch["attention_mask"].sum())
    seconds = time.perf_counter() - start
    print(json.dumps({"examples": examples, "tokens": tokens, "seconds": seconds,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def train(spec_path):
    """Also runs as every rank of `torchrun --nproc-per-node N hf_stack.py train SPEC` (transformers' DDP; the
    batch_size is then per rank). spec: model_dir, form, data, max_input_length/max_target_length (seq2seq) or max_length (causal),
    batch_size, gradient_accumulation_steps, max_steps, lr, seed, output_dir; optional auto_find_batch_size,
    save_steps, resume, save_final, ddp_cpu (torchrun on the CPU: use_cpu, Gloo), bf16 (autocast, as trainer's precision.mode=bf16-mixed;
    on the CPU unless device is "cuda", which also prints the GPU allocator's peak), attn_implementation (e.g.
    "sdpa"); HF's own speed options
    (the "best options" side of vs_hf.py): group_by_length (train_sampling_strategy="group_by_length"), flatten
    (causal: DataCollatorWithFlattening, padding-free rows with position ids), torch_compile; pretrained (load
    the directory's weights), load_in_4bit ({quant_type, double_quant}: bitsandbytes' 4-bit base, QLoRA), lora
    ({r, alpha, target_modules}: PEFT adapters), optim (TrainingArguments' optim, e.g. adamw_bnb_8bit)."""
    with open(spec_path) as f:
        spec = json.load(f)
    print("BENCH start", flush=True)
    import datasets
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer,
                              DataCollatorForSeq2Seq, DataCollatorWithFlattening, Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer,
                              TrainerCallback, TrainingArguments, set_seed)
    datasets.disable_progress_bar()
    seq2seq = spec["form"] == "seq2seq"
    set_seed(spec["seed"])
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    config = AutoConfig.from_pretrained(spec["model_dir"])
    model_class = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
    extra = {"attn_implementation": spec["attn_implementation"]} if spec.get("attn_implementation") else {}
    if spec.get("load_in_4bit"):  # QLoRA as users run it: the saved weights quantized by bitsandbytes on load
        import torch
        from transformers import BitsAndBytesConfig
        q = spec["load_in_4bit"]
        model = model_class.from_pretrained(spec["model_dir"], quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=q.get("quant_type", "nf4"),
            bnb_4bit_use_double_quant=q.get("double_quant", True), bnb_4bit_compute_dtype=torch.float32), **extra)
    elif spec.get("pretrained"):
        model = model_class.from_pretrained(spec["model_dir"], **extra)
    else:
        model = model_class.from_config(config, **extra)
    if spec.get("lora"):  # PEFT's LoRA on the listed modules (no gradient checkpointing: as trainer runs it)
        from peft import LoraConfig, get_peft_model
        lora = spec["lora"]
        model = get_peft_model(model, LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=0.0,
                                                 target_modules=lora["target_modules"],
                                                 task_type="SEQ_2_SEQ_LM" if seq2seq else "CAUSAL_LM"))
    ds = datasets.load_dataset("json", data_files=spec["data"], split="train")
    ds = ds.map(tokenize_function(tok, spec["form"], spec.get("max_input_length"), spec.get("max_target_length"),
                                  spec.get("max_length")), batched=True, remove_columns=ds.column_names)

    # Benchmark bookkeeping: target tokens of row i, to count each step's tokens without touching the loop.
    row_tokens = [sum(1 for x in labels if x != -100) for labels in ds["labels"]]
    # With group_by_length the sampler's order is not the file's: the collator's input is counted instead, one
    # entry per batch in a queue (the data loader may fetch a batch ahead; steps take batches in order). Single
    # process only: under torchrun this would count rank 0's share alone.
    batch_tokens = []

    class Report(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            print(f"BENCH begin micro_batch {trainer._train_batch_size} accumulation "
                  f"{args.gradient_accumulation_steps}", flush=True)
            if spec.get("stop_at_train_begin"):  # calibration: the address space before any step, less the weights
                weights = sum(p.numel() * p.element_size() for p in model.parameters())
                print(f"BENCH address_space {vm_size() - weights} weights {weights}", flush=True)
                os._exit(0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            # Under torchrun every rank logs the same (rank-averaged) loss: rank 0 alone reports. A step trains
            # world_size consecutive per-device batches of the sequential order (accelerate's batch sharding).
            if logs and "loss" in logs and state.is_world_process_zero:
                per_step = trainer._train_batch_size * args.gradient_accumulation_steps * args.world_size
                if spec.get("group_by_length"):
                    tokens = sum(batch_tokens.pop(0) for _ in range(args.gradient_accumulation_steps))
                else:
                    first = (state.global_step - 1) * per_step % len(row_tokens)
                    tokens = sum(row_tokens[(first + i) % len(row_tokens)] for i in range(per_step))
                print(f"BENCH step {state.global_step} loss {logs['loss']:.6f} tokens "
                      f"{tokens} micro_batch {trainer._train_batch_size}", flush=True)

        def on_save(self, args, state, control, **kwargs):
            print(f"BENCH saved {state.global_step}", flush=True)

    arguments = dict(output_dir=spec["output_dir"], per_device_train_batch_size=spec["batch_size"],
                     gradient_accumulation_steps=spec.get("gradient_accumulation_steps", 1),
                     max_steps=spec["max_steps"], learning_rate=spec["lr"], lr_scheduler_type="linear",
                     warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, seed=spec["seed"], logging_steps=1,
                     save_strategy="steps" if spec.get("save_steps") else "no", save_steps=spec.get("save_steps") or 500,
                     save_total_limit=2, report_to="none", disable_tqdm=True, train_sampling_strategy="sequential",
                     auto_find_batch_size=spec.get("auto_find_batch_size", False), dataloader_num_workers=0)
    if spec.get("optim"):
        arguments.update(optim=spec["optim"])
    if spec.get("bf16"):  # bf16 autocast, fp32 master weights: on the CPU unless the spec says device "cuda"
        arguments.update(bf16=True, **({} if spec.get("device") == "cuda" else {"use_cpu": True}))
    if spec.get("ddp_cpu"):  # under torchrun on the CPU: without use_cpu accelerate stays one process per rank
        arguments.update(use_cpu=True, ddp_backend="gloo")
    if spec.get("group_by_length"):  # LengthGroupedSampler: mega-batches of 50 batches sorted by length
        arguments.update(train_sampling_strategy="group_by_length")
    if spec.get("torch_compile"):
        arguments.update(torch_compile=True)
    if spec.get("flatten"):  # padding-free: one row per batch, position ids restart per example (causal only)
        collator = DataCollatorWithFlattening()
    else:
        collator = DataCollatorForSeq2Seq(tok, model=model if seq2seq else None, padding="longest")
    if spec.get("group_by_length"):
        user_collator = collator

        def collator(features):
            batch_tokens.append(sum(1 for f in features for x in f["labels"] if x != -100))
            return user_collator(features)
    trainer_class, args_class = (Seq2SeqTrainer, Seq2SeqTrainingArguments) if seq2seq else (Trainer, TrainingArguments)
    trainer = trainer_class(model=model, args=args_class(**arguments), train_dataset=ds, data_collator=collator,
                            processing_class=tok, callbacks=[Report()])
    trainer.train(resume_from_checkpoint=True if spec.get("resume") else None)
    if spec.get("save_final"):
        trainer.save_model(spec["output_dir"] + "/final")
    import torch
    if spec.get("device") == "cuda" and torch.cuda.is_available():  # the caching allocator's high-water mark
        print(f"BENCH peak_memory {torch.cuda.max_memory_allocated()}", flush=True)
    print("BENCH done", flush=True)


def vm_size():
    """This process's virtual size (what RLIMIT_AS limits), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "loader":
        loader(*sys.argv[2:6])
    elif command == "train":
        train(sys.argv[2])
    else:
        sys.exit(__doc__)
