#!/usr/bin/env python3
"""PyTorch's own fully sharded data parallelism (FSDP2, `torch.distributed.fsdp.fully_shard`) over a transformers
causal model, as torchtitan applies it: each decoder layer a unit, then the root. The reference side of
scripts/bench/sharded_memory.py, run as every rank of

    torchrun --nproc-per-node N scripts/bench/fsdp2_loop.py SPEC.json

SPEC: model_dir (config.json: random init from `seed`; its tokenizer), data (JSONL of prompt / completion records),
max_length, batch_size (the global batch: each rank trains its contiguous share of it, padded to its longest row),
steps, lr. The data is read in file order and tokenized as trainer's loader does (hf_stack.tokenize_function). The
loss is summed over the rank's target tokens and divided by the whole batch's, so the ranks' gradients add up to the
batch's (trainer's normalisation); AdamW, clipping at 1.0. On the CPU: Gloo. Prints `BENCH step S tokens T loss L`
per step (rank 0; T: the batch's target tokens, as trainer counts them; the parent timestamps the lines) and `BENCH peak_rss_mib R` per rank at the end.
"""
import json
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_stack import tokenize_function  # noqa: E402


def main(spec_path):
    with open(spec_path) as f:
        spec = json.load(f)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(spec["seed"])
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    config = AutoConfig.from_pretrained(spec["model_dir"])
    # As torchtitan does it: built on the meta device, sharded, then each rank's shards allocated and initialised
    # (norms 1, biases 0, the rest N(0, 0.02) as transformers initialises Qwen2), so no rank holds the whole model.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.model.rotary_emb = type(model.model.rotary_emb)(config)  # its buffers, computed again off the meta device
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"])

    records = [json.loads(line) for line in open(spec["data"]) if line.strip()]
    tokenize = tokenize_function(tok, "causal", max_length=spec["max_length"])
    batch = spec["batch_size"]
    share = batch // world
    for step in range(spec["steps"]):
        rows = records[step * batch:(step + 1) * batch]
        encoded = tokenize({"prompt": [r["prompt"] for r in rows], "completion": [r["completion"] for r in rows]})
        targets = sum(sum(1 for t in labels[1:] if t != -100) for labels in encoded["labels"])
        mine = slice(rank * share, (rank + 1) * share)
        ids, labels = encoded["input_ids"][mine], encoded["labels"][mine]
        longest = max(len(x) for x in ids)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        input_ids = torch.tensor([x + [pad] * (longest - len(x)) for x in ids])
        mask = torch.tensor([[1] * len(x) + [0] * (longest - len(x)) for x in ids])
        label_ids = torch.tensor([x + [-100] * (longest - len(x)) for x in labels])
        logits = model(input_ids=input_ids, attention_mask=mask).logits
        loss_sum = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(),
                                                     label_ids[:, 1:].reshape(-1), ignore_index=-100,
                                                     reduction="sum")
        (loss_sum / targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        summed = loss_sum.detach().clone()
        dist.all_reduce(summed)
        if rank == 0:  # tokens: the batch's target tokens, as trainer counts them
            print(f"BENCH step {step + 1} tokens {targets} loss {float(summed) / targets:.6f}", flush=True)
    print(f"BENCH peak_rss_mib {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f} rank {rank}",
          flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
