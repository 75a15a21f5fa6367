"""Image decoding and preprocessing against Pillow and transformers' image processors.

Our decoder (libjpeg-turbo, libpng, libwebp) must give the pixels of Pillow's `exif_transpose(open(f)).convert("RGB")`
(what transformers' `load_image` returns); our resize must give Pillow's `Image.resize` pixels; the whole
preprocessing must give what ViTImageProcessorPil / CLIPImageProcessorPil give. The C++ side runs through
build/trainer_image_tool.
"""
import io
import json
import os
import pathlib
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from PIL import Image, ImageOps

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def image_tool():
    binary = os.environ.get("TRAINER_BINARY", str(ROOT / "build" / "trainer"))
    path = pathlib.Path(os.environ.get("TRAINER_IMAGE_TOOL", pathlib.Path(binary).parent / "trainer_image_tool"))
    if not path.exists():
        pytest.fail(f"{path} does not exist: build first (cmake --build build)")
    return path


class Tool:
    """One trainer_image_tool process in batch mode: one command a line, "ok" or "error ..." back."""

    def __init__(self, path):
        self.process = subprocess.Popen([str(path), "batch"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)

    def __call__(self, *args):
        self.process.stdin.write(" ".join(map(str, args)) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline().rstrip("\n")
        return answer

    def close(self):
        self.process.stdin.close()
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def tool(image_tool):
    t = Tool(image_tool)
    yield t
    t.close()


def read_raw(path, dtype=np.uint8):
    data = pathlib.Path(path).read_bytes()
    width, height = struct.unpack("<ii", data[:8])
    pixels = np.frombuffer(data[8:], dtype=dtype)
    if dtype == np.uint8:
        return pixels.reshape(height, width, 3)
    return pixels.reshape(3, height, width)


def pillow_rgb(path):
    with Image.open(path) as image:
        return np.asarray(ImageOps.exif_transpose(image).convert("RGB"))


@pytest.fixture(scope="module")
def demo_images(tmp_path_factory):
    """The demo set (every file kind the generator makes) plus the rarer encodings a decoder meets."""
    out = tmp_path_factory.mktemp("demo-images")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_demo_images.py"), "--out", str(out), "--classes",
                    "10", "--per-class", "8", "--validation-per-class", "0", "--min-size", "17", "--max-size",
                    "120"], check=True, capture_output=True)
    extra = out / "extra"
    extra.mkdir()
    base = Image.open(next((out / "train" / "circle-red").glob("*.jpg"))).convert("RGB").resize((37, 29))
    base.save(extra / "progressive.jpg", progressive=True, quality=85)
    base.save(extra / "subsampling-444.jpg", subsampling=0, quality=95)
    base.save(extra / "optimized.png", optimize=True)
    base.convert("1").save(extra / "bilevel.png")
    base.convert("L").quantize(4).save(extra / "palette-2bit.png", bits=2)
    base.convert("L").save(extra / "gray-trns.png", transparency=128)
    palette_t = base.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    palette_t.save(extra / "palette-trns.png", transparency=3)
    rgb16 = np.asarray(base, dtype=np.uint16) * 257 + 5
    write_png16_rgb(extra / "rgb16.png", rgb16)
    base.save(extra / "lossless.webp", lossless=True)
    return sorted(p for p in out.rglob("*") if p.suffix in (".jpg", ".png", ".webp"))


def png_chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def write_png16_rgb(path, pixels):
    height, width, _ = pixels.shape
    raw = b"".join(b"\x00" + pixels[y].astype(">u2").tobytes() for y in range(height))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0))
                     + png_chunk(b"IDAT", zlib.compress(raw)) + png_chunk(b"IEND", b""))


def test_demo_set_has_every_kind(demo_images):
    modes = {}
    for path in demo_images:
        with Image.open(path) as image:
            modes.setdefault(image.mode, 0)
            modes[image.mode] += 1
            if image.getexif().get(0x0112, 1) != 1:
                modes.setdefault("exif", 0)
                modes["exif"] += 1
    for mode in ("RGB", "L", "P", "RGBA", "LA", "CMYK", "exif", "1"):
        assert modes.get(mode, 0) > 0, f"no {mode} image among {modes}"


def test_decode_matches_pillow(tool, demo_images, tmp_path):
    """Every file decodes to Pillow's RGB pixels: exactly for PNG and WebP; JPEG within one grey level (libjpeg
    builds may round the colour conversion differently)."""
    worst = {}
    for path in demo_images:
        out = tmp_path / "decoded.raw"
        assert tool("decode", path, out) == "ok", path
        ours = read_raw(out).astype(int)
        theirs = pillow_rgb(path).astype(int)
        assert ours.shape == theirs.shape, f"{path}: {ours.shape} vs Pillow {theirs.shape}"
        diff = int(np.abs(ours - theirs).max()) if ours.size else 0
        worst[path.suffix] = max(worst.get(path.suffix, 0), diff)
        limit = 1 if path.suffix == ".jpg" else 0
        assert diff <= limit, f"{path}: max difference {diff} from Pillow"
    print("worst difference per format:", worst)


FILTERS = {"bilinear": 2, "bicubic": 3, "lanczos": 1, "box": 4, "hamming": 5}
# (width, height) of the source and of the target: down and up, by large and small and fractional factors,
# odd sizes, one axis only, extreme aspect ratios.
RESIZES = [((97, 61), (224, 224)), ((640, 480), (224, 224)), ((480, 640), (224, 224)), ((225, 225), (224, 224)),
           ((223, 223), (224, 224)), ((1000, 37), (224, 224)), ((37, 1000), (48, 48)), ((301, 199), (150, 100)),
           ((301, 199), (301, 100)), ((301, 199), (120, 199)), ((64, 64), (7, 5)), ((5, 3), (64, 64)),
           ((333, 222), (224, 149)), ((1, 1), (3, 3)), ((2, 9), (1, 1)), ((512, 384), (384, 384))]


@pytest.fixture(scope="module")
def resize_sources(tmp_path_factory, demo_images):
    """Lossless PNG sources of each RESIZES size, cut from demo images (textured, with hard edges)."""
    out = tmp_path_factory.mktemp("resize-sources")
    rng = np.random.default_rng(0)
    sources = {}
    for i, ((w, h), _) in enumerate(RESIZES):
        if (w, h) in sources:
            continue
        picture = Image.fromarray(pillow_rgb(demo_images[i * 7 % len(demo_images)])).resize((w, h), Image.NEAREST)
        array = np.asarray(picture).copy()
        array[rng.random(array.shape[:2]) < 0.02] = 255  # salt: overshoot of the negative lobes gets clipped
        path = out / f"{w}x{h}.png"
        Image.fromarray(array).save(path)
        sources[(w, h)] = path
    return sources


@pytest.mark.parametrize("filter_name", list(FILTERS))
def test_resize_matches_pillow(tool, resize_sources, tmp_path, filter_name):
    """Our resize gives Pillow's `Image.resize` pixels (the requirement is one grey level; we hold it exactly)."""
    for (source, (width, height)) in RESIZES:
        path = resize_sources[source]
        out = tmp_path / "resized.raw"
        assert tool("resize", path, width, height, FILTERS[filter_name], out) == "ok"
        ours = read_raw(out).astype(int)
        with Image.open(path) as image:
            theirs = np.asarray(image.convert("RGB").resize((width, height), FILTERS[filter_name])).astype(int)
        assert ours.shape == theirs.shape
        diff = int(np.abs(ours - theirs).max())
        assert diff == 0, f"{filter_name} {source} -> {(width, height)}: max difference {diff}"


PROCESSORS = [
    ("ViTImageProcessor", {"size": {"height": 224, "width": 224}, "resample": 2, "image_mean": [0.5, 0.5, 0.5],
                           "image_std": [0.5, 0.5, 0.5], "do_resize": True, "do_rescale": True, "do_normalize": True}),
    ("ViTImageProcessor", {"size": {"height": 32, "width": 48}, "resample": 3,
                           "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}),
    ("CLIPImageProcessor", {"size": {"shortest_edge": 224}, "crop_size": {"height": 224, "width": 224},
                            "do_center_crop": True, "resample": 3,
                            "image_mean": [0.48145466, 0.4578275, 0.40821073],
                            "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True}),
    ("CLIPImageProcessor", {"size": {"shortest_edge": 30}, "crop_size": {"height": 40, "width": 26},
                            "do_center_crop": True, "resample": 2}),
]


@pytest.mark.parametrize("index", range(len(PROCESSORS)))
def test_preprocess_matches_transformers(tool, demo_images, tmp_path, index):
    """resize + crop + rescale + normalise from preprocessor_config.json, against transformers' Pil processors
    on the same decoded image: pixels within one grey level before normalisation (we hold them equal), and the
    normalised tensor within float rounding."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil
    kind, config = PROCESSORS[index]
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": kind, **config}))
    processor_class = ViTImageProcessorPil if kind == "ViTImageProcessor" else CLIPImageProcessorPil
    processor = processor_class(**config)
    raw_processor = processor_class(**{**config, "do_rescale": False, "do_normalize": False})
    for path in demo_images[::3]:
        u8, f32 = tmp_path / "u8.raw", tmp_path / "f32.raw"
        assert tool("preprocess", model_dir, path, u8, f32) == "ok", path
        image = Image.fromarray(pillow_rgb(path))
        theirs_pixels = np.asarray(raw_processor(image, return_tensors="np")["pixel_values"][0])
        ours_pixels = read_raw(u8).transpose(2, 0, 1).astype(np.float64)
        assert ours_pixels.shape == theirs_pixels.shape, path
        assert np.abs(ours_pixels - theirs_pixels).max() <= 1.0, f"{path}: pixels differ by more than one level"
        assert np.abs(ours_pixels - theirs_pixels).max() == 0.0, f"{path}: pixels differ from Pillow's"
        theirs = np.asarray(processor(image, return_tensors="np")["pixel_values"][0], dtype=np.float32)
        ours = read_raw(f32, np.float32)
        assert ours.shape == theirs.shape
        assert np.abs(ours - theirs).max() < 1e-5, f"{path}: normalised values differ"


# ---- bad images -------------------------------------------------------------------------------------------------

def bomb_png(path, width, height):
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + png_chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + png_chunk(b"IEND", b""))


def bomb_jpeg(path, width, height):
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 20, 30)).save(buffer, "JPEG")
    data = bytearray(buffer.getvalue())
    sof = data.find(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    path.write_bytes(bytes(data))


def bad_files(tmp_path, demo_images):
    jpeg = next(p for p in demo_images if p.suffix == ".jpg").read_bytes()
    png = next(p for p in demo_images if p.suffix == ".png").read_bytes()
    cases = {
        "truncated.jpg": (jpeg[: len(jpeg) // 2], "truncated"),
        "truncated.png": (png[: len(png) // 2], "truncated"),
        "header-only.jpg": (jpeg[:20], "JPEG"),
        "text.jpg": (b"this is not an image\n", "not a JPEG, PNG or WebP image"),
        "empty.png": (b"", "empty"),
        "bad-crc.png": (png[:30] + bytes([png[30] ^ 0xFF]) + png[31:], "PNG"),  # the header chunk's CRC
        "picture.gif": (b"GIF89a" + b"\x00" * 20, "not a JPEG, PNG or WebP image"),
    }
    for name, (data, _) in cases.items():
        (tmp_path / name).write_bytes(data)
    bomb_png(tmp_path / "bomb.png", 50000, 50000)
    cases["bomb.png"] = (None, "decompression bomb")
    bomb_jpeg(tmp_path / "bomb.jpg", 50000, 50000)
    cases["bomb.jpg"] = (None, "decompression bomb")
    bomb_png(tmp_path / "zero.png", 0, 10)
    cases["zero.png"] = (None, "PNG")
    cases["missing.jpg"] = (None, "cannot open")
    (tmp_path / "folder.jpg").mkdir()
    cases["folder.jpg"] = (None, "is not a regular file")
    return {tmp_path / name: expected for name, (_, expected) in cases.items()}


def test_bad_images_are_data_errors(image_tool, demo_images, tmp_path):
    """Each bad file: exit 3 and a message that starts with the file's path and says what is wrong."""
    for path, expected in bad_files(tmp_path, demo_images).items():
        result = subprocess.run([str(image_tool), "decode", str(path), str(tmp_path / "out.raw")],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 3, f"{path.name}: exit {result.returncode}, {result.stderr}"
        assert result.stderr.startswith(f"error: {path}: "), result.stderr
        assert expected.lower() in result.stderr.lower(), f"{path.name}: {result.stderr}"
        # Pillow refuses these too (no file here that Pillow reads and we do not).
        with pytest.raises(Exception):
            with Image.open(path) as image:
                Image.MAX_IMAGE_PIXELS = 89478485
                image.load()
                if image.width * image.height > Image.MAX_IMAGE_PIXELS:
                    raise Image.DecompressionBombError("too large")


def test_bomb_allocates_nothing(image_tool, tmp_path):
    """The 50000 x 50000 header is refused before the 7.5 GB of pixels are allocated: the tool runs under a 1 GiB
    address-space limit and still answers with the data error."""
    bomb_png(tmp_path / "bomb.png", 50000, 50000)
    result = subprocess.run(["bash", "-c", f"ulimit -v 1048576; exec {image_tool} decode {tmp_path}/bomb.png "
                             f"{tmp_path}/out.raw"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3 and "decompression bomb" in result.stderr, result.stderr


# ---- datasets: image folders and JSONL --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_set(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo-set")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_demo_images.py"), "--out", str(out), "--classes",
                    "4", "--per-class", "5", "--validation-per-class", "2"], check=True, capture_output=True)
    (out / "train" / "circle-red" / "README.txt").write_text("not an image\n")
    return out


def list_dataset(tool, tmp_path, sources, classes="-", policy="error"):
    out = tmp_path / "list.json"
    answer = tool("list", ",".join(map(str, sources)), classes, policy, out)
    if answer != "ok":
        return answer
    return json.loads(out.read_text())


def test_folder_classes_sorted_and_files_as_imagefolder(tool, demo_set, tmp_path):
    listed = list_dataset(tool, tmp_path, [demo_set / "train"])
    classes = sorted(p.name for p in (demo_set / "train").iterdir() if p.is_dir())
    assert listed["classes"] == classes
    expected = [(str(f), classes.index(c)) for c in classes
                for f in sorted((demo_set / "train" / c).iterdir()) if f.suffix in (".jpg", ".png")]
    assert [(r[0], r[1]) for r in listed["records"]] == expected
    assert listed["other_files"] == 1  # README.txt: counted, not read
    assert listed["bad_records_skipped"] == 0


def test_jsonl_gives_the_folder_dataset(tool, demo_set, tmp_path):
    folder = list_dataset(tool, tmp_path, [demo_set / "train"])
    jsonl = list_dataset(tool, tmp_path, [demo_set / "train.jsonl"])
    assert jsonl["classes"] == folder["classes"]
    assert sorted((r[0], r[1]) for r in jsonl["records"]) == sorted((r[0], r[1]) for r in folder["records"])
    assert jsonl["records"][0][2] == f"{demo_set / 'train.jsonl'}:1"
    # Validation with the training classes: the same ids for the same names.
    validation = list_dataset(tool, tmp_path, [demo_set / "validation.jsonl"], ",".join(folder["classes"]))
    for path, label, _ in validation["records"]:
        assert folder["classes"][label] == pathlib.Path(path).parent.name


def test_bad_records_name_file_and_line_or_are_counted(tool, demo_set, tmp_path):
    good = (demo_set / "train.jsonl").read_text().splitlines()[:3]
    bad = ["{not json", '{"label": "circle-red"}', '{"image": "train/x.jpg", "label": "hexagon-gold"}',
           '{"image": "train/x.jpg", "label": 9}', '{"image": "train/x.jpg", "label": [1]}']
    path = demo_set / "bad.jsonl"
    path.write_text("\n".join(good[:1] + bad + good[1:]) + "\n")
    classes = ",".join(list_dataset(tool, tmp_path, [demo_set / "train"])["classes"])
    answer = list_dataset(tool, tmp_path, [path], classes)
    assert answer.startswith(f"error {path}:2: invalid JSON"), answer
    path.write_text("\n".join(good[:1] + bad[2:3]) + "\n")
    answer = list_dataset(tool, tmp_path, [path], classes)
    assert answer.startswith(f'error {path}:2: label "hexagon-gold" is not one of the 4 classes'), answer
    path.write_text("\n".join(good[:1] + bad + good[1:]) + "\n")
    skipped = list_dataset(tool, tmp_path, [path], classes, "skip")
    assert skipped["bad_records_skipped"] == len(bad)
    assert len(skipped["records"]) == 3


def test_decoding_on_threads_is_the_same_and_bad_images_are_skipped_or_stop(tool, demo_set, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "ViTImageProcessor", "size": {"height": 24, "width": 24}, "resample": 2}))
    results = []
    for threads in (1, 3):
        f32, meta = tmp_path / f"pixels{threads}.raw", tmp_path / f"meta{threads}.json"
        assert tool("decode-batch", demo_set / "train", "-", model_dir, threads, "error", f32, meta) == "ok"
        results.append((pathlib.Path(f32).read_bytes(), json.loads(meta.read_text())))
    assert results[0] == results[1]
    listed = list_dataset(tool, tmp_path, [demo_set / "train"])
    assert results[0][1]["labels"] == [r[1] for r in listed["records"]]
    # One image, preprocessed alone, is the same as in the batch.
    first = listed["records"][3][0]
    assert tool("preprocess", model_dir, first, tmp_path / "u8.raw", tmp_path / "one.raw") == "ok"
    batch = np.frombuffer(results[0][0][8:], dtype=np.float32).reshape(-1, 3, 24, 24)
    assert np.array_equal(batch[3], read_raw(tmp_path / "one.raw", np.float32))
    # A truncated image: the error names it; with skip it is left out and described.
    broken = demo_set / "broken"
    (broken / "circle-red").mkdir(parents=True)
    good = pathlib.Path(listed["records"][0][0])
    (broken / "circle-red" / ("a" + good.suffix)).write_bytes(good.read_bytes())
    (broken / "circle-red" / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 10)
    answer = tool("decode-batch", broken, "-", model_dir, 2, "error", tmp_path / "p.raw", tmp_path / "m.json")
    assert answer.startswith(f"error {broken / 'circle-red' / 'b.png'}: "), answer
    assert tool("decode-batch", broken, "-", model_dir, 2, "skip", tmp_path / "p.raw", tmp_path / "m.json") == "ok"
    meta = json.loads((tmp_path / "m.json").read_text())
    assert meta["kept"] == [0] and len(meta["problems"]) == 1 and "b.png" in meta["problems"][0]


def test_damaged_files_never_crash_the_decoder(tool, demo_images, tmp_path):
    """Random damage (byte flips, cuts, garbage EXIF blocks) to real files: every file decodes or is a DataError
    naming it; the decoder process never dies. (scripts/fuzz_images.sh runs the same under ASan/UBSan.)"""
    rng = np.random.default_rng(5)
    sources = [p for p in demo_images if p.suffix in (".jpg", ".png", ".webp")][:24]
    outcomes = {"ok": 0, "error": 0}
    for n in range(240):
        data = bytearray(sources[n % len(sources)].read_bytes())
        kind = n % 4
        if kind == 0:  # flip some bytes anywhere
            for _ in range(int(rng.integers(1, 8))):
                data[int(rng.integers(0, len(data)))] ^= int(rng.integers(1, 256))
        elif kind == 1:  # cut at a random point
            data = data[:int(rng.integers(1, len(data)))]
        elif kind == 2:  # damage the first 64 bytes (headers)
            for _ in range(3):
                data[int(rng.integers(0, min(64, len(data))))] = int(rng.integers(0, 256))
        else:  # a JPEG with a garbage EXIF block, or a PNG with a garbage eXIf chunk
            garbage = (b"MM\x00*" if n % 8 == 3 else b"II*\x00") + rng.integers(0, 256, int(rng.integers(0, 80)),
                                                                                dtype=np.uint8).tobytes()
            if data[:2] == b"\xff\xd8":
                segment = b"Exif\x00\x00" + garbage
                data = data[:2] + b"\xff\xe1" + struct.pack(">H", len(segment) + 2) + segment + data[2:]
            elif data[:4] == b"\x89PNG":
                data = data[:33] + png_chunk(b"eXIf", garbage) + data[33:]
        path = tmp_path / f"damaged-{n}{sources[n % len(sources)].suffix}"
        path.write_bytes(bytes(data))
        answer = tool("decode", path, tmp_path / "out.raw")
        assert answer == "ok" or answer.startswith(f"error {path}: "), answer
        outcomes[answer.split()[0]] += 1
    assert tool.process.poll() is None, "the decoder process died"
    assert outcomes["ok"] > 0 and outcomes["error"] > 0, outcomes
