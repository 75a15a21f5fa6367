"""Chat records as trainer's loader makes them (`trainer data --dump`) against transformers on a Qwen2-style
tokenizer (configs/models/tiny-qwen2's tokenizer.json) and the real chat templates of test_chat_templates.py:
the ids equal apply_chat_template(..., tokenize=True); the trained tokens equal return_assistant_tokens_mask for
templates with {% generation %} (and for those trainer swaps its training version in for, Mistral v0.3's, that
version's), and elsewhere the assistant spans found prefix by prefix on transformers' own renderings, or where that
fails by probing the template (test_chat_probe_spans.py's rule), placed on tokens by the tokenizer's offsets as
transformers places generation spans; the dump's "mask" names which of these made each record's mask."""
import json
import shutil

import pytest

transformers = pytest.importorskip("transformers")

from test_chat_templates import (  # noqa: E402  (the templates and conversations of the rendering parity suite)
    ALTERNATING, SEARCH_TOOL, SUPPORTS_SYSTEM, SUPPORTS_TOOLS, TEMPLATES, TOOL_CONVERSATION, WEATHER_TOOL,
    WITH_SYSTEM)
from test_chat_training_templates import trainers_training_version  # noqa: E402
from test_chat_probe_spans import probe_spans_of  # noqa: E402

GENERATION_TEMPLATES = {name for name, text in TEMPLATES.items() if "{% generation %}" in text
                        or "{%- generation %}" in text}


def conversations(template):
    """(name, messages, tools) with an assistant message to train on, not opening with one."""
    found = dict(ALTERNATING)
    if template in SUPPORTS_SYSTEM:
        found.update(WITH_SYSTEM)
    out = [(name, messages, None) for name, messages in found.items()]
    if template in SUPPORTS_TOOLS:
        out.append(("tools", ALTERNATING["multi-turn"], [WEATHER_TOOL, SEARCH_TOOL]))
        out.append(("tool-calls", TOOL_CONVERSATION, [WEATHER_TOOL]))
    out.append(("recipe", [{"role": "user", "content": "Soup?"}, {"role": "assistant", "content": "Boil water."},
                           {"role": "user", "content": "Then?"}, {"role": "assistant", "content": "Crème brûlée 🍮."}],
                None))
    # U+FFFD in the text itself, split over byte-level tokens, at a span's edges and inside it.
    out.append(("replacement-char", [{"role": "user", "content": "Why \ufffd?"},
                                     {"role": "assistant", "content": "\ufffd means a byte was lost \ufffd\ufffd"}],
                None))
    return [(name, messages, tools) for name, messages, tools in out
            if any(m["role"] == "assistant" for m in messages) and messages[0]["role"] != "assistant"]


def model_dir(root, tmp_path, template):
    """The tiny Qwen2 tokenizer with `template` as its chat template."""
    directory = tmp_path / "model"
    directory.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / "configs" / "models" / "tiny-qwen2" / name, directory / name)
    (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
    # Templates that open with bos_token (Llama 2, Mistral) need one: transformers leaves an undefined name an error.
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["bos_token"] = "<|endoftext|>"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def dump(run_trainer, tmp_path, directory, records, train_on):
    data = tmp_path / f"chat-{train_on}.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for messages, tools in records:
            record = {"messages": messages} if tools is None else {"messages": messages, "tools": tools}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    config = tmp_path / f"config-{train_on}.json"
    config.write_text(json.dumps({
        "model": {"path": str(directory), "init": "random"},
        "data": {"train_files": [str(data)], "train_on": train_on, "max_length": 100000, "on_bad_record": "skip"},
        "device": {"type": "cpu"}}))
    out = run_trainer("data", "--config", config, "--dump", len(records), data).stdout
    lines = [json.loads(line) for line in out.split("\n") if line.startswith("{")]  # not splitlines: U+2028 in text
    assert len(lines) == len(records)
    return lines


def prefix_spans(tokenizer, messages, tools):
    """Character spans of each assistant message: what its turn adds after the conversation before it with the
    generation prompt, up to where the whole conversation's rendering stops agreeing. None where the renderings are
    not prefixes of each other (trainer then refuses the record)."""
    def render(part, add_generation_prompt):
        return tokenizer.apply_chat_template(part, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    full = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt, turn = render(messages[:i], True), render(messages[: i + 1], False)
        if not turn.startswith(prompt) or not full.startswith(prompt):
            return None
        end = len(prompt)
        while end < len(turn) and end < len(full) and turn[end] == full[end]:
            end += 1
        if end == len(prompt) and len(turn) > len(prompt):
            return None
        spans.append((len(prompt), end))
    return spans


def spans_by_probing(tokenizer, messages, tools):
    """The probe rule on transformers' renderings with the tokenizer's template and special tokens."""
    def text(part, add_generation_prompt=False):
        try:
            return tokenizer.apply_chat_template(part, tools=tools, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
        except Exception:  # noqa: BLE001 - a conversation the template refuses has no rendering
            return None
    return probe_spans_of(text, messages)


def mask_of_spans(tokenizer, text, spans):
    """transformers' placement of generation spans on tokens (char_to_token of each span's first and last
    character), as apply_chat_template(return_assistant_tokens_mask=True) does."""
    encoding = tokenizer(text, add_special_tokens=False)
    mask = [0] * len(encoding["input_ids"])
    for start, end in spans:
        if end <= start:
            continue
        first = encoding.char_to_token(0, start)
        if first is None:
            break
        last = encoding.char_to_token(0, end - 1)
        for t in range(first, last + 1 if last else len(mask)):
            mask[t] = 1
    return mask


def trained(labels):
    return [int(label != -100) for label in labels]


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_ids_and_assistant_mask_equal_transformers(root, tmp_path, run_trainer, template):
    directory = model_dir(root, tmp_path, TEMPLATES[template])
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    cases = conversations(template)
    ours = dump(run_trainer, tmp_path, directory, [(m, t) for _, m, t in cases], "assistant")
    generation = template in GENERATION_TEMPLATES
    checked = refused = 0
    for (name, messages, tools), got in zip(cases, ours):
        expected = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=generation)
        swapped = None if generation else trainers_training_version(TEMPLATES[template])
        method = "generation" if generation else "training_template" if swapped is not None else "prefix"
        if generation:
            mask = expected["assistant_masks"]
        elif swapped is not None:
            # trainer recognises the template (Mistral v0.3's) and takes the masks from its training version's
            # {% generation %} marks (test_chat_training_templates.py), the ids from the model's rendering.
            mask = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                                 chat_template=swapped, return_assistant_tokens_mask=True
                                                 )["assistant_masks"]
        else:
            spans = prefix_spans(tokenizer, messages, tools)
            if spans is None:
                # The template renders earlier turns differently once the conversation goes on: trainer probes it,
                # and refuses the record where this reference of the rule does.
                method = "probe"
                spans = spans_by_probing(tokenizer, messages, tools)
            if spans is None:
                assert "cannot find the span" in got.get("skipped", ""), (name, got)
                refused += 1
                continue
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
            mask = mask_of_spans(tokenizer, text, spans)
        assert "skipped" not in got, (name, got)
        assert got["mask"] == method, (name, got["mask"])
        assert got["input_ids"] == list(expected["input_ids"]), name
        assert got["text"] == tokenizer.apply_chat_template(messages, tools=tools, tokenize=False), name
        assert 0 < sum(mask) < len(mask), name  # some tokens trained, not all
        assert trained(got["labels"]) == list(mask), name
        assert all(label in (-100, token) for label, token in zip(got["labels"], got["input_ids"])), name
        checked += 1
    assert checked >= 1 and checked + refused == len(cases)


def test_train_on_last_assistant_and_all(root, tmp_path, run_trainer):
    directory = model_dir(root, tmp_path, TEMPLATES["qwen2.5"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    cases = [(TOOL_CONVERSATION, [WEATHER_TOOL]), (WITH_SYSTEM["system+multi-turn"], None)]
    last = dump(run_trainer, tmp_path, directory, cases, "last_assistant")
    every = dump(run_trainer, tmp_path, directory, cases, "all")
    for (messages, tools), got_last, got_all in zip(cases, last, every):
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        spans = prefix_spans(tokenizer, messages, tools)
        assert len(spans) == 2
        assert trained(got_last["labels"]) == mask_of_spans(tokenizer, text, spans[-1:])
        assert got_all["labels"] == got_all["input_ids"] == got_last["input_ids"]
        # The last turn's text, with its end-of-turn marker, is what is trained.
        ids = [t for t, label in zip(got_last["input_ids"], got_last["labels"]) if label != -100]
        assert tokenizer.decode(ids) == text[spans[-1][0]:spans[-1][1]]
        assert tokenizer.decode(ids).endswith("<|im_end|>\n")


def test_generation_mask_on_a_real_tokenizer_dir_with_a_template_list(root, tmp_path, run_trainer):
    """tokenizer_config.json's chat_template as a list of named templates: default without tools, tool_use with."""
    directory = model_dir(root, tmp_path, "")
    (directory / "chat_template.jinja").unlink()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": TEMPLATES["chatml-generation"]},
                               {"name": "tool_use", "template": TEMPLATES["qwen2.5"]}]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    plain = ALTERNATING["multi-turn"]
    got_plain, got_tools = dump(run_trainer, tmp_path, directory, [(plain, None), (TOOL_CONVERSATION, [WEATHER_TOOL])],
                                "assistant")
    expected = tokenizer.apply_chat_template(plain, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert got_plain["input_ids"] == list(expected["input_ids"])
    assert trained(got_plain["labels"]) == list(expected["assistant_masks"])
    expected = tokenizer.apply_chat_template(TOOL_CONVERSATION, tools=[WEATHER_TOOL], tokenize=True, return_dict=True)
    assert got_tools["input_ids"] == list(expected["input_ids"])
    assert "# Tools" in got_tools["text"]
