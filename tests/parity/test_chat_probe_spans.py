"""Assistant spans found by probing the template (src/chat/chat_template.h, assistant_spans_by_probe), for templates
that rendering prefix by prefix cannot split, against the training versions and transformers' renderings.

(1) For every template trainer has a training version of today (TRL 1.16's qwen3, qwen3_instruct_2507,
    deepseek_r1_distill, gemma3 and gptoss with TRL's X_training.jinja; the Gemma 4 revisions and Mistral v3 with
    trainer's own), on the test conversations (multi-turn, system, tool calls, reasoning): where the training version
    renders what the model's template renders, the tokens the probe spans of the model's own template train are the
    tokens the training version's {% generation %} marks, as transformers' return_assistant_tokens_mask places them
    on the tiny Qwen2 tokenizer; the documented exceptions differ the documented way, and the documented refusals are
    refused. The spans come from trainer_chat_tool on the template's text: nothing here recognises its bytes.
(2) Qwen3's training version keeps the reasoning the original drops from earlier turns: there the probe spans are
    the training version's, less the <think> block the original does not render.
(3) For every template TRL ships with a training version, trainer's own, and the real templates of
    test_chat_templates.py, on every conversation: trainer's probe spans, byte for byte, are a Python version of the
    rule (probe_spans below) applied to transformers' renderings, and the two refuse alike; where rendering prefix by
    prefix finds spans too, they are the same.
"""
import os
import pathlib
import re

import pytest

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

from test_chat_templates import TEMPLATES as RENDERING_SUITE, ChatTool, WEATHER_TOOL  # noqa: E402
from test_chat_training_templates import FAMILIES, OWN, original, own_conversations, trainers_training_version  # noqa: E402

TRL_TEMPLATES = pathlib.Path(trl.__file__).parent / "chat_templates"
TRL_PAIRS = sorted(p.name[: -len("_training.jinja")] for p in TRL_TEMPLATES.glob("*_training.jinja"))
SPECIAL = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
PROBES = ("31415926", "27182818")  # as chat_template.cpp's
MODEL_WRITTEN = ("tool_calls", "reasoning_content", "reasoning", "thinking")

# transformers 5 passes a message's reasoning_content to templates as `thinking` too (gpt-oss reads that);
# trainer's rendering does not, so the two differ there (a rendering gap, not the spans').
RENDERED_DIFFERENTLY = {("gptoss", "reasoning-content")}

# Where the probe spans train other tokens than trainer's training version marks ("fewer": a subset of them,
# "more": a superset), and why. The rule is one for every template; these versions put their marks elsewhere.
HEADER = "TRL's version also marks the turn's header, which the generation prompt writes"
DIFFERENT_MARKS = {
    "deepseek_r1_distill": ("fewer", HEADER + " ('<｜Assistant｜>', '<｜tool▁outputs▁end｜>')"),
    "gptoss": ("fewer", HEADER + " ('<|start|>assistant'), and an earlier turn's whole '<|end|>' (the probe's "
                        "end-of-turn text is what the last turn's '<|return|>' and '<|end|>' share: '<|', one token "
                        "with gpt-oss's own tokenizer)"),
    ("trainer's Gemma 4 at 8995379", "own-tool-responses"): (
        "more", "the tools' answers an assistant message carries in tool_responses are trained as its template "
                "writes them into its turn (rendering prefix by prefix trains them too)"),
}
# Conversations the probe refuses (with the clear error) on these templates: it leaves a message's tool calls out
# where they come before its text, and then the template refuses the conversation or writes the tools' answers by
# them.
GEMMA_4 = [f"trainer's Gemma 4 at {commit}" for commit in ("b446025", "6b7e72c", "905e84b", "8995379")]
REFUSED = ({(name, case) for name in GEMMA_4 for case in ("tool-calls", "own-tool-calls", "own-last-tool-call")}
           | {(name, "own-tool-responses") for name in GEMMA_4[:3]}
           | {("trainer's Mistral v3", "tool-calls"), ("trainer's Mistral v3", "own-tool-calls"),
              ("gptoss", "tool-calls")})


def call(i, city):
    return {"id": f"abcdefgh{i}", "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


def conversations():
    """(name, messages, tools): multi-turn with and without reasoning in the content, with reasoning_content, a
    system message, and tool calls."""
    def think(reasoning, text):
        return f"<think>\n{reasoning}\n</think>\n\n{text}"
    return [
        ("one-turn", [{"role": "user", "content": "Soup?"}, {"role": "assistant", "content": "Boil water."}], None),
        ("multi-turn", [{"role": "user", "content": "Soup?"}, {"role": "assistant", "content": "Boil water."},
                        {"role": "user", "content": "Then?"},
                        {"role": "assistant", "content": "Add salt, crème fraîche 🍲."}], None),
        ("think-in-content", [{"role": "user", "content": "Soup?"},
                              {"role": "assistant", "content": think("Water first.", "Boil water.")},
                              {"role": "user", "content": "Then?"},
                              {"role": "assistant", "content": think("Salt last.", "Add salt.")}], None),
        ("reasoning-content", [{"role": "user", "content": "2+2?"},
                               {"role": "assistant", "content": "4", "reasoning_content": "add"},
                               {"role": "user", "content": "3+3?"},
                               {"role": "assistant", "content": "6", "reasoning_content": "again"}], None),
        ("system", [{"role": "system", "content": "You cook."}, {"role": "user", "content": "Bread?"},
                    {"role": "assistant", "content": "Knead it."}, {"role": "user", "content": "How long?"},
                    {"role": "assistant", "content": "Ten minutes."}], None),
        ("tool-calls", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                        {"role": "assistant", "content": "", "tool_calls": [call(1, "Paris")]},
                        {"role": "tool", "tool_call_id": "abcdefgh1", "name": "get_weather", "content": "sunny"},
                        {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks."},
                        {"role": "assistant", "content": "You are welcome."}], [WEATHER_TOOL]),
    ]


def templates(every_trl_template):
    """(name, the model's template, its training version): trainer's (TRL's file where TRL has one), or with
    every_trl_template every pair TRL ships and trainer's own."""
    names = TRL_PAIRS if every_trl_template else sorted(FAMILIES.values())
    out = [(name, (TRL_TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8"),
            (TRL_TEMPLATES / f"{name}_training.jinja").read_text(encoding="utf-8")) for name in names
           if (TRL_TEMPLATES / f"{name}.jinja").exists()]
    out += [(f"trainer's {name}", original(name), trainers_training_version(original(name))) for name in sorted(OWN)]
    if every_trl_template:  # and the rendering suite's real templates, with no training version
        out += [(name, text, None) for name, text in sorted(RENDERING_SUITE.items()) if name != "mistral-v0.3"]
    return out


KNOWN = templates(every_trl_template=False)
EVERY = templates(every_trl_template=True)


def render(template, messages, tools, add_generation_prompt=False):
    """transformers' rendering and {% generation %} spans (characters), or None where the template refuses."""
    try:
        texts, spans = render_jinja_template(conversations=[messages], chat_template=template, tools=tools,
                                             add_generation_prompt=add_generation_prompt,
                                             return_assistant_tokens_mask=True, **SPECIAL)
    except Exception:  # noqa: BLE001 - a template that refuses a conversation has nothing to compare
        return None
    return texts[0], spans[0]


def characters(text, byte_spans):
    data = text.encode()
    return [(len(data[:b].decode()), len(data[:e].decode())) for b, e in byte_spans]


def mask_of_spans(encoding, spans):
    """transformers' placement of spans on tokens (char_to_token of each span's first and last character)."""
    mask = [0] * len(encoding["input_ids"])
    for start, end in spans:
        if end <= start:
            continue
        first = encoding.char_to_token(0, start)
        if first is None:
            break
        last = encoding.char_to_token(0, end - 1)
        for t in range(first, last + 1 if last is not None else len(mask)):
            mask[t] = 1
    return mask


def opener_of(text, before, last_before):
    """What the template writes between the generation prompt and the content of an assistant message that ends the
    conversation: after the messages before it, or else in a one-turn conversation of probes."""
    prompt = text(before, True)
    if prompt is not None and last_before.startswith(prompt):
        return last_before[len(prompt):]
    one_turn = [{"role": "user", "content": PROBES[0]}, {"role": "assistant", "content": PROBES[1]}]
    asked, answered = text(one_turn[:1], True), text(one_turn)
    if asked is None or answered is None or not answered.startswith(asked) or PROBES[1] not in answered[len(asked):]:
        return ""
    return answered[len(asked):answered.index(PROBES[1], len(asked))]


def probe_spans(template, messages, tools):
    """probe_spans_of on transformers' renderings of `template`."""
    def text(part, add_generation_prompt=False):
        found = render(template, part, tools, add_generation_prompt)
        return None if found is None else found[0]
    return probe_spans_of(text, messages)


def probe_spans_of(text, messages):
    """The probe rule of chat_template.h (character spans), or None where trainer refuses; text(messages,
    add_generation_prompt=False) is a rendering, None where the template refuses. Message i is replaced by {its fields
    but content and what the model writes (its tool calls kept first), content: a probe}, rendered with two probes;
    the span is the real rendering between the text before and after the probe, widened at its start by what the
    template writes between the generation prompt and the content when the message ends the conversation (opener_of;
    if the text before the probe ends with it), and at its end by what follows the content then, as far as the whole
    rendering goes on with it."""
    full = text(messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        found = None
        for keep_tool_calls in ([True, False] if message.get("tool_calls") is not None else [False]):
            found = probe_span(text, full, messages, i, keep_tool_calls)
            if found is not None:
                break
        if found is None or (spans and found[0] < spans[-1][1]):
            return None
        spans.append(found)
    return spans


def probe_span(text, full, messages, i, keep_tool_calls):
    def slot(a, b):
        if a is None or b is None:
            return None
        before = len(os.path.commonprefix([a, b]))
        after = len(os.path.commonprefix([a[before:][::-1], b[before:][::-1]]))
        if a[before:len(a) - after] != PROBES[0] or b[before:len(b) - after] != PROBES[1]:
            return None
        return a[:before], a[len(a) - after:]

    probed = []
    for probe in PROBES:
        replaced = {key: value for key, value in messages[i].items()
                    if key not in MODEL_WRITTEN or (keep_tool_calls and key == "tool_calls")}
        replaced["content"] = probe
        probed.append(messages[:i] + [replaced] + messages[i + 1:])
    whole = slot(text(probed[0]), text(probed[1]))
    last = slot(text(probed[0][: i + 1]), text(probed[1][: i + 1]))
    if whole is None or last is None:
        return None
    (before, after), (last_before, last_after) = whole, last
    if keep_tool_calls:  # the calls come after the content
        without = dict(probed[0][i])
        del without["tool_calls"]
        rendered = text(messages[:i] + [without])
        if rendered is None or not rendered.startswith(last_before + PROBES[0]):
            return None
    opener = opener_of(text, messages[:i], last_before)
    start = len(before) - (len(opener) if before.endswith(opener) else 0)
    if not full.startswith(before[:start]) or not full.endswith(after) or len(full) - len(after) < start:
        return None
    content_end = len(full) - len(after)
    # the span's text is what the template writes for the message when the conversation ends with it
    alone = text(messages[: i + 1])
    message_from = min(len(os.path.commonprefix([alone, last_before])), len(last_before) - len(opener))
    if alone.find(full[start:content_end], max(message_from, 0)) < 0:
        return None
    return start, content_end + len(os.path.commonprefix([last_after, after]))


@pytest.fixture(scope="module")
def chat(built_tool):
    tool = ChatTool(built_tool("trainer_chat_tool", "TRAINER_CHAT_TOOL"))
    yield tool
    tool.close()


@pytest.fixture(scope="module")
def tokenizer(root):
    return transformers.AutoTokenizer.from_pretrained(root / "configs" / "models" / "tiny-qwen2")


def cases(name):
    found = conversations()
    if name.startswith("trainer's"):
        found = [(f"own-{case}", messages, tools) for case, messages, tools in own_conversations(name[len("trainer's "):])] + found
    return found


@pytest.mark.parametrize("name,template,training", KNOWN, ids=[t[0] for t in KNOWN])
def test_probe_masks_equal_the_training_versions(chat, tokenizer, name, template, training):
    compared = 0
    for case, messages, tools in cases(name):
        if (name, case) in RENDERED_DIFFERENTLY:
            continue
        ours_rendered = render(template, messages, tools)
        theirs = render(training, messages, tools)
        if ours_rendered is None or theirs is None or ours_rendered[0] != theirs[0]:
            continue  # refused by the template, or the training version renders other text (test below)
        text = ours_rendered[0]
        got = chat(template=template, messages=messages, tools=tools, special_tokens=SPECIAL, probe_spans=True)
        assert got.get("text") == text, (case, got)
        if (name, case) in REFUSED:
            assert "by probing" in got["probe_spans"]["error"], (case, got["probe_spans"])
            continue
        assert isinstance(got["probe_spans"], list), (case, got["probe_spans"])
        encoding = tokenizer(text, add_special_tokens=False)
        ours = mask_of_spans(encoding, characters(text, got["probe_spans"]))
        marked = mask_of_spans(encoding, theirs[1])
        different = DIFFERENT_MARKS.get(name) or DIFFERENT_MARKS.get((name, case))
        if different is None:
            assert ours == marked, (case, [text[a:b] for a, b in characters(text, got["probe_spans"])],
                                    [text[a:b] for a, b in theirs[1]])
        else:
            fewer, more = (ours, marked) if different[0] == "fewer" else (marked, ours)
            assert fewer != more and all(m >= f for f, m in zip(fewer, more)), (case, different)
        compared += 1
    assert compared >= 1


def test_qwen3_probe_spans_are_the_training_versions_less_the_reasoning_the_original_drops(chat):
    """Where Qwen3's training version renders every turn's <think> block and the original drops the earlier turns',
    the probe spans of the original are the training version's marks without that block: what the original renders
    is trained, what it drops is not; the last turn's reasoning is trained."""
    template = (TRL_TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8")
    training = (TRL_TEMPLATES / "qwen3_training.jinja").read_text(encoding="utf-8")
    differed = 0
    for case, messages, tools in conversations():
        text, _ = render(template, messages, tools)
        training_text, marks = render(training, messages, tools)
        if text == training_text:
            continue
        got = chat(template=template, messages=messages, tools=tools, special_tokens=SPECIAL, probe_spans=True)
        ours = [text[a:b] for a, b in characters(text, got["probe_spans"])]
        theirs = [training_text[a:b] for a, b in marks]
        assert len(ours) == len(theirs), (case, ours, theirs)
        for k, (mine, marked) in enumerate(zip(ours, theirs)):
            if k == len(ours) - 1:
                assert mine == marked, case  # the last turn keeps its reasoning in both
            else:
                assert marked.endswith(mine) and re.fullmatch(r"<think>\n.*\n</think>\n\n", marked[: -len(mine)],
                                                              re.S), (case, mine, marked)
        differed += 1
    assert differed >= 3


@pytest.mark.parametrize("name,template,training", EVERY, ids=[t[0] for t in EVERY])
def test_probe_spans_equal_the_rule_on_transformers_renderings(chat, name, template, training):
    """trainer's probe spans, byte for byte, are the rule applied to transformers' renderings; both refuse alike."""
    compared = 0
    for case, messages, tools in cases(name):
        if (name, case) in RENDERED_DIFFERENTLY:
            continue
        rendered = render(template, messages, tools)
        if rendered is None:
            continue
        got = chat(template=template, messages=messages, tools=tools, special_tokens=SPECIAL, probe_spans=True,
                   prefix_spans=True)
        assert got.get("text") == rendered[0], (case, got)
        expected = probe_spans(template, messages, tools)
        if expected is None:
            assert "by probing" in got["probe_spans"]["error"], (case, got["probe_spans"])
        else:
            assert characters(rendered[0], got["probe_spans"]) == expected, case
            if isinstance(got["prefix_spans"], list):  # where both methods find spans, they find the same
                assert got["probe_spans"] == got["prefix_spans"], case
        compared += 1
    if compared == 0:
        pytest.skip(f"{name} renders none of the test conversations (it wants images or other content parts)")
