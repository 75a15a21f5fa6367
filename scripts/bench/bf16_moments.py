#!/usr/bin/env python3
"""Does AdamW's second moment need stochastic rounding when it is kept in bf16 (optimizer.state_dtype=bf16)?

Follows v_t = beta2 v + (1 - beta2) g^2 (beta2 0.999, gradients of fixed scale per element) in fp32, in bf16 rounded
to nearest, and in bf16 rounded stochastically (as trainer rounds: random low 16 bits added before truncation),
and prints the relative error of sqrt(v_hat) (what divides the update) against fp32 at several steps.

    .venv/bin/python scripts/bench/bf16_moments.py
"""
import torch


def stochastic_bf16(x):
    bits = x.view(torch.int32)
    noise = torch.randint(0, 65536, x.shape, dtype=torch.int32)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)


def main(n=20000, beta2=0.999, steps=3000):
    torch.manual_seed(0)
    scale = torch.rand(n) * 2 + 0.5
    v32 = torch.zeros(n)
    nearest = torch.zeros(n, dtype=torch.bfloat16)
    stochastic = torch.zeros(n, dtype=torch.bfloat16)
    print("| step | nearest: mean error of sqrt(v) | stochastic: mean error | stochastic: rms error |")
    print("|---:|---:|---:|---:|")
    for t in range(1, steps + 1):
        g2 = (torch.randn(n) * scale) ** 2
        v32 = beta2 * v32 + (1 - beta2) * g2
        nearest = (beta2 * nearest.float() + (1 - beta2) * g2).to(torch.bfloat16)
        stochastic = stochastic_bf16(beta2 * stochastic.float() + (1 - beta2) * g2)
        if t in (100, 300, 1000, 3000):
            def error(v):
                return v.float().sqrt() / v32.sqrt() - 1  # the bias correction cancels
            print(f"| {t} | {error(nearest).mean():+.2%} | {error(stochastic).mean():+.2%} | "
                  f"{error(stochastic).pow(2).mean().sqrt():.2%} |")


if __name__ == "__main__":
    main()
