"""bitsandbytes as the 4-bit reference on any CPU.

bitsandbytes 0.50.2's CPU library has an AVX-512 loop that reads a row's block scales as if every row started a
block: on a CPU with AVX-512 its dequantize_4bit decodes weights whose rows are not whole blocks to wrong values
(a 40x96 NF4 weight in blocks of 64: up to 0.085 off). The tiny test models' layers are such weights (32 columns,
blocks of 64), so there bitsandbytes' Linear4bit computes with other weights than the format's. Where the library
is wrong on this CPU, `reference_cpu_kernels()` registers the format's definition (bitsandbytes' own torch path:
code table x block scale) as its CPU dequantize_4bit kernel; where it is right nothing changes. `plain_linear4bit`
keeps Linear4bit on its dequantize-and-matmul path: with AVX512-BF16 bitsandbytes repacks a weight for a bf16 CPU
GEMM in inference (other numbers; and `shape '[32, 0]' is invalid` for the tiny shapes).
"""
import functools

import torch

import bitsandbytes as bnb
import bitsandbytes.functional as F
from bitsandbytes.backends.default.ops import _dequantize_4bit_compute


def definition(packed, state):
    """The format's values: code[nibble] * the scale of the element's block, in fp32, rounded once to the dtype."""
    n = state.shape.numel()
    nibbles = torch.stack([packed.reshape(-1) >> 4, packed.reshape(-1) & 15], 1).reshape(-1)[:n].long()
    absmax = state.absmax.float()
    if state.nested:
        absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
    scales = absmax.repeat_interleave(state.blocksize)[:n]
    return (state.code.float()[nibbles] * scales).reshape(state.shape).to(state.dtype)


def library_error():
    """The largest difference between bitsandbytes' CPU dequantize_4bit and the definition, over weights whose rows
    are not whole blocks (the shapes the AVX-512 loop gets wrong) and whose rows are."""
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for shape, blocksize in [((40, 96), 64), ((64, 64), 128), ((32, 32), 64), ((24, 128), 64)]:
        for quant_type in ("nf4", "fp4"):
            w = torch.randn(shape, generator=g) * 0.05
            packed, state = F.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type, compress_statistics=False)
            worst = max(worst, (F.dequantize_4bit(packed, state) - definition(packed, state)).abs().max().item())
    return worst


@functools.cache
def reference_cpu_kernels():
    """Makes bitsandbytes' CPU dequantize_4bit the format's definition if its library is wrong on this CPU; returns
    the library's measured error (0.0: left as it is)."""
    error = library_error()
    if error > 0.0:
        @torch.library.register_kernel("bitsandbytes::dequantize_4bit", "cpu")
        def _(A, absmax, blocksize, quant_type, shape, dtype):
            code = F.get_4bit_type(quant_type, device=A.device)
            return _dequantize_4bit_compute(A.view(torch.uint8).reshape(-1), absmax.float(), code, blocksize, shape,
                                            dtype)
        assert library_error() == 0.0
    return error


def plain_linear4bit(model):
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    return model
