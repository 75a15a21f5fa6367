"""Our Adafactor against transformers.optimization.Adafactor: the same parameters and gradients, several steps,
several shapes (matrices, a 3-d tensor, vectors) and option sets; parameters and state within 1e-6."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.optimization import Adafactor

from test_models import parity_tool, run_parity_tool  # noqa: F401 (fixture)

SHAPES = {"w": (7, 5), "tall": (33, 3), "cube": (4, 3, 6), "row": (1, 9), "vector": (11,), "one": (1,)}
STEPS = 6

OPTIONS = {
    # What transformers' Trainer passes for optim="adafactor" (and our defaults).
    "trainer": ({"scale_parameter": False, "relative_step": False}, {"lr": 1e-2, "scale_parameter": False,
                                                                      "relative_step": False, "warmup_init": False}),
    # The class's defaults: relative step size, parameter scaling.
    "relative": ({"scale_parameter": True, "relative_step": True}, {"lr": None}),
    "warmup": ({"scale_parameter": True, "relative_step": True, "warmup_init": True},
               {"lr": None, "warmup_init": True}),
    "beta1_decay_clip": ({"adafactor_beta1": True, "beta1": 0.9, "weight_decay": 0.1, "clip_threshold": 0.5,
                          "scale_parameter": True, "relative_step": False},
                         {"lr": 3e-2, "beta1": 0.9, "weight_decay": 0.1, "clip_threshold": 0.5,
                          "scale_parameter": True, "relative_step": False}),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_adafactor_matches_transformers(option, tmp_path, parity_tool):
    ours_options, their_options = OPTIONS[option]
    generator = torch.Generator().manual_seed(3)
    params = {name: torch.randn(shape, generator=generator) * 0.5 for name, shape in SHAPES.items()}
    grads = [{name: torch.randn(shape, generator=generator) * (0.1 + step) for name, shape in SHAPES.items()}
             for step in range(STEPS)]
    grads[2]["w"][0].zero_()  # a row with no gradient: eps1 alone keeps its statistics finite
    lrs = [their_options["lr"] or 0.0] * STEPS
    tensors = {f"param.{n}": p for n, p in params.items()}
    for step, g in enumerate(grads):
        tensors.update({f"grad.{step}.{n}": t for n, t in g.items()})
    save_file(tensors, tmp_path / "in.safetensors")
    run_parity_tool(parity_tool, "optimizer", tmp_path / "in.safetensors", tmp_path / "out.safetensors",
                    json.dumps({"name": "adafactor", "lrs": lrs, **ours_options}))
    ours = load_file(tmp_path / "out.safetensors")

    theirs = {n: torch.nn.Parameter(p.clone()) for n, p in params.items()}
    optimizer = Adafactor(list(theirs.values()), **their_options)
    for g in grads:
        for n, p in theirs.items():
            p.grad = g[n].clone()
        optimizer.step()

    for n, p in theirs.items():
        moved = (p.detach() - params[n]).abs().max().item()
        assert moved > 1e-6, f"{n} did not move: the test would prove nothing"
        torch.testing.assert_close(ours[f"param.{n}"], p.detach(), atol=1e-6, rtol=1e-6, msg=lambda m: f"{n}: {m}")
        # The movement itself too (warmup_init moves by ~1e-5 only, below the absolute tolerance above).
        torch.testing.assert_close(ours[f"param.{n}"] - params[n], p.detach() - params[n], atol=1e-8, rtol=1e-3,
                                   msg=lambda m: f"{n} (update): {m}")
        state = optimizer.state[p]
        if len(SHAPES[n]) >= 2:
            pairs = [("exp_avg_sq_row", state["exp_avg_sq_row"]), ("exp_avg_sq_col", state["exp_avg_sq_col"])]
        else:
            pairs = [("exp_avg_sq", state["exp_avg_sq"])]
        if "exp_avg" in state:
            pairs.append(("exp_avg", state["exp_avg"]))
        for key, expected in pairs:
            torch.testing.assert_close(ours[f"state.{key}.{n}"], expected, atol=1e-6, rtol=1e-5,
                                       msg=lambda m: f"{key}.{n}: {m}")
    names = {k for k in ours if k.startswith("state.")}
    assert len(names) == sum(2 if len(s) >= 2 else 1 for s in SHAPES.values()) + (
        len(SHAPES) if "exp_avg" in optimizer.state[theirs["w"]] else 0)


def test_resume_through_the_binary_is_exact_with_bf16_adafactor_and_kahan(run_trainer, tmp_path):
    """configs/t5xl.json's optimizer setting on the tiny T5: 10 steps straight, and 5 + a resume from checkpoint-5,
    give byte-identical weights and optimizer state (Adafactor statistics, Kahan compensation) at step 10."""
    common = ["--config", "configs/tiny-t5.json"]
    for s in ["precision.mode=bf16", "optimizer.name=adafactor", "optimizer.bf16_update=kahan", "optimizer.lr=1e-4",
              "training.max_steps=10", "training.micro_batch_size=8", "evaluation.every_steps=0",
              "evaluation.sample_prompts=[]", "checkpoint.every_steps=5", "checkpoint.save_final=false",
              "logging.progress=off"]:
        common += ["--set", s]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_trainer(*common, "--set", f"checkpoint.output_dir={straight}")
    run_trainer(*common, "--set", f"checkpoint.output_dir={resumed}", "--resume-from", straight / "checkpoint-5")
    for name in ["model.safetensors", "optimizer.safetensors"]:
        assert (straight / "checkpoint-10" / name).read_bytes() == (resumed / "checkpoint-10" / name).read_bytes(), name
    state = load_file(straight / "checkpoint-10" / "optimizer.safetensors")
    assert any(k.startswith("kahan_compensation.") and v.dtype == torch.bfloat16 for k, v in state.items())
    assert any(k.startswith("exp_avg_sq_row.") for k in state)
    assert any(k.startswith("kahan_compensation.") and v.abs().max() > 0 for k, v in state.items())
