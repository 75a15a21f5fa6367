"""Parquet and Arrow IPC data files (issue 54): the same records written as JSONL, by pyarrow as Parquet (several row
groups) and as an Arrow IPC file, and by `datasets` (save_to_disk's data-*.arrow, the IPC stream format) give the
same `trainer data --dump` examples for every record kind, train to the same weights, resume exactly from the middle
of a row group, and bad files are named with their row group, row and column (exit 3)."""
import json
import pathlib
import re

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

DISHES = ["soup", "stew", "salad", "pie", "bread", "curry", "tart", "chili", "rice", "jam", "cake"]


def records(kind):
    """Eleven records of one kind, as a user's dataset holds them (conversations as lists of structs)."""
    out = []
    for i, dish in enumerate(DISHES):
        steps = f" Simmer the {dish} for {10 + i} minutes.\nServe \"hot\" \\ crème brûlée 🍮" + " Stir." * (i % 3)
        if kind == "text":
            out.append({"prompt": f"Recipe for {dish}:", "completion": steps})
        elif kind == "seq2seq":
            out.append({"input": f"How to cook {dish}?", "target": steps})
        elif kind == "chat":
            turns = [{"role": "user", "content": f"How do I cook {dish}?"}, {"role": "assistant", "content": steps}]
            if i % 2:
                turns += [{"role": "user", "content": "And then?"}, {"role": "assistant", "content": "Eat it."}]
            out.append({"messages": turns})
        elif kind == "dpo":
            out.append({"prompt": f"Recipe for {dish}:", "chosen": steps, "rejected": " Burn it."})
        elif kind == "dpo-chat":
            user = {"role": "user", "content": f"How do I cook {dish}?"}
            out.append({"chosen": [user, {"role": "assistant", "content": steps}],
                        "rejected": [user, {"role": "assistant", "content": "No idea."}]})
        elif kind == "ids":
            ids = [(7 * i + k) % 500 + 1 for k in range(5 + i)]
            out.append({"input_ids": ids, "labels": [-100] * 2 + ids[2:]})
    return out


def write_all(directory, rows):
    """The rows as JSONL, Parquet (row groups of 3), an Arrow IPC file (batches of 4) and a save_to_disk folder."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {"jsonl": directory / "data.jsonl", "parquet": directory / "data.parquet",
             "arrow-file": directory / "data.arrow"}
    files["jsonl"].write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, files["parquet"], row_group_size=3)
    with pa.ipc.new_file(str(files["arrow-file"]), table.schema) as writer:
        writer.write_table(table, max_chunksize=4)
    datasets.Dataset.from_list(rows).save_to_disk(str(directory / "saved"), max_shard_size="1KB")
    shards = sorted((directory / "saved").glob("data-*.arrow"))
    assert len(shards) >= 2 and shards[0].read_bytes()[:6] != b"ARROW1"  # the IPC stream format, several shards
    files["datasets"] = shards
    return files


def model_config(root, tmp_path, kind, train_files, **extra):
    model = "tiny-t5" if kind == "seq2seq" else "tiny-qwen2"
    config = {"model": {"path": str(root / "configs" / "models" / model), "init": "random"},
              "data": {"train_files": [str(f) for f in train_files], "max_length": 128, "num_workers": 2},
              "training": {"seed": 5},
              "device": {"type": "cpu"}}
    if kind.startswith("dpo"):
        config["training"]["objective"] = "dpo"
    for key, value in extra.items():
        section, name = key.split("__")
        config.setdefault(section, {})[name] = value
    path = tmp_path / f"config-{kind}-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps(config))
    return path


def dump(run_trainer, config, path):
    out = run_trainer("data", "--config", config, "--dump", 100, path).stdout
    return [json.loads(line) for line in out.split("\n") if line.startswith("{")]


@pytest.mark.parametrize("kind", ["text", "seq2seq", "chat", "dpo", "dpo-chat", "ids"])
def test_every_format_dumps_the_jsonl_examples(kind, root, tmp_path, run_trainer):
    rows = records(kind)
    files = write_all(tmp_path / "data", rows)
    config = model_config(root, tmp_path, kind, [files["jsonl"]])
    expected = dump(run_trainer, config, files["jsonl"])
    assert len(expected) == len(rows) and all("input_ids" in e for e in expected)
    if kind.startswith("dpo"):
        assert all("rejected_ids" in e for e in expected)
    assert [e.pop("line") for e in expected] == list(range(1, len(rows) + 1))
    for name in ["parquet", "arrow-file"]:
        got = dump(run_trainer, config, files[name])
        assert [g.pop("row") for g in got] == list(range(len(rows))), name
        assert got == expected, name
    got = [g for shard in files["datasets"] for g in dump(run_trainer, config, shard)]
    for g in got:
        g.pop("row")
    assert got == expected


def test_the_loader_reads_every_format_alike_and_counts_the_same(root, tmp_path, run_trainer):
    """`trainer data` (the threaded loader, shuffled, with a held-out split) over each format: the same counts."""
    files = write_all(tmp_path / "data", records("chat"))
    summaries = set()
    for name in ["jsonl", "parquet", "arrow-file", "datasets"]:
        paths = files[name] if name == "datasets" else [files[name]]
        config = model_config(root, tmp_path, "chat", paths, data__validation_fraction=0.25)
        out = run_trainer("data", "--config", config).stdout
        summaries.add("\n".join(line for line in out.splitlines()
                                if line.strip().split(" ")[0] in ("records", "examples", "tokens", "batches")))
    assert len(summaries) == 1, summaries


def train_args(config, out, steps, *extra):
    args = ["--config", config, "--set", f"checkpoint.output_dir={out}", "--set", f"training.max_steps={steps}",
            "--set", "training.batch_size=3", "--set", "training.micro_batch_size=3", "--set", "logging.progress=off",
            "--set", "checkpoint.save_final=false", "--set", "evaluation.every_steps=0"]
    for s in extra:
        args += ["--set", s]
    return args


def test_parquet_trains_to_the_jsonl_weights_in_file_order(root, tmp_path, run_trainer):
    files = write_all(tmp_path / "data", records("text"))
    weights = {}
    for name in ["jsonl", "parquet"]:
        config = model_config(root, tmp_path, "text", [files[name]], data__shuffle=False)
        run_trainer(*train_args(config, tmp_path / name, 4, "checkpoint.every_steps=4"))
        weights[name] = (tmp_path / name / "checkpoint-4" / "model.safetensors").read_bytes()
    assert weights["jsonl"] == weights["parquet"]


def test_a_list_of_jsonl_and_parquet_files_trains_as_the_jsonl_of_all(root, tmp_path, run_trainer):
    """JSONL files among Parquet files are read in blocks of lines, as row groups are: in file order, the weights of
    the same records as one JSONL file; shuffled, the same counts; a bad JSONL line is still named file:line."""
    rows = records("text")
    files = write_all(tmp_path / "all", rows)
    head, tail = tmp_path / "head.jsonl", tmp_path / "tail.parquet"
    head.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows[:5]), encoding="utf-8")
    pq.write_table(pa.Table.from_pylist(rows[5:]), tail, row_group_size=3)
    weights = {}
    for name, paths in {"jsonl": [files["jsonl"]], "mixed": [head, tail]}.items():
        config = model_config(root, tmp_path, "text", paths, data__shuffle=False)
        run_trainer(*train_args(config, tmp_path / name, 4, "checkpoint.every_steps=4"))
        weights[name] = (tmp_path / name / "checkpoint-4" / "model.safetensors").read_bytes()
    assert weights["jsonl"] == weights["mixed"]
    summaries = set()
    for paths in ([files["jsonl"]], [head, tail]):
        config = model_config(root, tmp_path, "text", paths, data__validation_fraction=0.25)
        out = run_trainer("data", "--config", config).stdout
        summaries.add("\n".join(line for line in out.splitlines()
                                if line.strip().split(" ")[0] in ("records", "examples", "tokens", "batches")))
    assert len(summaries) == 1, summaries
    head.write_text(head.read_text(encoding="utf-8") + '{"prompt": 3}\n', encoding="utf-8")
    config = model_config(root, tmp_path, "text", [tail, head], data__shuffle=False)
    result = run_trainer(*train_args(config, tmp_path / "bad", 4), check=False)
    assert result.returncode == 3 and f"{head}:6" in result.stderr, result.stderr


@pytest.mark.parametrize("fmt", ["parquet", "datasets"])
def test_a_resume_in_the_middle_of_a_row_group_is_exact(fmt, root, tmp_path, run_trainer):
    """Shuffled, 2 examples a step: the checkpoint after step 2 is at slot 4, inside a row group (groups of 3 rows
    in a seeded order, each group's rows in a seeded order; datasets' shards are record batches of their own).
    Steps 2 + a resume reach the weights and optimizer state of 7 steps straight (into the second epoch)."""
    files = write_all(tmp_path / "data", records("chat"))
    paths = files[fmt] if fmt == "datasets" else [files[fmt]]
    config = model_config(root, tmp_path, "chat", paths)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ["checkpoint.every_steps=2", "checkpoint.keep_last=5", "training.batch_size=2",
              "training.micro_batch_size=2", "training.max_steps=7"]
    run_trainer(*train_args(config, straight, 7, *common))
    run_trainer(*train_args(config, resumed, 7, *common), "--resume-from", straight / "checkpoint-2")
    for name in ["model.safetensors", "optimizer.safetensors"]:
        assert (straight / "checkpoint-7" / name).read_bytes() == (resumed / "checkpoint-7" / name).read_bytes(), name


def run_bad(run_trainer, config, *args):
    result = run_trainer("data", "--config", config, *args, check=False)
    return result.returncode, result.stderr


def test_bad_tables_are_named_with_row_group_row_and_column(root, tmp_path, run_trainer):
    rows = records("chat")
    bad = tmp_path / "bad"
    bad.mkdir()
    # No conversation in row 7 (row group 2 of groups of 3).
    table = pa.Table.from_pylist(rows[:7] + [{"messages": None}] + rows[8:])
    pq.write_table(table, bad / "null.parquet", row_group_size=3)
    config = model_config(root, tmp_path, "chat", [bad / "null.parquet"])
    code, err = run_bad(run_trainer, config)
    assert code == 3 and "null.parquet: row 7 (row group 2)" in err and "messages" in err, err
    # on_bad_record=skip counts the row and goes on
    config = model_config(root, tmp_path, "chat", [bad / "null.parquet"], data__on_bad_record="skip")
    out = run_trainer("data", "--config", config).stdout
    assert "bad records skipped 1" in out and "examples            10" in out, out
    # A column of the wrong type in every row: a number where a conversation should be.
    pq.write_table(pa.Table.from_pylist([{"messages": i} for i in range(5)]), bad / "numbers.parquet")
    code, err = run_bad(run_trainer, model_config(root, tmp_path, "chat", [bad / "numbers.parquet"]))
    assert code == 3 and re.search(r"numbers.parquet: row \d \(row group 0\): field \"messages\"", err), err
    # A missing column: the text kind's completion is not there.
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "b"}] * 4), bad / "missing.parquet")
    code, err = run_bad(run_trainer, model_config(root, tmp_path, "text", [bad / "missing.parquet"]))
    assert code == 3 and re.search(r"missing.parquet: row \d \(row group 0\): .*completion", err), err
    # Truncated files: a Parquet file without its footer, an Arrow file and stream cut in the middle.
    good = write_all(tmp_path / "good", rows)
    for name, source in [("cut.parquet", good["parquet"]), ("cut.arrow", good["arrow-file"]),
                         ("cut-stream.arrow", good["datasets"][0])]:
        data = source.read_bytes()
        (bad / name).write_bytes(data[: len(data) * 2 // 3])
        code, err = run_bad(run_trainer, model_config(root, tmp_path, "chat", [bad / name]))
        assert code == 3 and f"{bad / name}:" in err, (name, err)
        assert "truncated or corrupt" in err, (name, err)
    # Not a Parquet file at all.
    (bad / "text.parquet").write_text("{\"messages\": []}\n")
    code, err = run_bad(run_trainer, model_config(root, tmp_path, "chat", [bad / "text.parquet"]))
    assert code == 3 and "text.parquet: not a Parquet file" in err, err


def test_datasets_folders_read_like_their_files(root, tmp_path, run_trainer):
    """A save_to_disk folder (DIR), a DatasetDict folder (DIR:train) and load_dataset's cache folder (DIR:train)
    give the JSONL examples, as --dump FILE and as data.train_files; a missing split is exit 3 naming the splits."""
    rows = records("chat")
    files = write_all(tmp_path / "data", rows)
    config = model_config(root, tmp_path, "chat", [files["jsonl"]])
    expected = dump(run_trainer, config, files["jsonl"])
    for e in expected:
        e.pop("line")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:2])}).save_to_disk(str(tmp_path / "dict"))
    loaded = datasets.load_dataset("json", data_files={"train": str(files["jsonl"])}, cache_dir=str(tmp_path / "hf"))
    cache_dir = {pathlib.Path(f["filename"]).parent for f in loaded["train"].cache_files}.pop()
    for source in [tmp_path / "data" / "saved", f"{tmp_path / 'dict'}:train", f"{cache_dir}:train"]:
        got = dump(run_trainer, config, source)
        for g in got:
            g.pop("row")
            g.pop("file", None)
        assert got == expected, source
        counts = run_trainer("data", "--config", model_config(root, tmp_path, "chat", [source])).stdout
        assert "examples            11" in counts, counts
    for source, splits in [(tmp_path / "dict", "train, test"), (f"{tmp_path / 'dict'}:validation", "train, test"),
                           (f"{cache_dir}:test", "train")]:
        result = run_trainer("data", "--config", model_config(root, tmp_path, "chat", [source]), check=False)
        assert result.returncode == 3 and splits in result.stderr and "data.train_files" in result.stderr, \
            result.stderr


def test_columns_of_bytes_are_left_out_with_a_warning(root, tmp_path, run_trainer):
    """A text dataset with an Image column (datasets' {bytes, path} struct): the text trains, the image column is
    told once and left out (image records from tables are not read yet)."""
    rows = records("text")
    (tmp_path / "data").mkdir()
    jsonl = tmp_path / "data" / "text.jsonl"
    jsonl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    with_images = [dict(r, image={"bytes": bytes([i, 0, 255]), "path": f"{i}.png"}) for i, r in enumerate(rows)]
    pq.write_table(pa.Table.from_pylist(with_images), tmp_path / "data" / "images.parquet", row_group_size=4)
    config = model_config(root, tmp_path, "text", [jsonl])
    expected = dump(run_trainer, config, jsonl)
    result = run_trainer("data", "--config", config, "--dump", 100, tmp_path / "data" / "images.parquet")
    got = [json.loads(line) for line in result.stdout.split("\n") if line.startswith("{")]
    assert [{k: v for k, v in e.items() if k != "line"} for e in expected] == \
        [{k: v for k, v in g.items() if k != "row"} for g in got]
    assert result.stderr.count('column(s) "image" (struct<bytes: binary, path: string>) hold bytes') == 1, result.stderr
