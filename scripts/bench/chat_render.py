#!/usr/bin/env python3
"""Chat records per second: trainer's render + tokenize (+ assistant mask) against transformers'
apply_chat_template(tokenize=True) on the same records, one core each.

The records are the demo's conversations (scripts/make_demo_data.py --form chat: two assistant turns, a third with a
tool call), rendered by Qwen2.5's chat template with the tiny Qwen2 tokenizer (configs/models/tiny-qwen2).

- trainer dump: `trainer data --dump N` (one thread: record mapping only, JSON lines out), minus the time of
  `--dump 0` (start-up: the tokenizer and template loaded);
- trainer loader: `trainer data` with data.num_workers=1 (the loader's own examples/s: read, map, batch, collate);
- transformers: apply_chat_template(messages, tools=..., tokenize=True, return_dict=True) in a loop.
Each with data.train_on=all (render + tokenize) and assistant (+ the spans, rendered prefix by prefix); and with
assistant masks from the same template with {% generation %} marks, against transformers'
return_assistant_tokens_mask=True on that template (the same work on both sides: one render that records the spans).

    .venv/bin/python scripts/bench/chat_render.py --records 3000
    .venv/bin/python scripts/bench/chat_render.py --records 20000 --before OLD/trainer   # two builds, alternately
"""
import argparse
import json
import os
import pathlib
import re
import resource
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def with_generation_marks(template):
    """Qwen2.5's template with the assistant's text and end-of-turn marker inside {% generation %}: the same
    renderings, and transformers' return_assistant_tokens_mask gives the assistant mask from one render."""
    plain = ("{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}")
    tagged = ("{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}{% generation %}"
              "{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}{%- else %}" + plain +
              "{%- endif %}")
    calls_open = "{{- '<|im_start|>' + message.role }}\n        {%- if message.content %}"
    calls_close = "{%- endfor %}\n        {{- '<|im_end|>\\n' }}"
    for part in (plain, calls_open, calls_close):
        if template.count(part) != 1:
            sys.exit(f"the model's chat template is not Qwen2.5's as this benchmark expects (looked for {part!r})")
    template = template.replace(plain, tagged)
    template = template.replace(calls_open, "{{- '<|im_start|>' + message.role }}{% generation %}\n"
                                            "        {%- if message.content %}")
    return template.replace(calls_close, "{%- endfor %}\n        {{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}")


def children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def trainer_seconds(binary, config, args):
    """Wall-clock and CPU seconds (user + system) of one `trainer data` run, and its output."""
    start, cpu = time.perf_counter(), children_cpu()
    result = subprocess.run([str(binary), "data", "--config", str(config), *args], cwd=ROOT, capture_output=True,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if result.returncode != 0:
        sys.exit(f"trainer data failed: {result.stderr}")
    return time.perf_counter() - start, children_cpu() - cpu, result.stdout


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=3000)
    parser.add_argument("--binary", default=os.environ.get("TRAINER_BINARY", ROOT / "build" / "trainer"))
    parser.add_argument("--before", help="another trainer binary (an older build), measured alternately with --binary")
    args = parser.parse_args()
    import transformers

    model = ROOT / "configs" / "models" / "tiny-qwen2"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        data = tmp / "chat.jsonl"
        subprocess.run([sys.executable, ROOT / "scripts" / "make_demo_data.py", "--form", "chat", "--records",
                        str(args.records), "--seed", "11", "--out", str(data)], check=True)
        records = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines()]
        tagged = tmp / "qwen2.5-generation.jinja"
        tagged.write_text(with_generation_marks((model / "chat_template.jinja").read_text(encoding="utf-8")),
                          encoding="utf-8")
        rows = []
        for train_on, template in (("all", None), ("assistant", None), ("assistant", tagged)):
            name = train_on if template is None else f"{train_on}, {{% generation %}} template"
            config = tmp / f"config-{train_on}{'-tagged' if template else ''}.json"
            data_section = {"train_files": [str(data)], "train_on": train_on, "max_length": 4096, "num_workers": 1}
            if template is not None:
                data_section["chat_template"] = str(template)
            config.write_text(json.dumps({
                "model": {"path": str(model), "init": "random"}, "data": data_section,
                "training": {"batch_size": 16}, "device": {"type": "cpu"}}))
            binaries = [("before: ", args.before), ("", args.binary)] if args.before else [("", args.binary)]
            start_cpu = {}
            for label, binary in binaries:
                base, base_cpu, _ = trainer_seconds(binary, config, ["--dump", "0", str(data)])
                whole, whole_cpu, _ = trainer_seconds(binary, config, ["--dump", str(len(records)), str(data)])
                start_cpu[label] = base_cpu
                rows.append((f"{label}trainer --dump (train_on={name})", len(records) / max(whole - base, 1e-9),
                             len(records) / max(whole_cpu - base_cpu, 1e-9)))
            for label, binary in binaries:
                _, loader_cpu, out = trainer_seconds(binary, config, [])
                rate = float(re.search(r"([0-9.]+) examples/s", out).group(1))
                # Per CPU second: the whole `trainer data` run (its reader thread, worker, batching and report)
                # less the start-up that `--dump 0` takes.
                rows.append((f"{label}trainer loader, 1 worker (train_on={name})", rate,
                             len(records) / max(loader_cpu - start_cpu[label], 1e-9)))

        tokenizer = transformers.AutoTokenizer.from_pretrained(model)
        start, cpu = time.perf_counter(), time.process_time()
        for record in records:
            tokenizer.apply_chat_template(record["messages"], tools=record.get("tools"), tokenize=True,
                                          return_dict=True)
        hf = len(records) / (time.perf_counter() - start)
        hf_cpu = len(records) / (time.process_time() - cpu)
        rows.append(("transformers apply_chat_template(tokenize=True)", hf, hf_cpu))
        # The same work as trainer's masks with the tagged template: one render that records the generation spans.
        tagged_text = tagged.read_text(encoding="utf-8")
        for record in records[:50]:  # the tags change no rendering
            pair = [tokenizer.apply_chat_template(record["messages"], tools=record.get("tools"), tokenize=False,
                                                  chat_template=t) for t in (None, tagged_text)]
            assert pair[0] == pair[1], "the {% generation %} tags changed a rendering"
        start, cpu = time.perf_counter(), time.process_time()
        for record in records:
            out = tokenizer.apply_chat_template(record["messages"], tools=record.get("tools"), tokenize=True,
                                                return_dict=True, return_assistant_tokens_mask=True,
                                                chat_template=tagged_text)
            assert any(out["assistant_masks"])
        masks = len(records) / (time.perf_counter() - start)
        masks_cpu = len(records) / (time.process_time() - cpu)
        rows.append(("transformers apply_chat_template(tokenize=True, return_assistant_tokens_mask=True), "
                     "{% generation %} template", masks, masks_cpu))

    print(f"{len(records)} chat records, Qwen2.5 template, tiny Qwen2 tokenizer, one core each "
          f"(transformers {transformers.__version__}); records per wall-clock second, and per CPU second (user +\n"
          f"system: steadier on a shared machine; the loader's wall-clock rate is its own report, its CPU rate the\n"
          f"whole `trainer data` run's less the start-up)\n")
    print("| what | records/s | vs transformers | records/CPU-s | vs transformers (CPU) |")
    print("|---|---:|---:|---:|---:|")
    for name, rate, rate_cpu in rows:
        # Masks from a {% generation %} template against transformers' masks from the same template; the rest
        # against its plain apply_chat_template (it has no assistant mask for a template without the tags).
        ref, ref_cpu = (masks, masks_cpu) if "generation %} template" in name else (hf, hf_cpu)
        cpu_cells = f"{rate_cpu:,.0f} | {rate_cpu / ref_cpu:.1f}x" if rate_cpu is not None else "- | -"
        print(f"| {name} | {rate:,.0f} | {rate / ref:.1f}x | {cpu_cells} |")


if __name__ == "__main__":
    main()
