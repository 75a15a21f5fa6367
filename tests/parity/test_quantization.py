"""4-bit (NF4/FP4) and 8-bit blockwise quantization and AdamW8bit against bitsandbytes 0.50.2 on the CPU.

src/quant must give bitsandbytes' bytes exactly: quantize_4bit's packed nibbles, block absmax and double-quantized
statistics, dequantize_4bit's values in every dtype, the 8-bit dynamic map and blockwise codes, and AdamW8bit's
weights and states after several steps (an fp32-state tensor under min_8bit_size and 8-bit ones), also across a
save and restore of our state midway. The C++ side runs through build/trainer_quant_tool.
"""
import subprocess

import numpy as np
import pytest
import torch

import bitsandbytes as bnb  # noqa: E402  (requirements.txt pins it: a missing library is a failure, not a skip)
import bitsandbytes.functional as F  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture(scope="session")
def quant_tool(built_tool):
    path = built_tool("trainer_quant_tool", "TRAINER_QUANT_TOOL")
    assert bnb.__version__ == "0.50.2", f"parity is pinned to bitsandbytes 0.50.2, found {bnb.__version__}"
    return path


def run_tool(tool, *args):
    result = subprocess.run([str(tool), *map(str, args)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def raw_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous().reshape(-1)
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def read(path, dtype):
    return np.fromfile(path, dtype=dtype)


def assert_same_bits(ours: np.ndarray, theirs: torch.Tensor, what: str):
    theirs_np = np.frombuffer(raw_bytes(theirs), dtype=ours.dtype)
    assert ours.shape == theirs_np.shape, f"{what}: {ours.shape} vs {theirs_np.shape}"
    diff = np.flatnonzero(ours != theirs_np)
    first = diff[:5]
    assert diff.size == 0, (
        f"{what}: {diff.size} of {ours.size} differ, first at {first}: ours {ours[first]} bnb {theirs_np[first]}")


def make_weights(numel: int, blocksize: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gaussian weights at a few scales, one all-zero block, and values that sit exactly on NF4/FP4 midpoints."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(numel, generator=g) * torch.logspace(-3, 1, numel)[torch.randperm(numel, generator=g)]
    if numel >= 3 * blocksize:
        w[blocksize : 2 * blocksize] = 0.0
        # A block whose absmax is 1 holding the bucket boundaries themselves: ties must go to the same side.
        codes = [F.get_4bit_type(t, "cpu").sort().values for t in ("nf4", "fp4")]
        edges = torch.cat([(c[:-1] + c[1:]) / 2 for c in codes])
        block = torch.zeros(blocksize)
        block[0] = 1.0
        block[1 : 1 + min(edges.numel(), blocksize - 1)] = edges[: blocksize - 1]
        w[2 * blocksize : 3 * blocksize] = block
    return w.to(dtype)


@pytest.mark.parametrize("signed", ["signed", "unsigned"])
def test_dynamic_map(quant_tool, tmp_path, signed):
    run_tool(quant_tool, "dynamic_map", signed, tmp_path / "map")
    assert_same_bits(read(tmp_path / "map", np.uint32), F.create_dynamic_map(signed=signed == "signed"), "dynamic map")


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_4bit_code(quant_tool, tmp_path, quant_type):
    run_tool(quant_tool, "code4", quant_type, tmp_path / "code")
    assert_same_bits(read(tmp_path / "code", np.uint32), F.get_4bit_type(quant_type, "cpu"), "4-bit code")


@pytest.mark.parametrize("numel", [1, 255, 256, 1000, 4097, 100_003])
@pytest.mark.parametrize("blocksize", [64, 256, 4096])
@pytest.mark.parametrize("signed", ["signed", "unsigned"])
def test_quantize_blockwise_8bit(quant_tool, tmp_path, numel, blocksize, signed):
    g = torch.Generator().manual_seed(numel + blocksize)
    x = torch.randn(numel, generator=g) * torch.logspace(-8, 2, numel)
    if signed == "unsigned":
        x = x * x
    if numel > 2 * blocksize:
        x[:blocksize] = 0.0
    (tmp_path / "in").write_bytes(raw_bytes(x))
    run_tool(quant_tool, "quantize8", tmp_path / "in", numel, blocksize, signed, tmp_path / "out")
    codes, state = F.quantize_blockwise(x, code=F.create_dynamic_map(signed=signed == "signed"), blocksize=blocksize)
    assert_same_bits(read(tmp_path / "out" / "codes", np.uint8), codes, "codes")
    assert_same_bits(read(tmp_path / "out" / "absmax", np.uint32), state.absmax, "absmax")


CASES_4BIT = [
    (numel, blocksize)
    for numel, blocksize in [(4096, 64), (70_001, 64), (333, 64), (1_000_001, 64), (12_345, 128), (65_537, 256),
                             (9_999, 1024), (200_000, 2048), (50_001, 4096), (77, 4096)]
]


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "double"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("numel,blocksize", CASES_4BIT)
def test_quantize_dequantize_4bit(quant_tool, tmp_path, numel, blocksize, quant_type, dtype, compress):
    w = make_weights(numel, blocksize, DTYPES[dtype], seed=numel * 7 + blocksize)
    (tmp_path / "in").write_bytes(raw_bytes(w))
    out = tmp_path / "ours"
    run_tool(quant_tool, "quantize4", tmp_path / "in", dtype, numel, blocksize, quant_type, int(compress), out)
    packed, state = F.quantize_4bit(w, blocksize=blocksize, compress_statistics=compress, quant_type=quant_type)
    assert_same_bits(read(out / "packed", np.uint8), packed, "packed")
    if compress:
        assert_same_bits(read(out / "nested_codes", np.uint8), state.absmax, "nested codes (absmax)")
        assert_same_bits(read(out / "nested_absmax", np.uint32), state.state2.absmax, "nested_absmax")
        assert_same_bits(read(out / "nested_offset", np.uint32), state.offset.reshape(1), "nested offset")
        assert state.state2.blocksize == 256
        assert torch.equal(state.state2.code, F.create_dynamic_map(signed=True))
    else:
        assert_same_bits(read(out / "absmax", np.uint32), state.absmax, "absmax")

    # Dequantize bitsandbytes' own state (not ours), so this checks dequantization on its own.
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "packed").write_bytes(raw_bytes(packed))
    if compress:
        (theirs / "nested_codes").write_bytes(raw_bytes(state.absmax))
        (theirs / "nested_absmax").write_bytes(raw_bytes(state.state2.absmax))
        (theirs / "nested_offset").write_bytes(raw_bytes(state.offset.reshape(1)))
    else:
        (theirs / "absmax").write_bytes(raw_bytes(state.absmax))
    run_tool(quant_tool, "dequantize4", theirs, numel, blocksize, quant_type, int(compress), dtype, tmp_path / "deq")
    expected = F.dequantize_4bit(packed, state)
    width = np.uint32 if dtype == "float32" else np.uint16
    assert_same_bits(read(tmp_path / "deq", width), expected, "dequantized")


ADAM = dict(lr=1e-3, betas=(0.9, 0.995), eps=1e-6, weight_decay=0.1)
ADAM_SIZES = [1000, 4095, 4096, 5000, 70_000]  # under and over min_8bit_size=4096


def bnb_adamw(params, grads_per_step):
    """bitsandbytes' AdamW8bit over the steps; also each step's moments before the step, dequantized to fp32."""
    torch_params = [torch.nn.Parameter(p.clone()) for p in params]
    opt = bnb.optim.AdamW8bit(torch_params, **ADAM)
    moments_before = []
    for grads in grads_per_step:
        before = []
        for p, g in zip(torch_params, grads):
            p.grad = g.clone()
            state = opt.state.get(p)
            if not state:
                before.append((torch.zeros(p.numel()), torch.zeros(p.numel())))
            elif state["state1"].dtype == torch.uint8:
                before.append(tuple(F.dequantize_blockwise(state[f"state{k}"], absmax=state[f"absmax{k}"],
                                                           code=state[f"qmap{k}"], blocksize=256) for k in (1, 2)))
            else:
                before.append((state["state1"].clone(), state["state2"].clone()))
        moments_before.append(before)
        opt.step()
    return torch_params, opt, moments_before


def f32_fma(a, b, c):
    # The product of two fp32 values is exact in fp64; one rounding to fp64 then to fp32 matches a fused
    # multiply-add except in vanishingly rare double-rounding cases.
    return (a.astype(np.float64) * np.float64(b) + c.astype(np.float64)).astype(np.float32)


def transcribe_adamw8bit_params(p0, grads, moments_before, is_8bit):
    """bitsandbytes' CPU AdamW8bit update (backends/cpu/ops.py) in numpy with a correctly rounded sqrt.

    torch 2.13's CPU sqrt (MKL VML) is not correctly rounded (about 1 fp32 result in 6 is 1 ulp off), so the
    weights bitsandbytes computes cannot be reproduced by portable code; the moments do not use sqrt and match
    bitsandbytes exactly. This transcription uses bitsandbytes' op order with IEEE sqrt.
    """
    f = np.float32
    lr, (b1, b2), eps, wd = ADAM["lr"], ADAM["betas"], ADAM["eps"], ADAM["weight_decay"]
    p = p0.numpy().astype(f)
    for step, (g, (m_old, v_old)) in enumerate(zip(grads, moments_before), start=1):
        g = g.numpy()
        m = f32_fma(g, f(1 - b1), (m_old.numpy() * f(b1)).astype(f))
        v = f32_fma((f(1 - b2) * g).astype(f), g, (v_old.numpy() * f(b2)).astype(f))
        c1 = 1.0 - b1**step
        c2 = (1.0 - b2**step) ** 0.5
        p = (p * f(1.0 - lr * wd)).astype(f)
        if is_8bit:
            denom = (np.sqrt(v) / f(c2) + f(eps)).astype(f)
            p = (p + (f(-lr / c1) * m).astype(f) / denom).astype(f)
        else:
            update = (m / (np.sqrt(v) + f(eps * c2))).astype(f)
            p = f32_fma(update, f(-lr * c2 / c1), p)
    return p


def run_ours(tool, tmp_path, name, param, grads, state_in):
    (tmp_path / f"{name}.param").write_bytes(raw_bytes(param))
    (tmp_path / f"{name}.grads").write_bytes(b"".join(raw_bytes(g) for g in grads))
    out = tmp_path / name
    run_tool(tool, "adamw", tmp_path / f"{name}.param", tmp_path / f"{name}.grads", param.numel(), len(grads),
             ADAM["lr"], ADAM["betas"][0], ADAM["betas"][1], ADAM["eps"], ADAM["weight_decay"], 4096,
             state_in, out)
    return out


def test_adamw8bit_steps_and_resume(quant_tool, tmp_path):
    g = torch.Generator().manual_seed(3)
    params = [torch.randn(n, generator=g) * 0.02 for n in ADAM_SIZES]
    steps = 6
    grads = [[torch.randn(n, generator=g) * 10 ** float(torch.empty(1).uniform_(-4, 0, generator=g))
              for n in ADAM_SIZES] for _ in range(steps)]
    for grads_of_step in grads:
        grads_of_step[3][:512] = 0.0  # zero gradients: the unsigned second moment's zero code
    torch_params, opt, moments_before = bnb_adamw(params, grads)
    for i, (p0, p) in enumerate(zip(params, torch_params)):
        whole = run_ours(quant_tool, tmp_path, f"whole{i}", p0, [s[i] for s in grads], "-")
        first = run_ours(quant_tool, tmp_path, f"first{i}", p0, [s[i] for s in grads[:3]], "-")
        resumed = run_ours(quant_tool, tmp_path, f"resumed{i}", torch.from_numpy(read(first / "param", np.float32)),
                           [s[i] for s in grads[3:]], first / "state")
        state = opt.state[p]
        assert state["step"] == steps
        is_8bit = p.numel() >= 4096
        assert (state["state1"].dtype == torch.uint8) == is_8bit
        expected = transcribe_adamw8bit_params(p0, [s[i] for s in grads], [m[i] for m in moments_before], is_8bit)
        for out in (whole, resumed):
            ours = read(out / "param", np.float32)
            assert_same_bits(ours.view(np.uint32), torch.from_numpy(expected), f"param {p.numel()} vs transcription")
            # bitsandbytes' own weights differ only by torch's sqrt rounding: a few ulps.
            np.testing.assert_allclose(ours, p.data.numpy(), rtol=1e-5, atol=1e-9)
            if is_8bit:
                assert_same_bits(read(out / "state1", np.uint8), state["state1"], "state1")
                assert_same_bits(read(out / "state2", np.uint8), state["state2"], "state2")
                assert_same_bits(read(out / "absmax1", np.uint32), state["absmax1"], "absmax1")
                assert_same_bits(read(out / "absmax2", np.uint32), state["absmax2"], "absmax2")
            else:
                assert_same_bits(read(out / "state1", np.uint32), state["state1"], "state1")
                assert_same_bits(read(out / "state2", np.uint32), state["state2"], "state2")
        assert (whole / "state").read_bytes() == (resumed / "state").read_bytes()
    # The updates really moved the weights (a test that passes on unchanged weights proves nothing).
    assert all(not torch.equal(p0, p.data) for p0, p in zip(params, torch_params))


def test_torch_sqrt_is_not_correctly_rounded():
    """Why the weights are compared with a transcription: if this starts failing, compare with bitsandbytes."""
    x = torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * 1e-5
    exact = np.sqrt(x.numpy().astype(np.float64)).astype(np.float32)
    assert (x.sqrt().numpy() != exact).sum() > 0


def test_bad_inputs(quant_tool, tmp_path):
    (tmp_path / "in").write_bytes(raw_bytes(torch.ones(100)))
    result = subprocess.run([str(quant_tool), "quantize4", tmp_path / "in", "float32", "100", "100", "nf4", "0",
                             tmp_path / "out"], capture_output=True, text=True)
    assert result.returncode == 1 and "block size 100 is not allowed" in result.stderr
    result = subprocess.run([str(quant_tool), "quantize4", tmp_path / "in", "float32", "100", "64", "int4", "0",
                             tmp_path / "out"], capture_output=True, text=True)
    assert result.returncode == 1 and "unknown 4-bit quant type 'int4'" in result.stderr


@pytest.mark.parametrize("blocks", [1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 127, 129, 255, 257, 511,
                                    513, 1023, 1025, 2049, 4097, 8191, 16385, 32767])
def test_double_quant_offset_many_block_counts(quant_tool, tmp_path, blocks):
    """The nested offset is torch's fp32 absmax.mean(): its summation order shows in the last bit."""
    numel = blocks * 64 - 17
    w = torch.randn(numel, generator=torch.Generator().manual_seed(blocks)) * 3.7
    (tmp_path / "in").write_bytes(raw_bytes(w))
    run_tool(quant_tool, "quantize4", tmp_path / "in", "float32", numel, 64, "nf4", 1, tmp_path / "out")
    _, state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    assert_same_bits(read(tmp_path / "out" / "nested_offset", np.uint32), state.offset.reshape(1), "nested offset")
    assert_same_bits(read(tmp_path / "out" / "nested_absmax", np.uint32), state.state2.absmax, "nested_absmax")
    assert_same_bits(read(tmp_path / "out" / "nested_codes", np.uint8), state.absmax, "nested codes")


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "double"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype,shape", [("bfloat16", (300, 70)), ("float32", (33, 17)), ("float16", (4096,))])
def test_saved_layout(quant_tool, tmp_path, dtype, shape, quant_type, compress):
    """Our tensors and JSON equal QuantState.as_dict(packed=True), what transformers writes to safetensors."""
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(5)).to(DTYPES[dtype])
    (tmp_path / "in").write_bytes(raw_bytes(w))
    run_tool(quant_tool, "layout", tmp_path / "in", dtype, 64, quant_type, int(compress),
             ",".join(map(str, shape)), tmp_path / "out")
    packed, state = F.quantize_4bit(w, blocksize=64, compress_statistics=compress, quant_type=quant_type)
    expected = {"weight": packed, **state.as_dict(packed=True)}
    written = sorted(p.name for p in (tmp_path / "out").iterdir() if not p.name.endswith(".meta"))
    assert written == sorted(expected)
    names = {torch.uint8: "U8", torch.float32: "F32"}
    for key, tensor in expected.items():
        meta = (tmp_path / "out" / f"{key}.meta").read_text().split(" ")
        assert meta[0] == names[tensor.dtype], key
        assert tuple(int(d) for d in meta[1].split(",")) == tuple(tensor.shape), key
        assert (tmp_path / "out" / key).read_bytes() == raw_bytes(tensor), key


def test_python_float_repr(quant_tool):
    values = [2.6060030460357666, 0.0001, 0.00012345, 1e-05, 1.5e-07, 123456789.0, 1e16, 1.2345e16, 1e17, 0.5,
              -3.0, 0.0, 100.0, 3.4028234663852886e38, 1.401298464324817e-45]
    result = subprocess.run([str(quant_tool), "float_repr", *map(repr, values)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [repr(v) for v in values]
