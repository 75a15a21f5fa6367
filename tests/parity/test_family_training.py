"""Training each decoder family with the real trainer binary reaches the weights of a plain PyTorch loop over the
transformers model: AdamW (betas 0.9/0.999 as trainer's defaults, eps 1e-5; weight decay 0.01, gradient clipping at
1.0), three steps of an effective batch of 4 pre-tokenized examples of different lengths (prompt tokens masked),
the loss the mean over the effective batch's target tokens. Accumulated over micro-batches of one example (what a
memory budget forces), packed (several examples a row, attention and positions per example) with activation
checkpointing, and for some families also the whole padded batch in one micro-batch: each within 1e-4 of PyTorch's
weights, and the saved model is what transformers loads (the families: test_models.FAMILIES). For some families
also: two data-parallel ranks, and a CPU memory budget that makes the whole-batch step run out of memory and split.
For a mixture of experts with the load-balancing loss: all of these, the loss the effective batch's."""
import json
import os
import pathlib
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_models import FAMILIES, VOCAB, hf_model, make_model_dir

STEPS, BATCH, LR, EPS = 3, 4, 1e-3, 1e-5
# Adam's eps: with the default 1e-8 an element whose gradient is within summation noise of zero (~1e-6 here, after two
# steps whose weights differ by 1e-5 between any two ways of computing them) moves by +-0.64 lr on its first update,
# whichever its sign: PyTorch's own loop accumulated over micro-batches of one example and over the whole padded
# batch already differ there (Gemma 4's per-layer embedding row of a token first seen in the last step, on AVX2).
# 1e-5 keeps such elements' updates proportional to their gradients and every other element's sign-like.
TRAINER = pathlib.Path(os.environ.get("TRAINER_BINARY", pathlib.Path(__file__).resolve().parents[2] / "build" /
                                      "trainer"))
# Dynamic RoPE and longrope choose their frequencies by the longest position of a forward (as transformers does, and
# transformers' dynamic RoPE also keeps the longest it has seen): past max_position_embeddings /
# original_max_position_embeddings the frequencies depend on the micro-batch's padded width, so a split changes
# them (docs/models.md). Trained here within those lengths; beyond them test_models compares forward and generation.
WITHIN_ORIGINAL_LENGTH = {"llama-dynamic-rope": {"max_position_embeddings": 32},
                          "phi3-partial-longrope": {"original_max_position_embeddings": 32}}


def examples():
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(STEPS * BATCH):
        n = [7, 12, 5, 10][i % BATCH] + i % 3
        ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        labels = [-100] * 3 + ids[3:]  # a prompt of three tokens
        out.append({"input_ids": ids, "labels": labels})
    return out


def reference_weights(model_dir, records):
    """transformers' model, trained by hand: one padded forward per effective batch."""
    model = hf_model(model_dir)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=LR, betas=(0.9, 0.999), eps=EPS)
    for step in range(STEPS):
        part = records[step * BATCH:(step + 1) * BATCH]
        width = max(len(r["input_ids"]) for r in part)
        ids = torch.zeros(BATCH, width, dtype=torch.long)
        mask = torch.zeros(BATCH, width, dtype=torch.long)
        labels = torch.full((BATCH, width), -100)
        for i, r in enumerate(part):
            n = len(r["input_ids"])
            ids[i, :n] = torch.tensor(r["input_ids"])
            mask[i, :n] = 1
            labels[i, :n] = torch.tensor(r["labels"])
        optimizer.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return {n: p.detach() for n, p in model.state_dict().items()}


def train(run_trainer, model_dir, data, out, micro_batch, packing=False, checkpointing=False, ranks=1, limit=None,
          shard_weights=False):
    config = {
        "model": {"path": str(model_dir), "init": "pretrained"},
        "data": {"train_files": [str(data)], "max_length": 32, "shuffle": False, "packing": packing},
        "training": {"batch_size": BATCH, "micro_batch_size": micro_batch, "max_steps": STEPS, "seed": 1,
                     "activation_checkpointing": checkpointing},
        "optimizer": {"name": "adamw", "lr": LR, "weight_decay": 0.01, "eps": EPS},
        "scheduler": {"name": "constant", "warmup_steps": 0},
        "precision": {"mode": "fp32"},
        "device": {"type": "cpu"},
        "memory": {"limit": limit} if limit else {},
        "checkpoint": {"output_dir": str(out), "every_steps": 0},
        "logging": {"progress": "off"},
        "distributed": {"shard_weights": shard_weights},
    }
    path = out.parent / f"{out.name}.json"
    path.write_text(json.dumps(config))
    if ranks == 1:
        run_trainer("--config", path)
    else:  # data-parallel ranks on this machine (Gloo on the loopback), each training its share of every batch
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "TRAINER_NUM_THREADS": "1"}
        result = subprocess.run([str(TRAINER), "launch", "--nproc-per-node", str(ranks), "--", "--config", str(path)],
                                env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
    return out / "final"


PADDED_WHOLE_BATCH = {"gemma2-softcaps", "qwen3-sliding-yarn-tied", "gemma4-shared-kv-ple", "mixtral-sliding",
                      "qwen3-moe-dense-layer"}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_family_trains_to_the_weights_of_a_pytorch_loop(name, tmp_path, run_trainer):
    model_dir = make_model_dir(name, tmp_path / "model", **WITHIN_ORIGINAL_LENGTH.get(name, {}))
    records = examples()
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    expected = reference_weights(model_dir, records)
    before = load_file(model_dir / "model.safetensors")
    # One example a micro-batch; packed rows (attention per example) with activation checkpointing; and for the
    # families whose masks do most with padding (windows, soft-caps, shared keys and values, routing), the whole
    # right-padded batch in one micro-batch (the engine's split promise itself is tested in the engine's tests).
    runs = [(1, False), (2, True)] + ([(BATCH, False)] if name in PADDED_WHOLE_BATCH else [])
    for micro_batch, packing in runs:
        final = train(run_trainer, model_dir, data, tmp_path / f"run-{micro_batch}-{packing}", micro_batch,
                      packing=packing, checkpointing=packing)
        ours = {n: p for n, p in hf_model(final).state_dict().items()}
        assert set(ours) == set(expected)
        moved = max((ours[n] - before[n]).abs().max().item() for n in before if n in ours)
        assert moved > 1e-3, "training changed nothing"
        for n, p in expected.items():
            torch.testing.assert_close(ours[n], p, atol=1e-4, rtol=1e-4,
                                       msg=lambda m, n=n, mb=micro_batch, pk=packing: f"micro-batch {mb}, packing {pk}, {n}: {m}")


@pytest.mark.parametrize("name", ["gemma2-softcaps", "phi3-partial-longrope", "gemma4-shared-kv-ple"])
def test_two_data_parallel_ranks_train_a_family_to_the_same_weights(name, tmp_path):
    """N ranks train what one process trains: 2 ranks (trainer launch), each 2 examples of every batch of 4."""
    model_dir = make_model_dir(name, tmp_path / "model", **WITHIN_ORIGINAL_LENGTH.get(name, {}))
    records = examples()
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    expected = reference_weights(model_dir, records)
    final = train(None, model_dir, data, tmp_path / "ranks", 2, ranks=2)
    ours = hf_model(final).state_dict()
    for n, p in expected.items():
        torch.testing.assert_close(ours[n], p, atol=1e-4, rtol=1e-4, msg=lambda m, n=n: f"2 ranks, {n}: {m}")


def metric(out, key):
    return [json.loads(line)[key] for line in (out / "metrics.jsonl").read_text().splitlines() if f'"{key}"' in line]


@pytest.mark.parametrize("name", ["gemma2-softcaps", "qwen3-headdim-untied", "qwen3-moe-skewed"])
def test_an_out_of_memory_split_reaches_the_same_weights(name, tmp_path, run_trainer):
    """A CPU budget between the peaks of micro-batches of 1 and 4 examples: the step of 4 runs out of memory, the
    same effective batch is split and retried, and the run still ends at the PyTorch loop's weights. The mixture of
    experts starts skewed: its routers' weights zero, so every token of the first batch goes to the same experts."""
    skewed = name == "qwen3-moe-skewed"
    model_dir = make_model_dir("qwen3-moe-dense-layer" if skewed else name, tmp_path / "model")
    if skewed:
        weights = load_file(model_dir / "model.safetensors")
        for key in [k for k in weights if k.endswith(".mlp.gate.weight")]:
            weights[key] = torch.zeros_like(weights[key])
        save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    records = examples()
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    peaks = {}
    for micro in (1, BATCH):
        train(run_trainer, model_dir, data, tmp_path / f"peak-{micro}", micro)
        peaks[micro] = max(metric(tmp_path / f"peak-{micro}", "memory_peak"))
    assert peaks[1] < peaks[BATCH]
    out = tmp_path / "constrained"
    final = train(run_trainer, model_dir, data, out, BATCH, limit=int((peaks[1] + peaks[BATCH]) / 2))
    assert sum(metric(out, "oom_retries")) >= 1, "the budget never ran out: the test proves nothing"
    assert min(metric(out, "micro_batch")) < BATCH
    ours = hf_model(final).state_dict()
    for n, p in reference_weights(model_dir, records).items():
        torch.testing.assert_close(ours[n], p, atol=1e-4, rtol=1e-4, msg=lambda m, n=n: f"after the split, {n}: {m}")


def test_the_load_balancing_loss_is_the_effective_batchs_under_any_split(tmp_path, run_trainer):
    """A mixture of experts with output_router_logits: transformers adds router_aux_loss_coef x the load-balancing
    loss of the forward (every sparse layer's router over the real tokens) to the loss. trainer's loss is the
    effective batch's, so the balancing loss must be too: its assignments counted over the whole batch (a pass
    without gradients when the batch is split, summed over the ranks) before the first backward. The whole batch,
    one example a micro-batch, packed rows with activation checkpointing and two ranks all reach the PyTorch loop's
    weights, and so do two ranks over fully sharded weights (micro-batches of one: the counting pass is a collective
    forward per micro-batch); the loss's coefficient is large enough that leaving it out would not (checked)."""
    name = "qwen3-moe-dense-layer"
    model_dir = make_model_dir(name, tmp_path / "model", output_router_logits=True, router_aux_loss_coef=0.5)
    records = examples()
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    expected = reference_weights(model_dir, records)
    without = reference_weights(make_model_dir(name, tmp_path / "plain"), records)
    assert max((expected[n] - without[n]).abs().max().item() for n in expected) > 1e-3, "the loss changes nothing"
    # transformers' balancing loss of the first effective batch (before any step): the first step's metric.
    model = hf_model(model_dir)
    first = records[:BATCH]
    width = max(len(r["input_ids"]) for r in first)
    ids = torch.tensor([r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in first])
    mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in first])
    with torch.no_grad():
        balancing = model(input_ids=ids, attention_mask=mask).aux_loss.item()
    for micro_batch, packing, ranks, sharded in ((BATCH, False, 1, False), (1, False, 1, False), (2, True, 1, False),
                                                 (BATCH, False, 2, False), (1, False, 2, True)):
        out = tmp_path / f"run-{micro_batch}-{packing}-{ranks}-{sharded}"
        final = train(run_trainer, model_dir, data, out, micro_batch, packing=packing, checkpointing=packing,
                      ranks=ranks, shard_weights=sharded)
        logged = metric(out, "router/balancing_loss")
        assert len(logged) == STEPS and abs(logged[0] - balancing) < 1e-5, (logged, balancing)
        assert all(m >= 1.0 for m in metric(out, "router/busiest_expert_load"))
        ours = hf_model(final).state_dict()
        for n, p in expected.items():
            torch.testing.assert_close(ours[n], p, atol=1e-4, rtol=1e-4, msg=lambda m, n=n, mb=micro_batch, pk=packing,
                                       r=ranks, sh=sharded: f"micro-batch {mb}, packing {pk}, ranks {r}, "
                                                            f"sharded {sh}, {n}: {m}")


def test_mixtrals_router_jitter_is_keyed_like_dropout(tmp_path, run_trainer):
    """router_jitter_noise: in training the sparse block's input times uniform noise in [1 - j, 1 + j]. transformers
    draws it from torch's generator; trainer keys it like dropout (seed, step, site, each element's example and
    place), so the whole batch, one example a micro-batch and packed rows with activation checkpointing end at the
    same weights, which differ from a run without jitter; generation (no training) is transformers'."""
    model_dir = make_model_dir("mixtral-sliding", tmp_path / "model", router_jitter_noise=0.2)
    plain_dir = make_model_dir("mixtral-sliding", tmp_path / "plain")
    records = examples()
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    finals = [hf_model(train(run_trainer, model_dir, data, tmp_path / f"run-{mb}-{pk}", mb, packing=pk,
                             checkpointing=pk)).state_dict() for mb, pk in ((BATCH, False), (1, False), (2, True))]
    for other in finals[1:]:
        for n, p in finals[0].items():
            torch.testing.assert_close(other[n], p, atol=1e-5, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    without = hf_model(train(run_trainer, plain_dir, data, tmp_path / "plain-run", BATCH)).state_dict()
    assert max((without[n] - p).abs().max().item() for n, p in finals[0].items()) > 1e-5, "the jitter changes nothing"
    model = hf_model(model_dir)
    prompt = [5, 17, 42, 8, 9, 33]
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0]
    result = run_trainer("generate", "--model", model_dir, "--ids", ",".join(map(str, prompt)), "--max-new-tokens", 8)
    assert [int(x) for x in result.stdout.split("ids:")[1].split()] == theirs[len(prompt):].tolist()
