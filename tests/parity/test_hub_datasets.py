"""Datasets by their Hub id (issue 54), against the stand-in Hub on 127.0.0.1 (hub_server.py): a dataset repo's
Parquet files of one split land in huggingface_hub's cache layout (datasets--ORG--NAME, blobs by sha256, snapshot
links), `trainer download --dataset` fetches ahead (--dry-run lists), a repo without Parquet files is read from the
Hub's refs/convert/parquet branch, offline runs read the cache (and huggingface_hub and datasets read what trainer
put there), and the examples equal those of the same records as a local JSONL file."""
import json
import os
import pathlib
import subprocess

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from hub_server import HubServer, client_env  # noqa: E402
from test_parquet import records  # noqa: E402

REPO = "data-org/recipes"
CONVERTED = "data-org/jsonl-only"


def parquet_bytes(rows, path, row_group_size=4):
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path.read_bytes()


@pytest.fixture
def rows():
    return records("chat")


@pytest.fixture
def hub(rows, tmp_path):
    server = HubServer(page_size=3)
    staging = tmp_path / "staging"
    staging.mkdir()
    server.add_repo(REPO, {
        "README.md": b"# recipes\n",
        "data/train-00000-of-00002.parquet": parquet_bytes(rows[:6], staging / "a.parquet"),
        "data/train-00001-of-00002.parquet": parquet_bytes(rows[6:], staging / "b.parquet"),
        "data/validation-00000-of-00001.parquet": parquet_bytes(rows[:2], staging / "c.parquet"),
    }, repo_type="dataset")
    server.add_repo(CONVERTED, {"train.jsonl": b"".join(json.dumps(r).encode() + b"\n" for r in rows)},
                    repo_type="dataset")
    server.add_commit(CONVERTED, {"default/train/0000.parquet": parquet_bytes(rows, staging / "d.parquet")},
                      branch="refs/convert/parquet", repo_type="dataset")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def env(hub, tmp_path):
    return client_env(hub.endpoint, tmp_path)


def trainer(binary, env, *args):
    return subprocess.run([str(binary), *map(str, args)], env=env, capture_output=True, text=True, timeout=120,
                          cwd=pathlib.Path(__file__).resolve().parents[2])


def config(root, tmp_path, train_files):
    path = tmp_path / f"config-{len(list(tmp_path.glob('config-*')))}.json"
    path.write_text(json.dumps({"model": {"path": str(root / "configs" / "models" / "tiny-qwen2"), "init": "random"},
                                "data": {"train_files": train_files, "max_length": 128},
                                "training": {"seed": 5}, "device": {"type": "cpu"}}))
    return path


def dumped(result):
    assert result.returncode == 0, result.stderr
    out = [json.loads(line) for line in result.stdout.split("\n") if line.startswith("{")]
    for entry in out:
        entry.pop("row", None)
        entry.pop("line", None)
        entry.pop("file", None)
    return out


def local_examples(trainer_binary, env, root, tmp_path, rows):
    jsonl = tmp_path / "local.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dumped(trainer(trainer_binary, env, "data", "--config", config(root, tmp_path, [str(jsonl)]),
                          "--dump", 100))


def dataset_dir(env, repo):
    return pathlib.Path(env["HF_HUB_CACHE"]) / ("datasets--" + repo.replace("/", "--"))


def test_download_fetches_one_split_into_the_shared_cache_and_runs_read_it_offline(
        trainer_binary, hub, env, root, tmp_path, rows):
    dry = trainer(trainer_binary, env, "download", "--dataset", f"{REPO}:train", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "2 file(s)" in dry.stdout and "data/train-00000-of-00002.parquet" in dry.stdout, dry.stdout
    assert not dataset_dir(env, REPO).joinpath("blobs").exists()
    result = trainer(trainer_binary, env, "download", "--dataset", f"{REPO}:train")
    assert result.returncode == 0, result.stderr
    repo = dataset_dir(env, REPO)
    commit = (repo / "refs" / "main").read_text()
    snapshot = repo / "snapshots" / commit
    assert sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*.parquet")) == [
        "data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"]
    for link in snapshot.rglob("*.parquet"):
        assert link.is_symlink() and os.readlink(link).startswith("../../../blobs/")
    assert str(snapshot / "data" / "train-00001-of-00002.parquet") in result.stdout
    # huggingface_hub finds the same files in the cache, offline
    offline = dict(env, HF_HUB_OFFLINE="1")
    code = ("import huggingface_hub, sys; print(huggingface_hub.hf_hub_download("
            f"{REPO!r}, 'data/train-00000-of-00002.parquet', repo_type='dataset'))")
    found = subprocess.run([os.sys.executable, "-c", code], env=offline, capture_output=True, text=True, timeout=120)
    assert found.returncode == 0 and found.stdout.strip() == str(snapshot / "data" / "train-00000-of-00002.parquet"), \
        found.stderr
    # huggingface_hub's snapshot of the cache (offline), read by datasets with its own data-file patterns: its train
    # split is the files trainer chose. (load_dataset(REPO) offline needs datasets' own cache of an earlier online
    # load, not the Hub cache.)
    code = ("import datasets, huggingface_hub; "
            f"p = huggingface_hub.snapshot_download({REPO!r}, repo_type='dataset', local_files_only=True); "
            "d = datasets.load_dataset(p, split='train'); print(len(d)); print(d[0]['messages'][0]['content'])")
    loaded = subprocess.run([os.sys.executable, "-c", code], env=offline, capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split("\n")[:2] == [str(len(rows)), rows[0]["messages"][0]["content"]], loaded.stdout
    # a run offline reads the cache: the examples of the same records as JSONL
    expected = local_examples(trainer_binary, env, root, tmp_path, rows)
    got = dumped(trainer(trainer_binary, offline, "data", "--config", config(root, tmp_path, [REPO]), "--dump", 100))
    assert got == expected
    hub.reset_counts()
    counts = trainer(trainer_binary, offline, "data", "--config", config(root, tmp_path, [f"{REPO}:train"]))
    assert counts.returncode == 0 and f"examples            {len(rows)}" in counts.stdout, counts.stderr
    assert hub.count() == 0


def test_a_repo_without_parquet_files_is_read_from_the_hubs_conversion(trainer_binary, hub, env, root, tmp_path, rows):
    result = trainer(trainer_binary, env, "data", "--config", config(root, tmp_path, [CONVERTED]), "--dump", 100)
    expected = local_examples(trainer_binary, env, root, tmp_path, rows)
    assert dumped(result) == expected
    repo = dataset_dir(env, CONVERTED)
    commit = (repo / "refs" / "refs" / "convert" / "parquet").read_text()
    assert (repo / "snapshots" / commit / "default" / "train" / "0000.parquet").is_symlink()
    assert not (repo / "snapshots" / commit / "train.jsonl").exists()
    # and offline, from the cache alone
    again = trainer(trainer_binary, dict(env, HF_HUB_OFFLINE="1"), "data", "--config",
                    config(root, tmp_path, [f"{CONVERTED}:default:train"]), "--dump", 100)
    assert dumped(again) == expected


def test_unknown_split_and_repo_are_exit_3(trainer_binary, hub, env, root, tmp_path):
    result = trainer(trainer_binary, env, "data", "--config", config(root, tmp_path, [f"{REPO}:test"]))
    assert result.returncode == 3, result.stderr
    assert "split \"test\"" in result.stderr and "data/validation-00000-of-00001.parquet" in result.stderr, result.stderr
    missing = trainer(trainer_binary, env, "data", "--config", config(root, tmp_path, ["data-org/nothing"]))
    assert missing.returncode == 3 and "RepoNotFound" in missing.stderr, missing.stderr
    # a relative path that looks like an id but names a data file stays a path
    path = trainer(trainer_binary, env, "data", "--config", config(root, tmp_path, ["data-org/missing.parquet"]))
    assert path.returncode == 3 and "no file matches" in path.stderr, path.stderr


def test_validation_files_default_to_the_validation_split(trainer_binary, hub, env, root, tmp_path):
    path = config(root, tmp_path, [REPO])
    settings = json.loads(path.read_text())
    settings["data"]["validation_files"] = [REPO]
    path.write_text(json.dumps(settings))
    result = trainer(trainer_binary, env, "data", "--config", path)
    assert result.returncode == 0, result.stderr
    train, validation = result.stdout.split("\nvalidation:")
    assert "examples            11" in train and "examples            2" in validation, result.stdout
    snapshot = next((dataset_dir(env, REPO) / "snapshots").iterdir())
    assert (snapshot / "data" / "validation-00000-of-00001.parquet").is_symlink()
