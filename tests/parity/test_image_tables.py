"""Image records from tables (issue 54): the same Pillow-made images as an image folder, as JSONL with paths, as a
Parquet file and as a `datasets` save_to_disk folder (Image feature: encoded bytes; ClassLabel labels) give the same
records, the same decoded pixels and the same trained tiny-ViT weights; image-caption tables train CLIP as the
captions JSONL does; bad image bytes are exit 3 naming the file, the row and the column."""
import io
import json
import os
import pathlib
import random
import subprocess

import pytest
import torch
from safetensors.torch import load_file

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLASSES = ["circle", "square", "triangle"]  # sorted, as an image folder's classes are
LABELS = {"circle": "round shape", "square": "four corners", "triangle": "three corners"}


def draw(kind, seed, size=32):
    from PIL import Image, ImageDraw
    rng = random.Random(seed)
    image = Image.new("RGB", (size, size), tuple(rng.randrange(256) for _ in range(3)))
    pen = ImageDraw.Draw(image)
    colour = tuple(rng.randrange(256) for _ in range(3))
    a, b = rng.randrange(2, 10), rng.randrange(22, 30)
    if kind == "circle":
        pen.ellipse((a, a, b, b), fill=colour)
    elif kind == "square":
        pen.rectangle((a, a, b, b), fill=colour)
    else:
        pen.polygon([(a, b), (b, b), ((a + b) // 2, a)], fill=colour)
    return image


@pytest.fixture(scope="module")
def image_sets(tmp_path_factory):
    """train/ and validation/ image folders (PNG and JPEG), train.jsonl / train-captions.jsonl with paths, and the
    same images as Parquet files and datasets save_to_disk folders (embedded bytes, ClassLabel label)."""
    import datasets
    root = tmp_path_factory.mktemp("image-tables")
    sets = {}
    for split, count in (("train", 6), ("validation", 2)):
        rows = []
        for c in CLASSES:
            (root / split / c).mkdir(parents=True)
            for i in range(count):
                path = root / split / c / f"{c}-{i}.{'png' if i % 2 else 'jpg'}"
                draw(c, CLASSES.index(c) * 100 + i + (50 if split == "validation" else 0)).save(path)
                rows.append((path, c))
        rows.sort(key=lambda row: (CLASSES.index(row[1]), str(row[0])))  # the folder's order
        with open(root / f"{split}.jsonl", "w") as out:
            for path, c in rows:
                out.write(json.dumps({"image": str(path.relative_to(root)), "label": c}) + "\n")
        with open(root / f"{split}-captions.jsonl", "w") as out:
            for path, c in rows:
                out.write(json.dumps({"image": str(path.relative_to(root)), "caption": f"a photo of a {c}",
                                      "label": LABELS[c]}) + "\n")
        # Embedded bytes (the files' own), each with its file name as datasets keeps it; ClassLabel ids.
        table = datasets.Dataset.from_dict({
            "image": [{"bytes": p.read_bytes(), "path": p.name} for p, _ in rows],
            "label": [CLASSES.index(c) for _, c in rows]}).cast_column("image", datasets.Image()).cast_column(
            "label", datasets.ClassLabel(names=CLASSES))
        table.to_parquet(str(root / f"{split}.parquet"))
        table.save_to_disk(str(root / f"{split}-saved"))
        captions = datasets.Dataset.from_dict({
            "image": [{"bytes": p.read_bytes(), "path": None} for p, _ in rows],
            "caption": [f"a photo of a {c}" for _, c in rows], "label": [LABELS[c] for _, c in rows]}).cast_column(
            "image", datasets.Image())
        captions.to_parquet(str(root / f"{split}-captions.parquet"))
        captions.save_to_disk(str(root / f"{split}-captions-saved"))
    for name in ("train.parquet", "train-saved/state.json"):
        assert (root / name).exists()
    return root


def arrow_shards(folder):
    return sorted(str(p) for p in pathlib.Path(folder).glob("data-*.arrow"))


@pytest.fixture(scope="module")
def image_tool(trainer_binary):
    return pathlib.Path(os.environ.get("TRAINER_BINARY", str(trainer_binary))).parent / "trainer_image_tool"


def tool_list(image_tool, tmp_path, sources):
    out = tmp_path / "list.json"
    result = subprocess.run([str(image_tool), "list", ",".join(map(str, sources)), "-", "error", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(out.read_text())


def tool_pixels(image_tool, tmp_path, sources):
    spec = tmp_path / "preprocessor_config.json"
    spec.write_text(json.dumps({"image_processor_type": "ViTImageProcessor", "do_resize": True,
                                "size": {"height": 32, "width": 32}, "resample": 2, "do_normalize": True,
                                "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    pixels, meta = tmp_path / "pixels.raw", tmp_path / "meta.json"
    subprocess.run([str(image_tool), "decode-batch", ",".join(map(str, sources)), "-", str(tmp_path), "2", "error",
                    str(pixels), str(meta)], check=True, capture_output=True, timeout=120)
    return pixels.read_bytes(), json.loads(meta.read_text())


def test_tables_give_the_folder_records_and_pixels(image_tool, image_sets, tmp_path):
    folder = tool_list(image_tool, tmp_path, [image_sets / "train"])
    assert folder["classes"] == CLASSES
    labels = [r[1] for r in folder["records"]]
    folder_pixels, folder_meta = tool_pixels(image_tool, tmp_path, [image_sets / "train"])
    for sources in ([image_sets / "train.jsonl"], [image_sets / "train.parquet"],
                    arrow_shards(image_sets / "train-saved")):
        listed = tool_list(image_tool, tmp_path, sources)
        assert listed["classes"] == CLASSES, sources
        assert [r[1] for r in listed["records"]] == labels, sources
        pixels, meta = tool_pixels(image_tool, tmp_path, sources)
        assert meta["labels"] == folder_meta["labels"] and pixels == folder_pixels, sources
    parquet = tool_list(image_tool, tmp_path, [image_sets / "train.parquet"])
    assert parquet["records"][3][2] == f"{image_sets / 'train.parquet'}: row 3 (row group 0)"


def test_classlabel_names_are_the_classes_in_their_order(image_tool, image_sets, tmp_path):
    """ClassLabel ids mean the feature's names, in the feature's order (not sorted): datasets' label ids."""
    import datasets
    names = ["zebra", "apple", "mango"]
    table = datasets.Dataset.from_dict({"image": [str(p) for p in sorted((image_sets / "train" / "circle").iterdir())],
                                        "label": [0, 1, 2, 0, 1, 2]}).cast_column("image", datasets.Image()).cast(
        datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)}))
    table.to_parquet(str(tmp_path / "named.parquet"))
    listed = tool_list(image_tool, tmp_path, [tmp_path / "named.parquet"])
    assert listed["classes"] == names
    assert [r[1] for r in listed["records"]] == [0, 1, 2, 0, 1, 2]


def test_path_column_is_relative_to_the_table(image_tool, image_sets, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [json.loads(line) for line in (image_sets / "train.jsonl").read_text().splitlines()]
    pq.write_table(pa.table({"image": [r["image"] for r in rows], "label": [r["label"] for r in rows]}),
                   image_sets / "paths.parquet")
    listed = tool_list(image_tool, tmp_path, [image_sets / "paths.parquet"])
    folder = tool_list(image_tool, tmp_path, [image_sets / "train"])
    assert [(r[0], r[1]) for r in listed["records"]] == [(r[0], r[1]) for r in folder["records"]]


def vit_config(tmp_path, train, validation, objective=None):
    if objective == "contrastive":
        model = {"path": str(ROOT / "configs" / "models" / "tiny-clip"), "init": "random"}
        extra = {"contrastive": {"negatives": "batch"}}
        evaluation = {"class_prompts": ["a photo of a {}."]}
        training = {"objective": "contrastive"}
    else:
        model = {"path": str(ROOT / "configs" / "models" / "tiny-vit"), "init": "random"}
        extra = {}
        training = {}
        evaluation = {}
    config = {"model": model,
              "data": {"train_files": [str(f) for f in train], "validation_files": [str(f) for f in validation],
                       "augment": objective is None, "num_workers": 2},
              "training": {**training, "batch_size": 6, "micro_batch_size": 6, "max_steps": 4, "seed": 3},
              "evaluation": {"every_steps": 4, "micro_batch_size": 6, **evaluation},
              "optimizer": {"lr": 2e-3},
              "device": {"type": "cpu"},
              "logging": {"every_steps": 1, "progress": "off"}, **extra}
    path = tmp_path / f"config-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps(config))
    return path


def train(trainer_binary, config, out):
    result = subprocess.run([str(trainer_binary), "--config", str(config), "--set", f"checkpoint.output_dir={out}",
                             "--set", "checkpoint.every_steps=0"], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return load_file(str(out / "final" / "model.safetensors")), metrics


@pytest.mark.parametrize("objective", ["classification", "contrastive"])
def test_tables_train_the_weights_the_folder_trains(trainer_binary, image_sets, tmp_path, objective):
    """Same images, same order: the same weights and the same evaluation, bit for bit."""
    if objective == "classification":
        sides = {"folder": ([image_sets / "train"], [image_sets / "validation"]),
                 "jsonl": ([image_sets / "train.jsonl"], [image_sets / "validation.jsonl"]),
                 "parquet": ([image_sets / "train.parquet"], [image_sets / "validation.parquet"]),
                 "datasets": ([image_sets / "train-saved"], [image_sets / "validation-saved"])}
    else:
        sides = {"jsonl": ([image_sets / "train-captions.jsonl"], [image_sets / "validation-captions.jsonl"]),
                 "parquet": ([image_sets / "train-captions.parquet"], [image_sets / "validation-captions.parquet"]),
                 "datasets": ([image_sets / "train-captions-saved"], [image_sets / "validation-captions-saved"])}
    results = {}
    for name, (train_files, validation_files) in sides.items():
        config = vit_config(tmp_path, train_files, validation_files,
                            "contrastive" if objective == "contrastive" else None)
        results[name] = train(trainer_binary, config, tmp_path / f"run-{name}")
    if objective == "classification":  # the comparison can tell: other labels train other weights
        import pyarrow.parquet as pq
        table = pq.read_table(image_sets / "train.parquet")
        pq.write_table(table.set_column(1, "label", table.column("label").take(list(range(len(table)))[::-1])),
                       tmp_path / "relabelled.parquet")
        config = vit_config(tmp_path, [tmp_path / "relabelled.parquet"], [image_sets / "validation.parquet"])
        results["relabelled"] = train(trainer_binary, config, tmp_path / "run-relabelled")
    relabelled = results.pop("relabelled", None)
    reference_weights, reference_metrics = next(iter(results.values()))
    assert any("eval_loss" in m for m in reference_metrics)
    assert max(m.get("step", 0) for m in reference_metrics) == 4
    if relabelled:
        assert any(not torch.equal(relabelled[0][k], reference_weights[k]) for k in reference_weights)
    for name, (weights, metrics) in results.items():
        assert weights.keys() == reference_weights.keys(), name
        for key in weights:
            assert torch.equal(weights[key], reference_weights[key]), (name, key)
        strip = lambda ms: [{k: v for k, v in m.items() if "time" not in k and "per_s" not in k and "_s" != k[-2:]}
                            for m in ms if "eval_loss" in m]
        assert strip(metrics) == strip(reference_metrics), name


def test_bad_image_bytes_are_exit_3_naming_file_row_and_column(trainer_binary, image_sets, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    table = pq.read_table(image_sets / "train.parquet")
    images = table.column("image").to_pylist()
    images[4] = {"bytes": b"\x89PNG\r\n\x1a\n not really", "path": "broken.png"}
    bad = tmp_path / "bad.parquet"
    pq.write_table(table.set_column(0, "image", pa.array(images, type=table.schema.field("image").type)), bad)
    config = vit_config(tmp_path, [bad], [image_sets / "validation"])
    result = subprocess.run([str(trainer_binary), "--config", str(config), "--set",
                             f"checkpoint.output_dir={tmp_path / 'out'}"], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 3, result.stderr
    assert f'{bad}: row 4 (row group 0), column "image": ' in result.stderr, result.stderr
    # skip: counted and left out, training goes on
    result = subprocess.run([str(trainer_binary), "--config", str(config), "--set",
                             f"checkpoint.output_dir={tmp_path / 'out2'}", "--set", "data.on_bad_record=skip"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr


def test_a_table_without_the_columns_names_them(trainer_binary, image_sets, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    odd = tmp_path / "odd.parquet"
    pq.write_table(pa.table({"picture": [b"x"], "label": [0]}), odd)
    config = vit_config(tmp_path, [odd], [image_sets / "validation"])
    result = subprocess.run([str(trainer_binary), "--config", str(config), "--set",
                             f"checkpoint.output_dir={tmp_path / 'out'}"], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 3 and f'{odd}: has no "image" column (its columns: picture, label)' in result.stderr, \
        result.stderr


def test_a_datasets_folder_is_not_an_image_folder(image_tool, image_sets, tmp_path):
    """Given to the dataset opener as it is (not expanded), a datasets folder is refused, not read as classes."""
    out = tmp_path / "list.json"
    result = subprocess.run([str(image_tool), "list", str(image_sets / "train-saved"), "-", "error", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert "a folder datasets wrote, not an image folder" in result.stdout + result.stderr


def test_trainer_data_reports_the_same_for_every_form(trainer_binary, image_sets, tmp_path):
    """`trainer data` (the image tasks' inspection: classes, records, images, batches) is the same for the folder,
    JSONL, Parquet and datasets-folder forms (times and RSS aside)."""
    def report(train_files, validation_files):
        config = vit_config(tmp_path, train_files, validation_files)
        result = subprocess.run([str(trainer_binary), "data", "--config", str(config)], cwd=ROOT, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        return [line for line in result.stdout.splitlines() if "time" not in line and "RSS" not in line]

    folder = report([image_sets / "train"], [image_sets / "validation"])
    assert "data: image classifier (3 classes)" in folder[0] and any("images              18" in l for l in folder)
    assert report([image_sets / "train.jsonl"], [image_sets / "validation.jsonl"]) == folder
    assert report([image_sets / "train.parquet"], [image_sets / "validation.parquet"]) == folder
    assert report([f"{image_sets / 'train-saved'}"], [image_sets / "validation-saved"]) == folder


def test_a_hub_image_dataset_reads_as_its_local_files(trainer_binary, image_sets, tmp_path):
    """An image dataset by its Hub id (the stand-in Hub on 127.0.0.1): its Parquet files (Image feature, ClassLabel)
    are fetched into the cache and read as the local image folder is."""
    from hub_server import HubServer, client_env
    server = HubServer(page_size=3)
    server.add_repo("img-org/shapes", {
        "README.md": b"# shapes\n",
        "data/train-00000-of-00001.parquet": (image_sets / "train.parquet").read_bytes(),
        "data/validation-00000-of-00001.parquet": (image_sets / "validation.parquet").read_bytes(),
    }, repo_type="dataset")
    server.start()
    try:
        env = client_env(server.endpoint, tmp_path)

        def report(train_files, validation_files):
            config = vit_config(tmp_path, [], [])
            data = json.loads(config.read_text())
            data["data"]["train_files"], data["data"]["validation_files"] = train_files, validation_files
            config.write_text(json.dumps(data))
            result = subprocess.run([str(trainer_binary), "data", "--config", str(config)], cwd=ROOT, env=env,
                                    capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, result.stderr
            return [line for line in result.stdout.splitlines() if "time" not in line and "RSS" not in line]

        folder = report([str(image_sets / "train")], [str(image_sets / "validation")])
        assert report(["img-org/shapes"], ["img-org/shapes"]) == folder
        assert list((tmp_path / "cache").glob("datasets--img-org--shapes/snapshots/*/data/train-*.parquet"))
    finally:
        server.stop()
