"""Models by their Hub id (issue 43), against a stand-in Hub on 127.0.0.1 (hub_server.py) with huggingface_hub and
transformers on the other side, both pointed at it through HF_ENDPOINT:

(a) huggingface_hub's snapshot_download fills a cache; trainer inspects and trains from it with HF_HUB_OFFLINE=1
    and makes no request;
(b) trainer downloads into an empty cache laid out as huggingface_hub's own (same blobs, links, refs); transformers
    loads it with from_pretrained(name, local_files_only=True) and the weights are the served ones;
(c) each fault ends as described: a cut connection and a stalled body are resumed with a Range request; a 500 is
    retried; wrong bytes are refused with nothing corrupt left in the cache; a gated repo without a token, a missing
    repo, revision or file, pickled weights only, offline with nothing cached are clear errors; the Hub unreachable
    with the model cached goes on with a warning; the token never appears in any output or file; two processes
    started together download each file once.
Every trainer process runs under a timeout; the server is stopped by the fixture.
"""
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import time

import pytest
import torch
import transformers
from safetensors.torch import load_file

from hub_server import HubServer, client_env

TOKEN = "hf_FAKEtok3n_never_to_be_seen_0123456789"
REPO = "tiny-org/tiny-t5"


def _model_files(root, tmp_path, shard=False):
    """A tiny T5 (configs/models/tiny-t5 with transformers' random weights) as a Hub repo: file name -> bytes."""
    out = tmp_path / ("sharded-model" if shard else "model")
    config = transformers.AutoConfig.from_pretrained(root / "configs" / "models" / "tiny-t5")
    torch.manual_seed(43)
    model = transformers.AutoModelForSeq2SeqLM.from_config(config)
    model.save_pretrained(out, **({"max_shard_size": "200KB"} if shard else {}))
    for name in ("spiece.model",):
        shutil.copy(root / "configs" / "models" / "tiny-t5" / name, out / name)
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    files["README.md"] = b"# tiny\n"
    files["pytorch_model.bin"] = b"pickled weights trainer must never fetch"
    return files


@pytest.fixture(scope="module")
def model_files(root, tmp_path_factory):
    return _model_files(root, tmp_path_factory.mktemp("hubmodel"))


@pytest.fixture
def hub(model_files, root, tmp_path):
    server = HubServer(page_size=3)
    server.add_repo(REPO, model_files)
    server.add_repo("tiny-org/sharded", _model_files(root, tmp_path, shard=True))
    server.add_repo("tiny-org/gated", model_files, gated_token=TOKEN)
    server.add_repo("tiny-org/pickled", {"config.json": model_files["config.json"],
                                         "pytorch_model.bin": b"pickle bytes"})
    server.start()
    yield server
    server.stop()


@pytest.fixture
def env(hub, tmp_path):
    """The environment of a trainer (or Python) process: the stand-in Hub, an empty cache, no token anywhere."""
    return client_env(hub.endpoint, tmp_path)


def trainer(binary, env, *args, timeout=120, cwd=None):
    return subprocess.run([str(binary), *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=cwd or pathlib.Path(__file__).resolve().parents[2])


def repo_dir(env, repo=REPO):
    return pathlib.Path(env["HF_HUB_CACHE"]) / ("models--" + repo.replace("/", "--"))


def tree(path):
    """Every file and link under `path`, relative, with a link's target: the cache's layout."""
    out = {}
    for p in sorted(pathlib.Path(path).rglob("*")):
        rel = str(p.relative_to(path))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def assert_no_token(*texts, dirs=()):
    for text in texts:
        assert TOKEN not in text
    for d in dirs:
        for p in pathlib.Path(d).rglob("*"):
            if p.is_file() and not p.is_symlink():
                assert TOKEN.encode() not in p.read_bytes(), p


def snapshot_download(env, repo, **kwargs):
    """huggingface_hub itself, in a fresh process (its constants are read from the environment at import)."""
    code = ("import sys, json, huggingface_hub; "
            f"print(huggingface_hub.snapshot_download({repo!r}, **json.loads(sys.argv[1])))")
    result = subprocess.run([os.sys.executable, "-c", code, json.dumps(kwargs)], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return pathlib.Path(result.stdout.strip().splitlines()[-1])


# ---- (a) huggingface_hub fills the cache, trainer reads it offline -------------------------------------------------

def test_trainer_uses_the_cache_huggingface_hub_filled_offline(trainer_binary, hub, env, tmp_path):
    snapshot = snapshot_download(env, REPO, allow_patterns=["*.json", "*.safetensors", "*.model"])
    hub.reset_counts()
    offline = {**env, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": hub.endpoint}
    result = trainer(trainer_binary, offline, "inspect", REPO)
    assert result.returncode == 0, result.stderr
    assert "t5" in result.stdout
    out = tmp_path / "run"
    result = trainer(trainer_binary, offline, "--config", "configs/tiny-t5.json", "--set", f"model.path={REPO}",
                     "--set", "model.init=pretrained", "--set", "training.max_steps=2", "--set",
                     "evaluation.every_steps=0", "--set", f"checkpoint.output_dir={out}", "--set",
                     "checkpoint.every_steps=2", timeout=300)
    assert result.returncode == 0, result.stderr
    assert hub.count() == 0, hub.requests
    state = json.loads((out / "checkpoint-2" / "train_state.json").read_text())
    assert state["model_source"] == {"hub_id": REPO, "commit": snapshot.name}
    assert state["config"]["model"]["path"] == str(snapshot)
    assert snapshot.name in result.stderr + result.stdout  # the resolved commit is logged


def test_offline_with_nothing_cached_is_a_clear_error_and_asks_nothing(trainer_binary, hub, env):
    result = trainer(trainer_binary, {**env, "TRANSFORMERS_OFFLINE": "1"}, "inspect", REPO)
    assert result.returncode == 2, result.stderr
    assert REPO in result.stderr and "not in the Hugging Face cache" in result.stderr
    assert "local model directory" in result.stderr
    assert hub.count() == 0


def test_a_missing_path_stays_a_missing_path(trainer_binary, hub, env):
    result = trainer(trainer_binary, env, "--config", "configs/tiny-t5.json", "--set", "model.path=./no/such-model",
                     "--dry-run")
    assert result.returncode == 3
    assert "./no/such-model does not exist" in result.stderr
    assert hub.count() == 0


# ---- (b) trainer fills the cache, transformers reads it offline ---------------------------------------------------

def test_trainer_downloads_what_transformers_then_loads_offline(trainer_binary, hub, env, model_files, tmp_path):
    result = trainer(trainer_binary, env, "download", REPO)
    assert result.returncode == 0, result.stderr
    snapshot = pathlib.Path(result.stdout.strip().splitlines()[-1])
    commit = hub.repos[REPO].refs["main"]
    assert snapshot == repo_dir(env) / "snapshots" / commit
    assert (repo_dir(env) / "refs" / "main").read_text() == commit
    # Only what trainer reads: never the pickled weights or the README.
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(
        n for n in model_files if n not in ("pytorch_model.bin", "README.md"))
    assert hub.count(contains="pytorch_model.bin") == 0
    # Blobs named by etag: the LFS file by its sha256, a regular file by its git blob sha1; relative links.
    weights = model_files["model.safetensors"]
    assert os.readlink(snapshot / "model.safetensors") == "../../blobs/" + hashlib.sha256(weights).hexdigest()
    config = model_files["config.json"]
    assert os.readlink(snapshot / "config.json") == "../../blobs/" + hashlib.sha1(
        b"blob %d\0" % len(config) + config).hexdigest()
    assert (repo_dir(env) / ".no_exist" / commit / "tokenizer.json").exists()
    assert not list(repo_dir(env).rglob("*.incomplete"))
    # The token is sent to no CDN (there is none here, and none is ever sent to another host).
    assert hub.cdn_requests_with_auth() == []

    # transformers, offline, on the cache trainer wrote: the served weights.
    code = ("import sys, torch, transformers; "
            f"m = transformers.AutoModelForSeq2SeqLM.from_pretrained({REPO!r}, local_files_only=True); "
            "torch.save({k: v.clone() for k, v in m.state_dict().items()}, sys.argv[1])")
    saved = tmp_path / "state.pt"
    py = subprocess.run([os.sys.executable, "-c", code, str(saved)], env={**env, "HF_HUB_OFFLINE": "1"},
                        capture_output=True, text=True, timeout=180)
    assert py.returncode == 0, py.stderr
    loaded = torch.load(saved)
    (tmp_path / "w.safetensors").write_bytes(weights)
    for name, tensor in load_file(tmp_path / "w.safetensors").items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)

    # The same layout huggingface_hub itself makes for these files.
    their_env = {**env, "HF_HUB_CACHE": str(tmp_path / "their-cache")}
    snapshot_download(their_env, REPO, allow_patterns=sorted(p.name for p in snapshot.iterdir()))
    ours, theirs = tree(repo_dir(env)), tree(repo_dir(their_env))
    for key in [k for k in theirs if not k.startswith((".no_exist", "refs", "blobs", "snapshots"))]:
        theirs.pop(key)  # huggingface_hub's own bookkeeping (a tree cache), not part of the shared layout
    ours = {k: v for k, v in ours.items() if not k.startswith(".no_exist")}
    theirs = {k: v for k, v in theirs.items() if not k.startswith(".no_exist")}
    assert ours == theirs


def test_sharded_weights_come_from_the_index(trainer_binary, hub, env):
    result = trainer(trainer_binary, env, "download", "tiny-org/sharded")
    assert result.returncode == 0, result.stderr
    snapshot = pathlib.Path(result.stdout.strip().splitlines()[-1])
    index = json.loads((snapshot / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert shards <= {p.name for p in snapshot.iterdir()}
    result = trainer(trainer_binary, {**env, "HF_HUB_OFFLINE": "1"}, "inspect", "tiny-org/sharded")
    assert result.returncode == 0, result.stderr


def test_dry_run_lists_the_files_and_downloads_nothing(trainer_binary, hub, env, model_files):
    result = trainer(trainer_binary, env, "--config", "configs/tiny-t5.json", "--set", f"model.path={REPO}",
                     "--set", "model.init=pretrained", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "model.safetensors" in result.stdout and "would be downloaded" in result.stdout
    assert "Nothing was downloaded" in result.stdout
    assert hub.count(contains="/cdn/") == 0
    assert not (repo_dir(env) / "blobs").exists() or not any((repo_dir(env) / "blobs").iterdir())


def test_revision_and_a_moved_branch(trainer_binary, hub, env, model_files):
    first = hub.repos[REPO].refs["main"]
    assert trainer(trainer_binary, env, "download", REPO).returncode == 0
    changed = dict(model_files, **{"generation_config.json": b'{"decoder_start_token_id": 0, "eos_token_id": 1}'})
    second = hub.add_commit(REPO, changed)
    result = trainer(trainer_binary, env, "download", f"{REPO}@{first}")
    assert result.returncode == 0, result.stderr
    assert pathlib.Path(result.stdout.strip().splitlines()[-1]).name == first
    result = trainer(trainer_binary, env, "download", REPO)
    assert pathlib.Path(result.stdout.strip().splitlines()[-1]).name == second
    assert (repo_dir(env) / "refs" / "main").read_text() == second
    # The unchanged weights were not fetched again: one blob serves both snapshots.
    assert hub.count("GET", contains="/cdn/") == 2  # model.safetensors and spiece.model, once each


# ---- (c) faults ---------------------------------------------------------------------------------------------------

def test_a_cut_connection_is_resumed_with_a_range_request(trainer_binary, hub, env, model_files):
    hub.faults.cut["model.safetensors"] = 2
    result = trainer(trainer_binary, env, "download", REPO)
    assert result.returncode == 0, result.stderr
    assert "resuming" in result.stderr
    assert hub.count("GET", contains="/cdn/") == 4  # model.safetensors cut twice, then whole; spiece.model once
    # Each retry asks for the rest only: bytes from where the part already written ends.
    half = len(model_files["model.safetensors"]) // 2
    assert [r for p, r in hub.ranges if p.startswith("/cdn/")] == [f"bytes={half}-", f"bytes={half + (len(model_files['model.safetensors']) - half) // 2}-"]
    snapshot = pathlib.Path(result.stdout.strip().splitlines()[-1])
    assert (snapshot / "model.safetensors").read_bytes() == model_files["model.safetensors"]


def test_a_stalled_body_times_out_and_resumes(trainer_binary, hub, env, model_files):
    hub.faults.stall["model.safetensors"] = 1
    result = trainer(trainer_binary, {**env, "HF_HUB_DOWNLOAD_TIMEOUT": "2"}, "download", REPO)
    assert result.returncode == 0, result.stderr
    snapshot = pathlib.Path(result.stdout.strip().splitlines()[-1])
    assert (snapshot / "model.safetensors").read_bytes() == model_files["model.safetensors"]


def test_a_slow_body_completes(trainer_binary, hub, env, model_files):
    hub.faults.slow["spiece.model"] = 0.002
    result = trainer(trainer_binary, env, "download", REPO)
    assert result.returncode == 0, result.stderr
    snapshot = pathlib.Path(result.stdout.strip().splitlines()[-1])
    assert (snapshot / "spiece.model").read_bytes() == model_files["spiece.model"]


def test_a_500_is_retried(trainer_binary, hub, env):
    hub.faults.error500["config.json"] = 1
    hub.faults.error500["model.safetensors"] = 1
    hub.faults.listing500 = 1
    result = trainer(trainer_binary, env, "download", REPO)
    assert result.returncode == 0, result.stderr


def test_a_connection_cut_every_time_ends_in_a_clear_error(trainer_binary, hub, env):
    hub.faults.cut["model.safetensors"] = 100
    result = trainer(trainer_binary, {**env, "TRAINER_HUB_RETRIES": "2"}, "download", REPO)
    assert result.returncode == 3, result.stderr
    assert "model.safetensors" in result.stderr and "failed after 3 attempts" in result.stderr
    commit = hub.repos[REPO].refs["main"]
    assert not (repo_dir(env) / "snapshots" / commit / "model.safetensors").exists()


def test_wrong_bytes_are_refused_and_nothing_corrupt_is_left(trainer_binary, hub, env, model_files):
    hub.faults.corrupt.add("model.safetensors")
    result = trainer(trainer_binary, env, "download", REPO)
    assert result.returncode == 3, result.stderr
    good = hashlib.sha256(model_files["model.safetensors"]).hexdigest()
    bad_bytes = bytes([model_files["model.safetensors"][0] ^ 0xFF]) + model_files["model.safetensors"][1:]
    assert "model.safetensors" in result.stderr and good in result.stderr
    assert hashlib.sha256(bad_bytes).hexdigest() in result.stderr
    repo = repo_dir(env)
    assert not list(repo.rglob("*.incomplete"))
    assert not (repo / "blobs" / good).exists()
    for link in (repo / "snapshots").rglob("*"):
        assert link.resolve().exists()  # no link to a missing or partial blob
        if link.is_file():
            assert hashlib.sha256(link.read_bytes()).hexdigest() != hashlib.sha256(bad_bytes).hexdigest()
    # The fault gone, a new run completes.
    hub.faults.corrupt.clear()
    assert trainer(trainer_binary, env, "download", REPO).returncode == 0


def test_a_gated_repo_needs_the_token_which_is_never_shown(trainer_binary, hub, env, tmp_path):
    result = trainer(trainer_binary, env, "download", "tiny-org/gated")
    assert result.returncode == 3
    assert "GatedRepo" in result.stderr and "tiny-org/gated" in result.stderr
    assert "HF_TOKEN" in result.stderr and "licence" in result.stderr

    with_token = {**env, "HF_TOKEN": TOKEN}
    result = trainer(trainer_binary, with_token, "download", "tiny-org/gated")
    assert result.returncode == 0, result.stderr
    assert hub.cdn_requests_with_auth() == []
    # The token file that `hf auth login` writes works too.
    token_home = tmp_path / "token-home"
    token_home.mkdir()
    (token_home / "token").write_text(TOKEN + "\n")
    shutil.rmtree(env["HF_HUB_CACHE"])
    from_file = {**env, "HF_HOME": str(token_home)}
    result2 = trainer(trainer_binary, from_file, "download", "tiny-org/gated")
    assert result2.returncode == 0, result2.stderr
    out = tmp_path / "run"
    result3 = trainer(trainer_binary, with_token, "--config", "configs/tiny-t5.json", "--set",
                      "model.path=tiny-org/gated", "--set", "model.init=pretrained", "--set", "training.max_steps=1",
                      "--set", "evaluation.every_steps=0", "--set", f"checkpoint.output_dir={out}", timeout=300)
    assert result3.returncode == 0, result3.stderr
    assert_no_token(result.stdout, result.stderr, result2.stdout, result2.stderr, result3.stdout, result3.stderr,
                    dirs=[env["HF_HUB_CACHE"], out])
    # A wrong token: refused, and not shown either.
    shutil.rmtree(env["HF_HUB_CACHE"])
    wrong = trainer(trainer_binary, {**env, "HF_TOKEN": "hf_wrong_" + TOKEN[::-1]}, "download", "tiny-org/gated")
    assert wrong.returncode == 3 and "GatedRepo" in wrong.stderr
    assert TOKEN[::-1] not in wrong.stderr + wrong.stdout


@pytest.mark.parametrize("name, code", [("tiny-org/absent", "RepoNotFound"), (REPO + "@v9", "RevisionNotFound")])
def test_missing_repo_and_revision_are_clear_errors(trainer_binary, hub, env, name, code):
    result = trainer(trainer_binary, env, "download", name)
    assert result.returncode == 3
    assert code in result.stderr and name.split("@")[0] in result.stderr
    assert "hint:" in result.stderr


def test_a_missing_file_is_a_clear_error(trainer_binary, hub, env):
    hub.faults.missing.add("generation_config.json")
    result = trainer(trainer_binary, env, "download", REPO)
    assert result.returncode == 3
    assert "EntryNotFound" in result.stderr and "generation_config.json" in result.stderr and REPO in result.stderr
    commit = hub.repos[REPO].refs["main"]
    assert not (repo_dir(env) / "snapshots" / commit / "generation_config.json").exists()
    result = trainer(trainer_binary, env, "download", REPO, "--include", "no-such-file.json")
    assert result.returncode == 3
    assert "no file matches --include" in result.stderr


def test_pickled_weights_only_is_refused_with_how_to_convert(trainer_binary, hub, env):
    result = trainer(trainer_binary, env, "download", "tiny-org/pickled")
    assert result.returncode == 3
    assert "tiny-org/pickled" in result.stderr and "pytorch_model.bin" in result.stderr
    assert "save_pretrained" in result.stderr and "safe_serialization=True" in result.stderr
    assert hub.count(contains="pytorch_model.bin") == 0


def test_the_hub_unreachable_with_the_model_cached_goes_on_with_a_warning(trainer_binary, hub, env):
    assert trainer(trainer_binary, env, "download", REPO).returncode == 0
    hub.faults.listing500 = 100  # the Hub down: 500s, then no answer at all
    result = trainer(trainer_binary, {**env, "TRAINER_HUB_RETRIES": "1"}, "inspect", REPO)
    assert result.returncode == 0, result.stderr
    assert "HTTP 500" in result.stderr and "cached snapshot" in result.stderr
    hub.stop()
    result = trainer(trainer_binary, env, "inspect", REPO)
    assert result.returncode == 0, result.stderr
    assert "cannot reach" in result.stderr and "cached snapshot" in result.stderr
    shutil.rmtree(env["HF_HUB_CACHE"])
    result = trainer(trainer_binary, env, "inspect", REPO)
    assert result.returncode == 3
    assert "cannot reach" in result.stderr and "local model directory" in result.stderr


def test_two_processes_download_each_file_once(trainer_binary, hub, env, model_files):
    hub.faults.slow["model.safetensors"] = 0.002  # long enough for the two to overlap
    procs = [subprocess.Popen([str(trainer_binary), "download", REPO], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert outputs[0][0] == outputs[1][0]
    for name in ("model.safetensors", "spiece.model"):
        assert hub.count("GET", contains=f"file={name}") == 1, name
    for name in ("config.json", "generation_config.json"):
        assert hub.count("GET", contains=f"/{name}") == 1, name
    assert sorted(p.name for p in pathlib.Path(outputs[0][0].strip()).iterdir()) == sorted(
        n for n in model_files if n not in ("pytorch_model.bin", "README.md"))


# ---- every place a model is named ---------------------------------------------------------------------------------

def test_plan_and_inspect_fetch_no_weights_generate_fetches_them(trainer_binary, hub, env):
    result = trainer(trainer_binary, env, "plan", "--config", "configs/tiny-t5.json", "--set", f"model.path={REPO}",
                     "--set", "model.init=pretrained")
    assert result.returncode == 0, result.stderr
    result = trainer(trainer_binary, env, "inspect", REPO)
    assert result.returncode == 0, result.stderr
    assert hub.count("GET", contains="/cdn/") == 1  # spiece.model (a tokenizer file), never the weights
    assert hub.count(contains="file=model.safetensors") == 0
    # tokenizer.path by id: the tokenizer files alone.
    result = trainer(trainer_binary, env, "data", "--config", "configs/tiny-t5.json", "--set", f"tokenizer.path={REPO}")
    assert result.returncode == 0, result.stderr
    assert hub.count(contains="file=model.safetensors") == 0
    result = trainer(trainer_binary, env, "generate", "--model", REPO, "--ids", "5,6", "--max-new-tokens", "2")
    assert result.returncode == 0, result.stderr
    assert "ids:" in result.stdout
    assert hub.count("GET", contains="file=model.safetensors") == 1


def test_merge_takes_an_adapter_and_its_base_by_id(trainer_binary, hub, env, model_files, tmp_path):
    """A PEFT adapter on the Hub whose base_model_name_or_path is a Hub id: both come from the stand-in Hub."""
    code = f"""
import sys, torch, peft, transformers
base = transformers.AutoModelForSeq2SeqLM.from_pretrained({REPO!r})
model = peft.get_peft_model(base, peft.LoraConfig(task_type="SEQ_2_SEQ_LM", r=2, lora_alpha=4, target_modules=["q", "v"]))
torch.manual_seed(0)
with torch.no_grad():
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.copy_(torch.randn(p.shape) * 0.1)
model.save_pretrained(sys.argv[1])
"""
    adapter = tmp_path / "adapter"
    py = subprocess.run([os.sys.executable, "-c", code, str(adapter)], env=env, capture_output=True, text=True,
                        timeout=180)
    assert py.returncode == 0, py.stderr
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == REPO
    hub.add_repo("tiny-org/adapter", {p.name: p.read_bytes() for p in adapter.iterdir() if p.is_file()})
    shutil.rmtree(env["HF_HUB_CACHE"], ignore_errors=True)
    out = tmp_path / "merged"
    result = trainer(trainer_binary, env, "merge", "--adapter", "tiny-org/adapter", "--output", out)
    assert result.returncode == 0, result.stderr
    assert (out / "model.safetensors").exists()
    assert (repo_dir(env, "tiny-org/adapter") / "refs" / "main").exists()
    assert (repo_dir(env) / "refs" / "main").exists()


def test_data_parallel_ranks_download_each_file_once(trainer_binary, hub, env, tmp_path):
    """trainer launch with 2 ranks on a Hub id: every rank resolves it, one downloads each file, both train."""
    hub.faults.slow["model.safetensors"] = 0.002
    out = tmp_path / "ranks"
    result = trainer(trainer_binary, {**env, "TRAINER_NUM_THREADS": "1"}, "launch", "--nproc-per-node", "2", "--",
                     "--config", "configs/tiny-t5.json", "--set", f"model.path={REPO}", "--set", "model.init=pretrained",
                     "--set", "training.max_steps=1", "--set", "evaluation.every_steps=0", "--set",
                     f"checkpoint.output_dir={out}", timeout=400)
    assert result.returncode == 0, result.stderr
    for name in ("model.safetensors", "spiece.model"):
        assert hub.count("GET", contains=f"file={name}") == 1, name
    assert hub.count("GET", contains="/config.json") == 1
    assert (out / "final").is_dir()


def test_evaluate_and_quantize_take_a_model_by_id(trainer_binary, hub, env, tmp_path):
    result = trainer(trainer_binary, env, "evaluate", "--config", "configs/tiny-t5.json", "--model", REPO, "--set",
                     "evaluation.max_batches=1", "--output", tmp_path / "eval")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "eval" / "metrics.json").exists()
    result = trainer(trainer_binary, env, "quantize", "--model", REPO, "--output", tmp_path / "q4")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "q4" / "model.safetensors").exists()
    assert hub.count("GET", contains="file=model.safetensors") == 1  # the second command found it cached


def test_a_resume_after_the_branch_moved_is_refused_and_the_old_commit_resumes(trainer_binary, hub, env, model_files,
                                                                                tmp_path):
    out = tmp_path / "run"
    args = ["--config", "configs/tiny-t5.json", "--set", "model.init=pretrained", "--set", "evaluation.every_steps=0",
            "--set", f"checkpoint.output_dir={out}", "--set", "checkpoint.every_steps=1"]
    first = hub.repos[REPO].refs["main"]
    result = trainer(trainer_binary, env, *args, "--set", f"model.path={REPO}", "--set", "training.max_steps=1")
    assert result.returncode == 0, result.stderr
    # The branch moves to other weights (every byte of the weights file changed, same shapes).
    moved = dict(model_files)
    moved["model.safetensors"] = model_files["model.safetensors"][:-8] + b"\x00" * 8
    second = hub.add_commit(REPO, moved)
    result = trainer(trainer_binary, env, *args, "--set", f"model.path={REPO}", "--set", "training.max_steps=2",
                     "--resume")
    assert result.returncode == 2, result.stderr
    assert "moved from commit " + first + " to " + second in result.stderr
    result = trainer(trainer_binary, env, *args, "--set", f"model.path={REPO}@{first}", "--set",
                     "training.max_steps=2", "--resume")
    assert result.returncode == 0, result.stderr


def test_a_terminal_sees_bytes_rate_and_eta(trainer_binary, hub, env):
    """On a terminal a download shows a live line; the log lines say what was downloaded either way."""
    hub.faults.slow["model.safetensors"] = 0.003
    primary, secondary = os.openpty()
    proc = subprocess.Popen([str(trainer_binary), "download", REPO], env=env, stdout=subprocess.PIPE,
                            stderr=secondary, text=True)
    os.close(secondary)
    try:
        chunks = []
        while True:
            try:
                data = os.read(primary, 4096)
            except OSError:  # the terminal closed with the process
                break
            if not data:
                break
            chunks.append(data)
        proc.wait(timeout=120)
    finally:
        os.close(primary)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    shown = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, shown
    assert "model.safetensors:" in shown and "/s, ETA" in shown, shown
    assert "downloaded model.safetensors" in shown


def test_a_download_held_by_another_process_is_waited_for_within_the_timeout(trainer_binary, hub, env, model_files,
                                                                             tmp_path):
    """Another process (huggingface_hub takes the same flock) holds a blob's lock: trainer waits for it, and a train
    run gives up after distributed.timeout_s in which that download made no progress."""
    import fcntl
    etag = hashlib.sha256(model_files["model.safetensors"]).hexdigest()
    lock_path = pathlib.Path(env["HF_HUB_CACHE"]) / ".locks" / ("models--" + REPO.replace("/", "--")) / f"{etag}.lock"
    lock_path.parent.mkdir(parents=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = trainer(trainer_binary, env, "--config", "configs/tiny-t5.json", "--set", f"model.path={REPO}",
                         "--set", "model.init=pretrained", "--set", "distributed.timeout_s=2", "--set",
                         f"checkpoint.output_dir={tmp_path / 'run'}", "--set", "training.max_steps=1")
        assert result.returncode == 3, result.stderr
        assert "made no progress" in result.stderr and etag in result.stderr
        # Released while trainer waits: it goes on and downloads the file itself.
        proc = subprocess.Popen([str(trainer_binary), "download", REPO], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(1.5)
            assert proc.poll() is None  # still waiting
            fcntl.flock(lock, fcntl.LOCK_UN)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, err
    assert "another process is downloading" in err
    assert (pathlib.Path(out.strip()) / "model.safetensors").read_bytes() == model_files["model.safetensors"]


def test_download_include_and_dry_run(trainer_binary, hub, env, model_files):
    result = trainer(trainer_binary, env, "download", REPO, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "model.safetensors" in result.stdout and "would be downloaded" in result.stdout
    assert hub.count("GET", contains="/cdn/") == 0 and not (repo_dir(env) / "blobs").exists()
    result = trainer(trainer_binary, env, "download", "--include", "*.json", REPO, "--include", "*.bin")
    assert result.returncode == 0, result.stderr
    snapshot = pathlib.Path(result.stdout.strip().splitlines()[-1])
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(n for n in model_files if n.endswith(".json"))
    assert "pickled weights, which trainer never downloads" in result.stderr  # *.bin matched, and was refused
    assert hub.count(contains="pytorch_model.bin") == 0


def test_a_lora_adapter_names_its_hub_base_as_peft_does(trainer_binary, hub, env, tmp_path):
    """LoRA over a base named by id: the adapter says the id and the commit (PEFT's base_model_name_or_path and
    revision), PEFT loads it from the cache by those alone, and `trainer merge` finds the same base."""
    out = tmp_path / "run"
    result = trainer(trainer_binary, env, "--config", "configs/tiny-t5.json", "--set", f"model.path={REPO}", "--set",
                     "model.init=pretrained", "--set", "lora.enabled=true", "--set", "training.max_steps=2", "--set",
                     "evaluation.every_steps=0", "--set", f"checkpoint.output_dir={out}", timeout=300)
    assert result.returncode == 0, result.stderr
    adapter = json.loads((out / "final" / "adapter_config.json").read_text())
    commit = hub.repos[REPO].refs["main"]
    assert (adapter["base_model_name_or_path"], adapter["revision"]) == (REPO, commit)
    code = ("import sys, peft; "
            "m = peft.AutoPeftModelForSeq2SeqLM.from_pretrained(sys.argv[1]); "
            "print(type(m.base_model.model).__name__)")
    hub.add_commit(REPO, {"README.md": b"main moved to a commit without the model"})
    py = subprocess.run([os.sys.executable, "-c", code, str(out / "final")], env={**env, "HF_HUB_OFFLINE": "1"},
                        capture_output=True, text=True, timeout=180)
    assert py.returncode == 0, py.stderr
    assert "T5ForConditionalGeneration" in py.stdout
    result = trainer(trainer_binary, env, "merge", "--adapter", out / "final", "--output", tmp_path / "merged")
    assert result.returncode == 0, result.stderr  # main moved away: the adapter's revision still names the base
    assert (tmp_path / "merged" / "model.safetensors").exists()
