"""optimizer.state_dtype=int8 (trainer's AdamW with 8-bit moments) against bitsandbytes.optim.AdamW8bit on the CPU:
the same parameters and gradients, several steps, tensors under and over min_8bit_size (4096 elements: fp32
moments below it). The moments must be bit for bit bitsandbytes' (codes, block absmax, fp32 small-tensor moments);
the weights within 1e-5 relative: bitsandbytes divides by torch's CPU sqrt, which is not correctly rounded (see
test_quantization.py::test_torch_sqrt_is_not_correctly_rounded), trainer's by a correctly rounded one."""
import json

import bitsandbytes as bnb
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from test_models import parity_tool, run_parity_tool  # noqa: F401 (fixture)

SHAPES = {"big": (64, 100), "long": (70_000,), "edge": (4096,), "small": (7, 5), "under": (4095,)}
ADAM = dict(lr=1e-3, betas=(0.9, 0.995), eps=1e-6, weight_decay=0.1)
STEPS = 5
HEADER = 25  # magic (8), numel (int64), step (int64), is_8bit (1)


def parse_state(blob, numel):
    raw = blob.numpy().tobytes()
    step = int(np.frombuffer(raw[16:24], dtype=np.int64)[0])
    is_8bit = raw[24] == 1
    body = raw[HEADER:]
    if not is_8bit:
        m = np.frombuffer(body[:4 * numel], dtype=np.float32)
        v = np.frombuffer(body[4 * numel:8 * numel], dtype=np.float32)
        return step, {"state1": m, "state2": v}
    blocks = (numel + 255) // 256
    s1 = np.frombuffer(body[:numel], dtype=np.uint8)
    s2 = np.frombuffer(body[numel:2 * numel], dtype=np.uint8)
    a1 = np.frombuffer(body[2 * numel:2 * numel + 4 * blocks], dtype=np.float32)
    a2 = np.frombuffer(body[2 * numel + 4 * blocks:2 * numel + 8 * blocks], dtype=np.float32)
    return step, {"state1": s1, "state2": s2, "absmax1": a1, "absmax2": a2}


def test_int8_adamw_matches_bitsandbytes_adamw8bit(tmp_path, parity_tool):
    g = torch.Generator().manual_seed(4)
    params = {n: torch.randn(s, generator=g) * 0.02 for n, s in SHAPES.items()}
    grads = [{n: torch.randn(s, generator=g) * 10 ** (-2 + step % 3) for n, s in SHAPES.items()} for step in range(STEPS)]
    tensors = {f"param.{n}": p for n, p in params.items()}
    for step, gs in enumerate(grads):
        tensors.update({f"grad.{step}.{n}": t for n, t in gs.items()})
    save_file(tensors, tmp_path / "in.safetensors")
    spec = {"name": "adamw", "state_dtype": "int8", "lrs": [ADAM["lr"]] * STEPS, "beta1": ADAM["betas"][0],
            "beta2": ADAM["betas"][1], "eps": ADAM["eps"], "weight_decay": ADAM["weight_decay"]}
    run_parity_tool(parity_tool, "optimizer", tmp_path / "in.safetensors", tmp_path / "out.safetensors",
                    json.dumps(spec))
    ours = load_file(tmp_path / "out.safetensors")

    theirs = {n: torch.nn.Parameter(p.clone()) for n, p in params.items()}
    opt = bnb.optim.AdamW8bit(list(theirs.values()), **ADAM)
    for gs in grads:
        for n, p in theirs.items():
            p.grad = gs[n].clone()
        opt.step()

    for n, p in theirs.items():
        assert (p.detach() - params[n]).abs().max() > 1e-5, f"{n} did not move"
        np.testing.assert_allclose(ours[f"param.{n}"].numpy(), p.detach().numpy(), rtol=1e-5, atol=1e-9,
                                   err_msg=n)
        step, state = parse_state(ours[f"state.adamw8bit.{n}"], p.numel())
        expected = opt.state[p]
        assert step == expected["step"] == STEPS
        assert (expected["state1"].dtype == torch.uint8) == ("absmax1" in state), n
        for key, value in state.items():
            np.testing.assert_array_equal(value, expected[key].reshape(-1).numpy(), err_msg=f"{n} {key}")
