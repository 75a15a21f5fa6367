"""Chat templates that rendering prefix by prefix cannot split, swapped for trainer's training versions as TRL's
SFTTrainer(assistant_only_loss=True) swaps them (trl.chat_template_utils.get_training_chat_template), TRL 1.16.

The model templates are TRL's own copies, read from the installed trl package at test time (TRL recognises a model
by the exact text, as trainer does). For each family trainer knows:
(1) `trainer data --dump` renders the conversation as transformers renders TRL's training version (which keeps
    reasoning the original drops; where it drops nothing, as the original), and names the swap in its log;
(2) the ids and labels equal SFTTrainer(assistant_only_loss=True)'s input_ids and labels (its assistant masks);
(3) DPO pairs equal DPOTrainer's, which renders with the model's own template (TRL swaps nothing there), except
    where the pair's rendering does not begin with the prompt's: there the completion's assistant spans are trained;
(4) a template one byte away from a known one is not recognised: it is not swapped, and trains by probing the
    template (src/chat/chat_template.h); copies that are not byte-identical (whitespace changes, a fork with a default
    system prompt, Qwen3's April 2025 revision) train with the masks their training version would give, their ids
    transformers'; a template the probe cannot trust is refused, and the hint names the families; and train_on=all
    keeps the model's own rendering (TRL swaps only for assistant_only_loss).
For the templates TRL 1.16 has no training version of (the Gemma 4 revisions it ships as gemma4*.jinja, Mistral v3's
from test_chat_templates.py), trainer's own version (read from src/chat/training_templates.cpp) is checked instead
against transformers: it renders what the original renders, its {% generation %} marks are the assistant's text and
end-of-turn marker (Gemma 3's rule), and the dump's ids are the original's rendering, its labels those marks as
return_assistant_tokens_mask places them; (3) and (4) as above.
"""
import hashlib
import json
import pathlib
import re
import shutil

import datasets
import pytest
import torch
import transformers
import trl
from transformers.utils.chat_template_utils import render_jinja_template
from trl.chat_template_utils import get_training_chat_template

from test_chat_templates import MISTRAL_V03, WEATHER_TOOL

TRL_TEMPLATES = pathlib.Path(trl.__file__).parent / "chat_templates"
FAMILIES = {"Qwen3": "qwen3", "Qwen3-Instruct-2507": "qwen3_instruct_2507",
            "DeepSeek-R1-Distill": "deepseek_r1_distill", "Gemma 3": "gemma3", "gpt-oss": "gptoss"}
# Families whose training version renders what the original renders (only the marks differ).
SAME_RENDERING = {"Qwen3-Instruct-2507", "Gemma 3", "gpt-oss"}


# Templates TRL 1.16 recognises but has no training version of, and Mistral v3's, which it does not know: trainer's own
# versions. Gemma 4 by the commit of google/gemma-4-E2B-it that shipped each revision (TRL's file names in brackets);
# its release revision (4742fe8, TRL's gemma4_v2.jinja) renders earlier turns the same, so prefix by prefix splits it.
OWN = {"Gemma 4 at b446025": "gemma4_v3", "Gemma 4 at 6b7e72c": "gemma4", "Gemma 4 at 905e84b": "gemma4_v4",
       "Gemma 4 at 8995379": "gemma4_v5", "Mistral v3": None}
END_OF_TURN = {"Gemma 4": "<turn|>\n", "Mistral v3": "<|endoftext|>"}  # the tiny tokenizer's eos_token
SOURCE = pathlib.Path(__file__).resolve().parents[2] / "src" / "chat" / "training_templates.cpp"


def trainers_training_templates():
    """{SHA-256 of a model's template: (family, trainer's training version)}, as src/chat/training_templates.cpp
    holds them."""
    source = SOURCE.read_text(encoding="utf-8")
    texts = dict(re.findall(r'constexpr std::string_view (k\w+) = R"jinja\((.*?)\)jinja";', source, re.S))
    rows = re.findall(r'TrainingTemplate\{"([^"]+)",\s*"([0-9a-f]{64})", (k\w+)\}', source)
    assert rows and all(ident in texts for _, _, ident in rows)
    return {digest: (family, texts[ident]) for family, digest, ident in rows}


def trainers_training_version(template):
    """trainer's training version of `template` (its exact text), or None."""
    found = trainers_training_templates().get(hashlib.sha256(template.encode("utf-8")).hexdigest())
    return None if found is None else found[1]


def family_of(name):
    return name if name in FAMILIES else name.split(" at ")[0]


def original(family):
    if family in OWN:
        return MISTRAL_V03 if OWN[family] is None else (TRL_TEMPLATES / f"{OWN[family]}.jinja").read_text(encoding="utf-8")
    return (TRL_TEMPLATES / f"{FAMILIES[family]}.jinja").read_text(encoding="utf-8")


def conversations(family):
    """Multi-turn conversations whose earlier assistant turns carry reasoning (in the content, where the template
    reads it from there): what the originals of Qwen3 and DeepSeek-R1-Distill re-render."""
    think = family in ("Qwen3", "DeepSeek-R1-Distill")
    def answer(reasoning, text):
        return f"<think>\n{reasoning}\n</think>\n\n{text}" if think else text
    return [
        [{"role": "user", "content": "Soup?"}, {"role": "assistant", "content": answer("Water boils.", "Boil water.")}],
        [{"role": "user", "content": "Soup?"}, {"role": "assistant", "content": answer("Water first.", "Boil water.")},
         {"role": "user", "content": "Then?"},
         {"role": "assistant", "content": answer("Salt last.", "Add salt, crème fraîche 🍲.")}],
        [{"role": "system", "content": "You cook."}, {"role": "user", "content": "Bread?"},
         {"role": "assistant", "content": "Knead it."}, {"role": "user", "content": "How long?"},
         {"role": "assistant", "content": answer("Gluten needs time.", "Ten minutes.")},
         {"role": "user", "content": "Oven?"}, {"role": "assistant", "content": "220 degrees."}],
    ]


def model_dir(root, path, template, weights=False):
    """The tiny Qwen2 (tokenizer, and random weights when a TRL trainer needs a model) with `template`."""
    tiny = root / "configs" / "models" / "tiny-qwen2"
    path.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, path / name)
    (path / "chat_template.jinja").write_text(template, encoding="utf-8")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["bos_token"] = "<|endoftext|>"  # DeepSeek's template opens with bos_token
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if weights:
        torch.manual_seed(1234)
        transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tiny)).save_pretrained(path)
    return path


def dump(run_trainer, tmp_path, directory, rows, train_on="assistant", extra=None, check=True):
    data = tmp_path / f"data-{train_on}.jsonl"
    data.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    config = {"model": {"path": str(directory), "init": "random"},
              "data": {"train_files": [str(data)], "train_on": train_on, "max_length": 100000,
                       "on_bad_record": "skip"},
              "device": {"type": "cpu"}}
    for section, values in (extra or {}).items():
        config.setdefault(section, {}).update(values)
    path = tmp_path / f"config-{train_on}.json"
    path.write_text(json.dumps(config))
    result = run_trainer("data", "--config", path, "--dump", len(rows), check=check)
    lines = [json.loads(line) for line in result.stdout.split("\n") if line.startswith("{")]
    return lines, result


def trained(labels):
    return [int(label != -100) for label in labels]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_trl_recognises_the_template_and_prefix_rendering_cannot_split_it(family, root, tmp_path):
    """The premise: TRL swaps this exact text for a training version."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir(root, tmp_path / "m", original(family)))
    assert get_training_chat_template(tokenizer) is not None


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sft_ids_and_labels_equal_trls_assistant_only_loss(family, root, tmp_path, run_trainer):
    directory = model_dir(root, tmp_path / "model", original(family), weights=True)
    rows = [{"messages": messages} for messages in conversations(family)]
    ours, result = dump(run_trainer, tmp_path, directory, rows)
    # (1) the swap is named in the log
    assert f"is the {family} template" in result.stdout + result.stderr
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    training = get_training_chat_template(tokenizer)
    for row, got in zip(rows, ours):
        assert "skipped" not in got, got
        # (1) the rendering is transformers' rendering of TRL's training version ...
        assert got["text"] == tokenizer.apply_chat_template(row["messages"], tokenize=False, chat_template=training)
        # ... which is the original's where the training version changes nothing but the marks, and for Qwen3's
        # one-turn conversation (the original keeps the reasoning of turns after the last user message)
        if family in SAME_RENDERING or (family == "Qwen3" and len(row["messages"]) == 2):
            assert got["text"] == tokenizer.apply_chat_template(row["messages"], tokenize=False)
    # (2) SFTTrainer itself, assistant-only loss
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), assistant_only_loss=True, report_to=[], use_cpu=True,
                         bf16=False, max_length=None)
    sft = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=tokenizer)
    theirs = list(sft.train_dataset)
    assert len(theirs) == len(ours)
    for got, expected in zip(ours, theirs):
        assert got["input_ids"] == expected["input_ids"]
        assert got["labels"] == expected["labels"]  # SFTTrainer's labels: -100 outside the assistant mask
        assert 0 < sum(trained(expected["labels"])) < len(expected["labels"])


@pytest.mark.parametrize("family", sorted(FAMILIES) + sorted(OWN))
def test_train_on_all_keeps_the_models_rendering(family, root, tmp_path, run_trainer):
    directory = model_dir(root, tmp_path / "model", original(family))
    rows = [{"messages": messages} for messages in conversations(family)]
    ours, result = dump(run_trainer, tmp_path, directory, rows, train_on="all")
    assert "training template" not in result.stdout + result.stderr
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    for row, got in zip(rows, ours):
        assert got["text"] == tokenizer.apply_chat_template(row["messages"], tokenize=False)
        assert got["labels"] == got["input_ids"]


@pytest.mark.parametrize("family", sorted(FAMILIES) + sorted(OWN))
def test_dpo_pairs_equal_dpotrainers(family, root, tmp_path, run_trainer):
    """DPOTrainer renders prompt and prompt + completion with the model's template and starts the completion where
    their tokens part: no swap, and a template that re-renders earlier turns is no problem there. Where the pair's
    rendering does not begin with the prompt's (Mistral v3 with a system message), trainer trains the completion's
    assistant span instead of what follows the shared tokens, which would hold the prompt's last user turn."""
    directory = model_dir(root, tmp_path / "model", original(family), weights=True)
    rows = []
    for messages in conversations(family):
        prompt = messages[:-1]
        rows.append({"prompt": prompt, "chosen": [messages[-1]],
                     "rejected": [{"role": "assistant", "content": "No idea."}]})
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    config = tmp_path / "dpo.json"
    config.write_text(json.dumps({
        "model": {"path": str(directory), "init": "pretrained"},
        "data": {"train_files": [str(data)], "max_length": 1024},
        "training": {"objective": "dpo"}, "device": {"type": "cpu"}}))
    result = run_trainer("data", "--config", config, "--dump", len(rows))
    assert "training template" not in result.stdout + result.stderr
    ours = [json.loads(line) for line in result.stdout.split("\n") if line.startswith("{")]
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, max_length=1024)
    dpo = trl.DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=tokenizer)
    theirs = list(dpo.train_dataset)
    assert len(ours) == len(theirs) == len(rows)
    from test_chat_data import mask_of_spans, prefix_spans, spans_by_probing
    spanned = 0
    for row, a, b in zip(rows, ours, theirs):
        prompt = b["prompt_ids"]
        asked = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        for side, ids_key, labels_key in [("chosen", "input_ids", "labels"),
                                          ("rejected", "rejected_ids", "rejected_labels")]:
            assert a[ids_key] == prompt + b[f"{side}_ids"], side
            messages = row["prompt"] + row[side]
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            if text.startswith(asked):
                assert a[labels_key] == [-100] * len(prompt) + b[f"{side}_ids"], side
                continue
            # The template renders the prompt otherwise once the answer follows (Mistral v3 moves the system message
            # into the last user turn only when it ends the conversation): DPOTrainer's completion would hold the
            # prompt's own text; trainer trains the completion's assistant span, by the rule of chat records.
            spans = prefix_spans(tokenizer, messages, None) or spans_by_probing(tokenizer, messages, None)
            spans = spans[sum(m["role"] == "assistant" for m in row["prompt"]):]
            assert trained(a[labels_key]) == mask_of_spans(tokenizer, text, spans), side
            ids = [t for t, label in zip(a[ids_key], a[labels_key]) if label != -100]
            assert row["prompt"][-1]["content"] not in tokenizer.decode(ids), side
            answer = row[side][-1]["content"].split("</think>")[-1].strip()  # DeepSeek's drops the reasoning
            assert answer in tokenizer.decode(ids), side
            spanned += 1
    if family == "Mistral v3":
        assert spanned == 2  # the conversation with a system message, chosen and rejected


def test_a_template_one_byte_away_is_not_swapped_and_trains_by_probing(root, tmp_path, run_trainer):
    """Not recognised, so not swapped: rendering prefix by prefix cannot split it, and probing the template finds the
    spans (test_chat_probe_spans.py's rule, on transformers' renderings)."""
    changed = original("Qwen3").replace("# Tools", "# Tools:")
    assert changed != original("Qwen3")
    directory = model_dir(root, tmp_path / "model", changed)
    rows = [{"messages": conversations("Qwen3")[1]}]
    ours, result = dump(run_trainer, tmp_path, directory, rows)
    assert "training template" not in result.stdout + result.stderr
    check_probed(directory, rows, ours)


def test_a_gemma_4_template_one_byte_away_trains_by_probing(root, tmp_path, run_trainer):
    """The current Gemma 4 revision with a word of its opening comment changed renders the same, drops reasoning
    from earlier turns (prefix by prefix cannot split it), and trains by probing."""
    changed = original("Gemma 4 at 8995379").replace("Canonical", "canonical", 1)
    assert changed != original("Gemma 4 at 8995379")
    directory = model_dir(root, tmp_path / "model", changed)
    rows = [{"messages": dict((name, m) for name, m, _ in own_conversations("Gemma 4 at 8995379"))["reasoning"]}]
    ours, result = dump(run_trainer, tmp_path, directory, rows)
    assert "training template" not in result.stdout + result.stderr
    check_probed(directory, rows, ours)


def check_probed(directory, rows, ours, training=None):
    """Each dumped record: transformers' rendering and ids; labels on the spans found prefix by prefix, else by
    probing, on transformers' renderings (the dump's "mask" names which); where `training` (the template's training
    version) renders the same text, labels on its {% generation %} marks too. Returns how many were probed."""
    from test_chat_data import mask_of_spans, prefix_spans, spans_by_probing
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    probed = 0
    assert len(ours) == len(rows)
    for row, got in zip(rows, ours):
        messages, tools = row["messages"], row.get("tools")
        assert "skipped" not in got, got
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        assert got["text"] == text
        assert got["input_ids"] == list(tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                                                      return_dict=True)["input_ids"])
        spans, method = prefix_spans(tokenizer, messages, tools), "prefix"
        if spans is None:
            spans, method = spans_by_probing(tokenizer, messages, tools), "probe"
        assert spans is not None
        assert got["mask"] == method
        mask = mask_of_spans(tokenizer, text, spans)
        assert 0 < sum(mask) < len(mask)
        assert trained(got["labels"]) == mask
        if training is not None and tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                                  chat_template=training) == text:
            expected = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                                     chat_template=training, return_assistant_tokens_mask=True)
            assert trained(got["labels"]) == list(expected["assistant_masks"])
        probed += method == "probe"
    return probed


# Qwen3's template as its repositories shipped it in April 2025, rebuilt from the current one by undoing what changed
# since: message.content read as it is (not only when a string), reasoning_content taken when defined and not none.
QWEN3_SINCE_APRIL_2025 = [
    ('message.role == "user" and message.content is string and not(', 'message.role == "user" and not('),
    ("""    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
""", """    {%- set content = message.content %}
"""),
    ("message.reasoning_content is string",
     "message.reasoning_content is defined and message.reasoning_content is not none"),
]
QWEN3_SYSTEM = r"""    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}"""


def qwen3_of_april_2025(text):
    for now, then in QWEN3_SINCE_APRIL_2025:
        assert now in text
        text = text.replace(now, then)
    return text


def with_default_system_prompt(text):
    assert QWEN3_SYSTEM in text
    return text.replace(QWEN3_SYSTEM, QWEN3_SYSTEM.replace(
        "    {%- endif %}\n{%- endif %}",
        "    {%- else %}\n        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
        "    {%- endif %}\n{%- endif %}"))


def with_whitespace_changes(text):
    assert "{%- endfor %}" in text
    return text.replace("{%- endfor %}", "{%-  endfor  %}") + "\n"


# Copies of known templates that are not byte-identical: (family, the change, made to the template and its training
# version alike).
COPIES = {
    "Qwen3 with whitespace changes": ("Qwen3", with_whitespace_changes),
    "Qwen3 fork with a default system prompt": ("Qwen3", with_default_system_prompt),
    "Qwen3 of April 2025": ("Qwen3", qwen3_of_april_2025),
    "Mistral v3 with whitespace changes": ("Mistral v3", with_whitespace_changes),
    "Gemma 4 at 8995379 with whitespace changes": ("Gemma 4 at 8995379", with_whitespace_changes),
}


@pytest.mark.parametrize("copy", sorted(COPIES))
def test_copies_that_are_not_byte_identical_train_with_the_training_versions_masks(copy, root, tmp_path,
                                                                                   run_trainer):
    """Not recognised, so not swapped; their ids are transformers'; the spans found by probing them train what the
    training version (with the same change) marks wherever the two render alike, and elsewhere what the rule finds on
    transformers' renderings."""
    family, change = COPIES[copy]
    template = change(original(family))
    assert template != original(family) and trainers_training_version(template) is None
    training = change(trainers_training_version(original(family)))
    directory = model_dir(root, tmp_path / "model", template)
    if family_of(family) == "Qwen3":
        rows = [{"messages": messages} for messages in conversations(family)]
    else:
        rows = [{"messages": m} if t is None else {"messages": m, "tools": t} for name, m, t in own_conversations(family)
                if "tool" not in name]
    ours, result = dump(run_trainer, tmp_path, directory, rows)
    assert "training template" not in result.stdout + result.stderr
    assert check_probed(directory, rows, ours, training) >= 1
    assert (result.stdout + result.stderr).count("the loss mask of such records comes from probing the template") == 1


def test_a_template_the_probe_cannot_trust_is_refused(root, tmp_path, run_trainer):
    """A Qwen3 fork that writes the last message again at the end: prefix by prefix cannot split it (as Qwen3), and
    probing sees the probe rendered twice; the record is refused with the clear error and its hint."""
    echo = original("Qwen3") + "{{- '<!-- ' + messages[-1].content + ' -->' }}"
    directory = model_dir(root, tmp_path / "model", echo)
    rows = [{"messages": conversations("Qwen3")[1]}]
    ours, result = dump(run_trainer, tmp_path, directory, rows)
    skipped = ours[0].get("skipped", "")
    assert "cannot find the span of assistant message" in skipped and "nor by probing" in skipped, ours
    assert "differ elsewhere than in that text's place" in skipped
    # With data.on_bad_record=error the message carries the hint, which names the recognised families.
    _, failed = dump(run_trainer, tmp_path, directory, rows, extra={"data": {"on_bad_record": "error"}}, check=False)
    assert failed.returncode != 0
    assert ("Qwen3, Qwen3-Instruct-2507, DeepSeek-R1-Distill, Gemma 3, Gemma 4, gpt-oss, Mistral v3"
            in failed.stderr), failed.stderr
    assert "data.train_on=all" in failed.stderr


# ---- templates TRL has no training version of: trainer's own -------------------------------------------------------

def own_conversations(name):
    """(name, messages, tools): the conversations above, and those where the template changes earlier turns (Gemma 4
    drops reasoning once a user message follows) or writes the tools' answers into the model's turn."""
    out = [(f"plain-{i}", messages, None) for i, messages in enumerate(conversations(name))]
    def call(i, city):
        return {"id": f"abcdefgh{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": city}}}
    if family_of(name) == "Gemma 4":
        out += [
            ("reasoning", [{"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "4", "reasoning_content": "add"},
                           {"role": "user", "content": "3+3?"},
                           {"role": "assistant", "content": "6", "reasoning_content": "again"}], None),
            ("tool-calls", [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Paris and Rome?"},
                            {"role": "assistant", "content": "", "reasoning_content": "two cities",
                             "tool_calls": [call(1, "Paris"), call(2, "Rome")]},
                            {"role": "tool", "tool_call_id": "abcdefgh1", "content": "sunny"},
                            {"role": "tool", "tool_call_id": "abcdefgh2", "content": "rain"},
                            {"role": "assistant", "content": "Paris sunny, Rome rain.", "reasoning_content": "compare"},
                            {"role": "user", "content": "Thanks."},
                            {"role": "assistant", "content": "You are welcome.", "reasoning_content": "polite"}],
             [WEATHER_TOOL]),
            ("last-tool-call", [{"role": "user", "content": "Weather in Paris?"},
                                {"role": "assistant", "content": "", "tool_calls": [call(1, "Paris")],
                                 "reasoning_content": "look it up"}], [WEATHER_TOOL]),
            ("tool-responses", [{"role": "user", "content": "Paris?"},
                                {"role": "assistant", "content": "", "tool_calls": [call(1, "Paris")],
                                 "tool_responses": [{"name": "get_weather", "response": {"sky": "sunny"}}]},
                                {"role": "assistant", "content": "Sunny."}], [WEATHER_TOOL]),
        ]
    else:
        out.append(("tool-calls", [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Weather in Paris?"},
                                   {"role": "assistant", "content": None, "tool_calls": [call(1, "Paris")]},
                                   {"role": "tool", "tool_call_id": "abcdefgh1", "name": "get_weather",
                                    "content": "sunny"},
                                   {"role": "assistant", "content": "Sunny."}], [WEATHER_TOOL]))
    return out


def render(template, messages, tools, add_generation_prompt=False):
    """transformers' rendering and {% generation %} spans (characters), merged where they touch."""
    texts, spans = render_jinja_template(conversations=[messages], chat_template=template, tools=tools,
                                         add_generation_prompt=add_generation_prompt, return_assistant_tokens_mask=True,
                                         bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    merged = []
    for start, end in sorted(spans[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        elif end > start:
            merged.append((start, end))
    return texts[0], merged


# What each conversation's marks cover, where the template writes more than the answers into the model's turn.
GEMMA_4_MARKS = {
    "tool-calls": ['<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
                   '<|tool_call>call:get_weather{city:<|"|>Rome<|"|>}<tool_call|><|tool_response>',
                   "Paris sunny, Rome rain.<turn|>\n", "{reasoning}You are welcome.<turn|>\n"],
    "last-tool-call": ['<|channel>thought\nlook it up\n<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>}'
                       '<tool_call|><|tool_response>'],
    "tool-responses": ['<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>',
                       "Sunny.<turn|>\n"],
}


@pytest.mark.parametrize("name", sorted(OWN))
def test_own_training_version_renders_the_original_and_marks_the_answers(name, root, tmp_path):
    family = family_of(name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir(root, tmp_path / "m", original(name)))
    with pytest.raises(ValueError, match="patching is not supported"):  # TRL has none
        get_training_chat_template(tokenizer)
    ours = trainers_training_version(original(name))
    assert ours is not None and "generation %}" in ours
    assert trainers_training_templates()[hashlib.sha256(original(name).encode()).hexdigest()][0] == family
    for case, messages, tools in own_conversations(name):
        text, spans = render(ours, messages, tools)
        assert text == render(original(name), messages, tools)[0], case  # only the marks differ
        prompt = messages[:-1]
        assert render(ours, prompt, tools, True)[0] == render(original(name), prompt, tools, True)[0], case
        marked = [text[a:b] for a, b in spans]
        if family == "Gemma 4" and case in GEMMA_4_MARKS:
            reasoning = "<|channel>thought\npolite\n<channel|>" if name.endswith("8995379") else ""
            assert marked == [m.replace("{reasoning}", reasoning) for m in GEMMA_4_MARKS[case]], case
            continue
        answers = [m for m in messages if m["role"] == "assistant"]
        assert len(marked) == len(answers), (case, marked)
        for m, span in zip(answers, marked):
            if m.get("tool_calls"):
                assert span.startswith("[TOOL_CALLS] [") and span.endswith("]" + END_OF_TURN[family]), (case, span)
            else:
                assert span.endswith(m["content"].strip() + END_OF_TURN[family]), (case, span)
        assert not any(m["content"] in "".join(marked) for m in messages if m["role"] == "user"), case


@pytest.mark.parametrize("name", sorted(OWN))
def test_own_sft_ids_and_labels_equal_transformers_masks(name, root, tmp_path, run_trainer):
    """The dump renders as the model's template, and trains the tokens return_assistant_tokens_mask places under
    trainer's training version's marks."""
    directory = model_dir(root, tmp_path / "model", original(name))
    cases = own_conversations(name)
    rows = [{"messages": m} if t is None else {"messages": m, "tools": t} for _, m, t in cases]
    ours, result = dump(run_trainer, tmp_path, directory, rows)
    assert f"is the {family_of(name)} template" in result.stdout + result.stderr
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    training = trainers_training_version(original(name))
    assert len(ours) == len(cases)
    for (case, messages, tools), got in zip(cases, ours):
        assert "skipped" not in got, (case, got)
        assert got["text"] == tokenizer.apply_chat_template(messages, tools=tools, tokenize=False), case
        expected = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                                 chat_template=training, return_assistant_tokens_mask=True)
        assert got["input_ids"] == list(expected["input_ids"]), case
        assert got["input_ids"] == list(tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                                                      return_dict=True)["input_ids"]), case
        mask = list(expected["assistant_masks"])
        assert 0 < sum(mask) < len(mask), case
        assert got["labels"] == [t if m else -100 for t, m in zip(got["input_ids"], mask)], case


def test_gemma_4_release_revision_needs_no_training_version(root, tmp_path, run_trainer):
    """google/gemma-4-E2B-it's release template (4742fe8, TRL's gemma4_v2.jinja) writes no reasoning and the tools'
    answers as turns of their own: it renders earlier turns the same whatever follows, so trainer splits it prefix by
    prefix, with no swap, on the conversations that need one for the later revisions."""
    template = (TRL_TEMPLATES / "gemma4_v2.jinja").read_text(encoding="utf-8")
    assert trainers_training_version(template) is None
    directory = model_dir(root, tmp_path / "model", template)
    cases = [case for case in own_conversations("Gemma 4 at 8995379") if case[0] != "tool-responses"]
    rows = [{"messages": m} if t is None else {"messages": m, "tools": t} for _, m, t in cases]
    ours, result = dump(run_trainer, tmp_path, directory, rows)
    assert "training template" not in result.stdout + result.stderr
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    for (case, messages, tools), got in zip(cases, ours):
        assert "skipped" not in got, (case, got)
        assert got["text"] == tokenizer.apply_chat_template(messages, tools=tools, tokenize=False), case
        assert 0 < sum(trained(got["labels"])) < len(got["labels"]), case
