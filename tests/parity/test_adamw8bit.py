"""optimizer.state_dtype=int8 (trainer's AdamW with 8-bit moments) against bitsandbytes.optim.AdamW8bit on the CPU:
the same parameters and gradients, several steps, tensors under and over min_8bit_size (4096 elements: fp32
moments below it, and one tensor over the update's chunk of 2^20 elements). The moments (codes, block absmax, fp32
small-tensor moments) and the weights must be bit for bit bitsandbytes': trainer's update is the same ATen ops."""
import json

import bitsandbytes as bnb
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from test_models import parity_tool, run_parity_tool  # noqa: F401 (fixture)

SHAPES = {"big": (64, 100), "long": (70_000,), "edge": (4096,), "small": (7, 5), "under": (4095,),
          "chunked": (1_100_000,)}  # over the update's chunk of 2^20 elements, ending in a partial block
ADAM = dict(lr=1e-3, betas=(0.9, 0.995), eps=1e-6, weight_decay=0.1)
STEPS = 5


def parse_state(ours, name):
    """trainer's state for one parameter, by bitsandbytes' state names."""
    keys = ["state1", "state2", "absmax1", "absmax2"] if f"state.adamw8bit.state1.{name}" in ours else []
    state = {k: ours[f"state.adamw8bit.{k}.{name}"].reshape(-1).numpy() for k in keys}
    if not keys:
        state = {"state1": ours[f"state.adamw8bit.exp_avg.{name}"].reshape(-1).numpy(),
                 "state2": ours[f"state.adamw8bit.exp_avg_sq.{name}"].reshape(-1).numpy()}
    return int(ours[f"state.adamw8bit.step.{name}"].item()), state


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
        np.testing.assert_array_equal(ours[f"param.{n}"].numpy(), p.detach().numpy(), err_msg=n)
        step, state = parse_state(ours, n)
        expected = opt.state[p]
        assert step == expected["step"] == STEPS
        assert (expected["state1"].dtype == torch.uint8) == ("absmax1" in state), n
        for key, value in state.items():
            np.testing.assert_array_equal(value, expected[key].reshape(-1).numpy(), err_msg=f"{n} {key}")
