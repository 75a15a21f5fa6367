"""trainer's TensorBoard event files, read by the tensorboard package itself: every scalar equals metrics.jsonl
(as float32), the sample generations are text summaries, every record is framed with tensorboard's own masked
CRC-32C, and a resumed run's curves continue without duplicated steps."""
import json
import pathlib
import struct

import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

# metrics.jsonl key -> TensorBoard tag, as docs/monitoring.md documents them.
TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "tokens": "train/tokens",
    "micro_batch": "memory/micro_batch",
    "micro_steps": "memory/micro_steps",
    "oom_retries": "memory/oom_retries",
    "adaptations": "memory/adaptations",
    "memory_allocated": "memory/allocated_bytes",
    "memory_peak": "memory/peak_bytes",
    "eval_loss": "eval/loss",
    "eval_perplexity": "eval/perplexity",
    "eval_tokens": "eval/tokens",
}


def float32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def accumulate(logdir):
    accumulator = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0})
    accumulator.Reload()
    return accumulator


def metrics(out_dir):
    with open(out_dir / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def event_files(out_dir):
    return sorted((out_dir / "tensorboard").glob("events.out.tfevents.*"))


@pytest.fixture(scope="module")
def t5_run(run_trainer, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("tb") / "run"
    run_trainer("--config", "configs/tiny-t5.json", "--set", "training.max_steps=8", "--set",
                "evaluation.every_steps=4", "--set", "checkpoint.every_steps=0", "--set",
                f"checkpoint.output_dir={out_dir}")
    return out_dir


def test_scalars_equal_metrics_jsonl(t5_run):
    expected = {}
    for record in metrics(t5_run):
        for key, value in record.items():
            if key != "step":
                expected.setdefault(TAGS[key], []).append((record["step"], float32(value)))
    assert len(expected["train/loss"]) == 8
    assert [step for step, _ in expected["eval/loss"]] == [4, 8]
    accumulator = accumulate(t5_run / "tensorboard")
    assert set(accumulator.Tags()["scalars"]) == set(expected)
    for tag, points in expected.items():
        assert [(e.step, e.value) for e in accumulator.Scalars(tag)] == points, tag


def test_sample_generations_are_text_summaries(t5_run):
    accumulator = accumulate(t5_run / "tensorboard")
    assert "samples/0" in accumulator.Tags()["tensors"]
    samples = accumulator.Tensors("samples/0")
    assert [s.step for s in samples] == [4, 8]
    text = samples[0].tensor_proto.string_val[0].decode("utf-8")
    assert text.startswith("**prompt** Write the steps for Creamy lemon soup.")
    assert "**generation**" in text
    assert accumulator.summary_metadata["samples/0"].plugin_data.plugin_name == "text"


def test_records_are_framed_with_masked_crc32c(t5_run):
    [path] = event_files(t5_run)
    data = path.read_bytes()
    events, at = [], 0
    while at < len(data):
        header = data[at:at + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[at + 8:at + 12])[0] == masked_crc32c(header)
        payload = data[at + 12:at + 12 + length]
        assert struct.unpack("<I", data[at + 12 + length:at + 16 + length])[0] == masked_crc32c(payload)
        events.append(event_pb2.Event.FromString(payload))
        at += 16 + length
    assert at == len(data)
    assert events[0].file_version == "brain.Event:2"
    assert events[1].session_log.status == event_pb2.SessionLog.START
    wall_times = [e.wall_time for e in events]
    assert wall_times == sorted(wall_times) and wall_times[0] > 1.6e9


def test_resumed_run_continues_the_curves_without_duplicates(run_trainer, tmp_path):
    out_dir = tmp_path / "resume"
    common = ["--config", "configs/tiny-qwen2.json", "--set", "training.max_steps=6", "--set",
              "evaluation.every_steps=0", "--set", "checkpoint.every_steps=3", "--set",
              f"checkpoint.output_dir={out_dir}"]
    run_trainer(*common)
    # As after a crash at step 6 before its checkpoint was complete: the newest complete checkpoint is step 3, so
    # steps 4..6 are trained (and logged) again.
    (out_dir / "checkpoint-6" / "COMPLETE").unlink()
    run_trainer(*common, "--resume")
    assert len(event_files(out_dir)) == 2
    losses = [r for r in metrics(out_dir) if "loss" in r]
    assert [r["step"] for r in losses] == [1, 2, 3, 4, 5, 6, 4, 5, 6]
    scalars = accumulate(out_dir / "tensorboard").Scalars("train/loss")
    assert [e.step for e in scalars] == [1, 2, 3, 4, 5, 6]
    assert [e.value for e in scalars] == [float32(r["loss"]) for r in losses[:3] + losses[6:]]
