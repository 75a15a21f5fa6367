"""4-bit (NF4/FP4) and 8-bit blockwise quantization against bitsandbytes 0.50.2 on the CPU.

src/quant must give bitsandbytes' bytes exactly: quantize_4bit's packed nibbles, block absmax and double-quantized
statistics, dequantize_4bit's values in every dtype, the 8-bit dynamic map and blockwise codes. The C++ side runs
through build/trainer_quant_tool. (8-bit AdamW, trainer's optimizer, is checked in test_adamw8bit.py.)
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
    assert_equal_arrays(ours, np.frombuffer(raw_bytes(theirs), dtype=ours.dtype), what)


def assert_equal_arrays(ours: np.ndarray, theirs_np: np.ndarray, what: str):
    assert ours.shape == theirs_np.shape, f"{what}: {ours.shape} vs {theirs_np.shape}"
    diff = np.flatnonzero(ours != theirs_np)
    first = diff[:5]
    assert diff.size == 0, (
        f"{what}: {diff.size} of {ours.size} differ, first at {first}: ours {ours[first]} bnb {theirs_np[first]}")


def assert_same_values(ours: np.ndarray, theirs: torch.Tensor, what: str):
    """Bit for bit but for the sign of zero: bitsandbytes' CPU library decodes FP4's nibble 8 as -0.0 in its scalar
    loop (an AVX2 CPU) and as +0.0 in its AVX-512 loop and its torch path; trainer takes the code table's +0.0, the
    format's definition (docs/quantization.md). Both are the same value."""
    sign = np.array(1 << (8 * ours.dtype.itemsize - 1), dtype=ours.dtype)
    theirs_np = np.frombuffer(raw_bytes(theirs), dtype=ours.dtype).copy()
    ours = ours.copy()
    theirs_np[theirs_np == sign] = 0
    ours[ours == sign] = 0
    assert_equal_arrays(ours, theirs_np, what)


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
    # One row: bitsandbytes' CPU library is right here on every CPU (docs/quantization.md), so it is the reference.
    expected = F.dequantize_4bit(packed, state)
    width = np.uint32 if dtype == "float32" else np.uint16
    assert_same_values(read(tmp_path / "deq", width), expected, "dequantized")


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
