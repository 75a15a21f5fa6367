"""Chat templates rendered by trainer's Jinja interpreter (build/trainer_chat_tool) against transformers' own
rendering, byte for byte, on real chat templates and many conversations; {% generation %} spans against
transformers' generation indices; prefix-by-prefix assistant spans; and the errors (syntax, raise_exception, limits).
The tool is found beside TRAINER_BINARY (or at TRAINER_CHAT_TOOL)."""
import datetime
import json
import pathlib
import subprocess

import pytest

transformers = pytest.importorskip("transformers")
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402


# ---- The templates: the chat_template strings of the models' tokenizer_config.json files ------------------------

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen2.5-Instruct's template, as make_tiny_models.py writes it beside the tiny Qwen2 (the committed copy).
QWEN25 = (pathlib.Path(__file__).resolve().parents[2] / "configs" / "models" / "tiny-qwen2" /
          "chat_template.jinja").read_text(encoding="utf-8")

LLAMA31 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

MISTRAL_V03 = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

ZEPHYR = """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\n'  + message['content'] + eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""

LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)

# Templates that mark the assistant's text with {% generation %} (as TRL and transformers' tests write them).
CHATML_GENERATION = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}"
    "{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA32_GENERATION = LLAMA31.replace(
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}",
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "        {%- if message['role'] == 'assistant' %}\n"
    "            {%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}\n"
    "        {%- else %}\n"
    "            {{- message['content'] | trim + '<|eot_id|>' }}\n"
    "        {%- endif %}",
)
assert LLAMA32_GENERATION != LLAMA31

TEMPLATES = {
    "chatml": CHATML,
    "qwen2.5": QWEN25,
    "llama3.1": LLAMA31,
    "mistral-v0.3": MISTRAL_V03,
    "gemma": GEMMA,
    "phi3": PHI3,
    "zephyr": ZEPHYR,
    "llama2": LLAMA2,
    "chatml-generation": CHATML_GENERATION,
    "llama3.2-generation": LLAMA32_GENERATION,
}
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}

# ---- Conversations ----------------------------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city, \"quoted\" and ünïcødé.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7.5},
            },
            "required": ["city"],
        },
        "return": {"type": "string"},
    },
}
SEARCH_TOOL = {"type": "function", "function": {"name": "search", "description": "Search the web",
                                                 "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}

ALTERNATING = {
    "single": [{"role": "user", "content": "Hello!"}],
    "one-turn": [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi, how can I help?"}],
    "multi-turn": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "  4  "},
        {"role": "user", "content": "And 3+3?\nThink step by step."},
        {"role": "assistant", "content": "6.\n\nBecause 3+3=6."},
        {"role": "user", "content": "Thanks"},
    ],
    "unicode": [
        {"role": "user", "content": "Ça va? 日本語で答えて 🙂 \"quotes\" and 'single' \\ backslash\ttab"},
        {"role": "assistant", "content": "はい、元気です 🎉 — ¿y tú?"},
    ],
    "empty-content": [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
    "unicode-whitespace": [
        {"role": "user", "content": "\u00a0\u3000 padded\u2003text \u00a0\n"},
        {"role": "assistant", "content": "\u2028answer\u00a0"},
    ],
    "template-like-content": [
        {"role": "user", "content": "{{ not a template }} {% if %} <|im_end|> [INST]"},
        {"role": "assistant", "content": "{# still text #}"},
    ],
}
WITH_SYSTEM = {
    "system+" + name: [{"role": "system", "content": "You are a terse assistant.\n"}] + messages
    for name, messages in ALTERNATING.items()
}
TOOL_CALL_ID = "call12345"
TOOL_CONVERSATION = [
    {"role": "system", "content": "You can use tools."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": TOOL_CALL_ID, "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
    {"role": "tool", "tool_call_id": TOOL_CALL_ID, "name": "get_weather", "content": "{\"temperature\": 21.5}"},
    {"role": "assistant", "content": "It is 21.5 °C in Paris."},
    {"role": "user", "content": "Thanks!"},
]

SUPPORTS_SYSTEM = {"chatml", "qwen2.5", "llama3.1", "mistral-v0.3", "phi3", "zephyr", "llama2", "chatml-generation",
                   "llama3.2-generation"}
SUPPORTS_TOOLS = {"qwen2.5", "llama3.1", "mistral-v0.3", "llama3.2-generation"}


def cases():
    out = []
    for template in TEMPLATES:
        conversations = dict(ALTERNATING)
        if template in SUPPORTS_SYSTEM:
            conversations.update(WITH_SYSTEM)
        for conversation, messages in conversations.items():
            for add_generation_prompt in (False, True):
                out.append((template, conversation, messages, None, add_generation_prompt))
        if template in SUPPORTS_TOOLS:
            for add_generation_prompt in (False, True):
                out.append((template, "tools", ALTERNATING["multi-turn"], [WEATHER_TOOL, SEARCH_TOOL],
                            add_generation_prompt))
                tool_messages = TOOL_CONVERSATION
                if template.startswith("llama3"):  # Llama takes a tool call's assistant turn without content
                    tool_messages = [m for m in TOOL_CONVERSATION]
                out.append((template, "tool-calls", tool_messages, [WEATHER_TOOL], add_generation_prompt))
    # Conversations the templates refuse with raise_exception: we must refuse them with the same message.
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    two_calls = [dict(TOOL_CONVERSATION[2], tool_calls=TOOL_CONVERSATION[2]["tool_calls"] * 2)]
    out += [("gemma", "refused-system", WITH_SYSTEM["system+one-turn"], None, False),
            ("gemma", "refused-two-users", two_users, None, True),
            ("llama2", "refused-two-users", two_users, None, True),
            ("mistral-v0.3", "refused-two-users", two_users, None, False),
            ("mistral-v0.3", "refused-role", [{"role": "critic", "content": "x"}], None, False),
            ("llama3.1", "refused-two-tool-calls", TOOL_CONVERSATION[:2] + two_calls, [WEATHER_TOOL], False)]
    return out


# ---- The tool ---------------------------------------------------------------------------------------------------


class ChatTool:
    """One trainer_chat_tool process: one JSON request a line, one JSON answer a line."""

    def __init__(self, path):
        self.process = subprocess.Popen([str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        encoding="utf-8")

    def __call__(self, **request):
        self.process.stdin.write(json.dumps(request, ensure_ascii=False) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, "trainer_chat_tool exited"
        return json.loads(line)

    def close(self):
        self.process.stdin.close()
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def chat(built_tool):
    tool = ChatTool(built_tool("trainer_chat_tool", "TRAINER_CHAT_TOOL"))
    yield tool
    tool.close()


def reference(template, messages, tools=None, add_generation_prompt=False, **kwargs):
    """transformers' rendering and generation spans, the spans as UTF-8 byte offsets like the tool's."""
    try:
        rendered, indices = render_jinja_template(
            conversations=[messages], tools=tools, chat_template=template, return_assistant_tokens_mask=True,
            add_generation_prompt=add_generation_prompt, **kwargs)
    except Exception as e:  # noqa: BLE001 - the template's own exception is what is compared
        return {"error": str(e)}
    text = rendered[0]
    spans = [[len(text[:b].encode()), len(text[:e].encode())] for b, e in indices[0]]
    return {"text": text, "generation_spans": spans}


def ours(chat, template, messages, tools=None, add_generation_prompt=False, extra=None, **request):
    return chat(template=template, messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                special_tokens=SPECIAL, extra=extra or {}, **request)


CASES = cases()


@pytest.mark.parametrize("template,conversation,messages,tools,add_generation_prompt", CASES,
                         ids=[f"{c[0]}-{c[1]}-{'gen' if c[4] else 'nogen'}" for c in CASES])
def test_rendering_matches_transformers(chat, template, conversation, messages, tools, add_generation_prompt):
    extra = {"date_string": "26 Jul 2024"} if template.startswith("llama3") else {}
    expected = reference(TEMPLATES[template], messages, tools, add_generation_prompt, **SPECIAL, **extra)
    got = ours(chat, TEMPLATES[template], messages, tools, add_generation_prompt, extra)
    if "error" in expected:
        # The template refused the conversation (raise_exception): so must we, with the same message.
        assert "error" in got, f"transformers raised {expected['error']!r}, we rendered {got.get('text')!r}"
        assert got["kind"] == "raised" and got["message"] == expected["error"]
        return
    assert "error" not in got, got
    assert got["text"] == expected["text"]
    assert got["generation_spans"] == expected["generation_spans"]


def test_suite_covers_what_it_claims():
    # The cases must exercise tool calls, generation spans and refusals, or the parity above proves less than it says.
    with_spans = [c for c in CASES if "generation" in c[0] and c[1] != "single"]
    refused = [c for c in CASES if c[1].startswith("refused")]
    assert len(CASES) > 200 and with_spans and refused
    for template, _, messages, tools, add_generation_prompt in refused:
        assert "error" in reference(TEMPLATES[template], messages, tools, add_generation_prompt, **SPECIAL)
    assert any(c[1] == "tool-calls" for c in CASES)
    assert reference(GEMMA, WITH_SYSTEM["system+single"]).get("error") == "System role not supported"


def test_llama31_date_from_strftime_now(chat):
    # Without date_string the template asks strftime_now for today's date, in local time as Python's datetime.now().
    messages = ALTERNATING["one-turn"]
    expected = reference(LLAMA31, messages, None, False, **SPECIAL)
    got = ours(chat, LLAMA31, messages)
    assert datetime.datetime.now().strftime("%d %b %Y") in got["text"]
    assert got["text"] == expected["text"]


def test_apply_chat_template_of_a_local_tokenizer(chat):
    # The same rendering through a tokenizer's apply_chat_template (special tokens from the tokenizer itself).
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "a": 3}
    model = tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>")
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(model), bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    for name in ("llama2", "zephyr", "mistral-v0.3", "qwen2.5"):
        tok.chat_template = TEMPLATES[name]
        for messages in (ALTERNATING["multi-turn"], WITH_SYSTEM["system+one-turn"]):
            for add_generation_prompt in (False, True):
                expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
                got = chat(template=TEMPLATES[name], messages=messages, add_generation_prompt=add_generation_prompt,
                           bos_token="<s>", eos_token="</s>", special_tokens={"unk_token": "<unk>"})
                assert got.get("text") == expected, (name, got)


# ---- Prefix-by-prefix spans (templates without {% generation %}) ------------------------------------------------


@pytest.mark.parametrize("template", ["chatml", "qwen2.5", "gemma", "phi3", "zephyr", "llama3.1"])
def test_prefix_spans_cover_each_assistant_turn(chat, template):
    messages = ALTERNATING["multi-turn"] + [{"role": "assistant", "content": "You're welcome."}]
    got = ours(chat, TEMPLATES[template], messages, extra={"date_string": "26 Jul 2024"}, prefix_spans=True)
    spans = got["prefix_spans"]
    assert isinstance(spans, list), spans
    assistants = [m for m in messages if m["role"] == "assistant"]
    assert len(spans) == len(assistants)
    text = got["text"].encode()
    for (begin, end), message in zip(spans, assistants):
        piece = text[begin:end].decode()
        assert message["content"].strip() in piece
        # Nothing of the prompt: no user text inside an assistant span.
        assert not any(u["content"] in piece for u in messages if u["role"] == "user" and u["content"])


def test_prefix_spans_equal_generation_spans(chat):
    # Where a template marks the assistant's text, finding it by prefixes gives the same spans.
    messages = ALTERNATING["multi-turn"] + [{"role": "assistant", "content": "You're welcome."}]
    got = ours(chat, CHATML_GENERATION, messages, prefix_spans=True)
    # The prefix method also takes the "\n" the template writes after the end-of-turn marker.
    text = got["text"].encode()
    assert len(got["prefix_spans"]) == len(got["generation_spans"]) == 3
    for (pb, pe), (gb, ge) in zip(got["prefix_spans"], got["generation_spans"]):
        assert pb == gb and text[ge:pe] in (b"", b"\n")


def test_prefix_spans_error_when_renderings_are_not_prefixes(chat):
    # A template that renders the last turn differently (here: marks it) cannot be split by prefixes.
    template = ("{% for m in messages %}{% if loop.last %}[LAST]{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    messages = ALTERNATING["one-turn"] + [{"role": "user", "content": "more"}]
    got = ours(chat, template, messages, prefix_spans=True)
    assert "text" in got
    error = got["prefix_spans"]["error"]
    assert "assistant message 1" in error and "prefix" in error
    assert "data.train_on=all" in got["prefix_spans"]["hint"] and "{% generation %}" in got["prefix_spans"]["hint"]


# ---- Jinja features one by one, against jinja2 as transformers configures it ------------------------------------

SNIPPETS = [
    "{{ 'a' ~ 1 ~ none ~ true }}|{{ 1 + 2 * 3 - 4 / 2 }}|{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 10 }}",
    "{{ 0.1 + 0.2 }} {{ 1e20 }} {{ 1.5e-7 }} {{ 3.0 }} {{ 10 / 4 }} {{ 1/3 }} {{ 123456789.123 }}",
    "{{ [1, 'a', none, true, 2.5, {'k': [1]}] }} {{ (1,) }} {{ (1, 2) }} {{ {'a': 'it\\'s'} }}",
    "{{ 'héllo wörld'[::-1] }}|{{ 'héllo'[1:3] }}|{{ [1,2,3,4,5][1:] }}|{{ [1,2,3,4,5][-2:] }}|{{ [1,2,3,4,5][::2] }}|{{ 'abc'[-1] }}",
    "{{ '  x y  '.strip() }}|{{ 'xxhixx'.strip('x') }}|{{ ' a '.lstrip() }}|{{ ' a '.rstrip() }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}",
    "{{ 'Hello'.startswith('He') }} {{ 'Hello'.endswith(('x', 'lo')) }} {{ 'hello world'.title() }} {{ 'aBc'.upper() }} {{ 'aBc'.lower() }}",
    "{{ 'a-b-c'.replace('-', '+') }} {{ 'a-b-c'.replace('-', '', 1) }} {{ '{} and {}'.format(1, 'two') }}",
    "{% set d = {'b': 1, 'a': [2, 3]} %}{{ d.items() | list }} {{ d.keys() | list }} {{ d.values() | list }} {{ d.get('a') }} {{ d.get('z', 'dflt') }} {{ d.get('z') }}",
    "{% for k, v in {'x': 1, 'y': 2} | items %}{{ k }}={{ v }}{% if not loop.last %},{% endif %}{% endfor %}",
    "{% for x in [3, 1, 2] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.previtem }}{{ loop.nextitem }}{{ loop.cycle('a', 'b') }};{% endfor %}",
    "{% for x in [] %}no{% else %}empty{% endfor %}{% for x in range(10) if x is odd %}{{ x }}{{ loop.length }}{% endfor %}",
    "{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}{% endif %}{{ x }}{% endfor %}",
    "{% for x in range(2, 11, 3) %}{{ x }}{% endfor %}{% for x in range(5, 0, -2) %}{{ x }}{% endfor %}",
    "{% set ns = namespace(n=0, found=false) %}{% for x in range(4) %}{% set ns.n = ns.n + x %}{% set y = x %}{% endfor %}{{ ns.n }} {{ y is defined }} {{ ns.found }}",
    "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t = (1, 2) %}{{ t[0] + t[1] }}",
    "{% set block %}  inner {{ 1 + 1 }}\n{% endset %}[{{ block }}]{% set up | upper %}shout{% endset %}{{ up }}",
    "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('Ann') }} {{ greet('Bob', '?') }} {{ greet(name='Cy', punct='.') }}",
    "{% filter upper %}shout {{ 'this' }}{% endfilter %}|{% filter trim %}   padded   {% endfilter %}|",
    "{{ x is defined }} {{ x is undefined }} {{ none is none }} {{ 'a' is string }} {{ {} is mapping }} {{ [] is iterable }} {{ 'a' is sequence }} {{ 1 is number }} {{ 1 is integer }} {{ 1.5 is float }} {{ true is boolean }} {{ true is true }} {{ false is false }} {{ 1 is boolean }}",
    "{{ 3 is equalto 3 }} {{ 3 is eq(4) }} {{ 'a' is in ['a'] }} {{ 4 is divisibleby 2 }} {{ 3 is odd }} {{ 'ab' is lower }} {{ x is not defined }} {{ 2 is ne 3 }}",
    "{{ 'b' in 'abc' }} {{ 'z' not in 'abc' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ not true }} {{ true and 'x' }} {{ false or 'y' }} {{ 1 < 2 < 3 }} {{ [1, 2] == [1, 2] }} {{ 1 == 1.0 }}",
    "{{ 'yes' if 1 > 2 else 'no' }} {{ 'bare' if false }}|{{ [1, 2] + [3] }} {{ 'ab' * 3 }} {{ -(3) }} {{ +4 }}",
    "{{ [3, 1, 2] | sort }} {{ [3, 1, 2] | sort(reverse=true) }} {{ ['b', 'A', 'c'] | sort }} {{ [1, 2, 2, 'a', 'A'] | unique | list }} {{ [1, 2, 3] | reverse | list }} {{ [1, 2, 3] | first }} {{ [1, 2, 3] | last }} {{ [4, 5] | sum }} {{ [4, 5] | min }} {{ [4, 5] | max }}",
    "{{ users | selectattr('active') | map(attribute='name') | join(', ') }}|{{ users | rejectattr('active') | map(attribute='name') | list }}|{{ users | selectattr('role', 'equalto', 'admin') | list | length }}|{{ users | map(attribute='info.age') | list }}|{{ users | join(', ', attribute='name') }}",
    "{{ [1, 2, 3] | select('odd') | list }} {{ [1, 2, 3] | reject('odd') | list }} {{ ['a', 'b'] | map('upper') | list }} {{ [none, 1, 0] | select | list }}",
    "{{ missing | default('dflt') }} {{ '' | default('dflt') }} {{ '' | default('dflt', true) }} {{ none | default('x') }} {{ missing | d('d') }}",
    "{{ 'hello world' | title }} {{ 'hELLO' | capitalize }} {{ 'ab' | upper }} {{ 'AB' | lower }} {{ '  t  ' | trim }} {{ 'xxtxx' | trim('x') }} {{ 42 | string }} {{ 'abc' | length }} {{ [1, 2] | count }} {{ 'a<b' | safe }}",
    "{{ '3' | int + 1 }} {{ '3.7' | float }} {{ 'x' | int }} {{ 3.7 | int }} {{ -3 | abs }} {{ 2.5 | round }} {{ 2.567 | round(2) }} {{ 2.5 | round(0, 'floor') }} {{ 7 | float }}",
    "{{ 'a\nb\n\nc' | indent(2) }}|{{ 'a\nb' | indent(4, true) }}|{{ 'a\nb\n' | indent }}",
    "{{ data | tojson }}|{{ data | tojson(indent=2) }}|{{ 'é\"\\\\\n\t\x01' | tojson }}|{{ [] | tojson }} {{ {} | tojson(indent=2) }}|{{ data | tojson(sort_keys=true) }}|{{ 1.0 | tojson }} {{ none | tojson }}",
    "{{ data.nested.list[1] }} {{ data['nested']['list'][-1] }} {{ data.missing }} {{ data.missing is defined }} {{ data.nested.list | length }}",
    "{{ raw_ok }}{% raw %}{{ not rendered }} {% if %}{% endraw %}",
    "  {% if true %}\n    indented\n  {% endif %}\n{# comment #}\nafter\n{%- if true -%}\n   stripped   \n{%- endif -%}\n   end\n{%+ if true %}kept{% endif %}",
    "{{ '\\u00e9\\x41\\n' }}{{ \"double 'quoted'\" }}{{ 'adjacent' 'strings' }}",
    "{% set x = 1 %}{% if x == 1 %}{% set x = 2 %}{% endif %}{{ x }}{% for i in [1] %}{% set x = 3 %}{% endfor %}{{ x }}",
    "{{ dict(a=1, b=2) }} {{ namespace(a=1).a }} {{ range(3) | list }} {{ [1, 2, 3] | map('string') | join }}",
    "{% for a in [[1, 2], [3, 4]] %}{% for b in a %}{{ loop.index }}{{ b }}{% endfor %}{{ loop.index }}{% endfor %}",
    "{% macro rec(n) %}{% if n > 0 %}{{ n }}{{ rec(n - 1) }}{% endif %}{% endmacro %}{{ rec(4) }}",
    "{{ s.strip() }}|{{ s | trim }}|{{ s.split() }}|{{ s.split(none, 1) }}|{{ s.lstrip() }}|{{ 'éaé'.strip('é') }}|{{ 'xéx'.strip('x') }}",
    "{{ ['\\u00a0', '\\u200b', 'é日🙂', '\\x7f\\x01', 'it\\'s', 'say \"hi\"', 'both \\' \"'] }}",
    # Constructs of newer templates (Qwen3's reverse scan for the last user query, reasoning split).
    "{% set ns = namespace(multi_step_tool=true, last_query_index=users|length - 1) %}{% for u in users[::-1] %}{% set index = (users|length - 1) - loop.index0 %}{% if ns.multi_step_tool and u.role == 'user' %}{% set ns.multi_step_tool = false %}{% set ns.last_query_index = index %}{% endif %}{% endfor %}{{ ns.last_query_index }}",
    "{% set c = '<think>\\nwhy\\n</think>\\n\\nanswer' %}{{ c.split('</think>')[-1].lstrip('\\n') }}|{{ c.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') }}|{{ (c is string) and c.startswith('<think>') }}",
    "{{ 'abc' | list }} {{ {'x': 1} | list }} {{ 'a b c' | wordcount }} {{ [[1, 'b'], [0, 'a']] | sort | first }}",
]


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_jinja_snippet_matches_jinja2(chat, index):
    template = SNIPPETS[index]
    variables = {
        "users": [{"name": "ann", "active": True, "role": "admin", "info": {"age": 31}},
                  {"name": "bob", "active": False, "role": "user", "info": {"age": 42}}],
        "data": {"b": "é", "a": [1, 2.5, None, True], "nested": {"list": [1, 2, 3]}, "empty": {}},
        "raw_ok": "r",
        "s": "\u00a0\u3000 a\u2003b \tc\u00a0\n",
    }
    expected = reference(template, [], None, False, **variables)
    got = ours(chat, template, [], extra=variables)
    assert "error" not in expected, expected
    assert got.get("text") == expected["text"], got


# ---- Errors -----------------------------------------------------------------------------------------------------


def test_syntax_error_names_line_and_column(chat):
    template = "{% for m in messages %}\n{{ m.content }}\n{% if m.role == %}x{% endif %}\n{% endfor %}"
    got = ours(chat, template, ALTERNATING["single"])
    assert got["kind"] == "syntax"
    assert (got["line"], got["column"]) == (3, 17)
    assert "line 3, column 17" in got["error"]


@pytest.mark.parametrize("template,line", [
    ("{% for m in messages %}{{ m }}", 1),            # missing endfor
    ("text\n{% if x %}a{% else %}b{% elif y %}{% endif %}", 2),
    ("{{ 'unterminated }}", 1),
    ("ok\n\n  {{ 1 + }}", 3),
    ("{% unknown_tag %}", 1),
    ("{% break %}", 1),                               # break outside a loop
    ("{{ a.b( }}", 1),
    ("a\n{{ x | nosuchfilter }}", 2),                 # unknown filter: refused when parsed, not when rendered
    ("a\n\n{{ m is nosuchtest }}", 3),
])
def test_syntax_errors_are_reported_like_jinja2(chat, template, line):
    import jinja2

    # jinja2 refuses each template too (a break outside a loop as Python's SyntaxError, not a TemplateSyntaxError).
    with pytest.raises(Exception) as info:
        reference_compile(template)
    got = ours(chat, template, [])
    assert got["kind"] == "syntax", got
    assert got["line"] == line
    if isinstance(info.value, jinja2.exceptions.TemplateSyntaxError) and not template.startswith("{% for"):
        assert info.value.lineno == line  # jinja2 reports an unclosed block at the template's end; we at its start


def test_every_jinja2_filter_and_test_name_parses(chat):
    # Filters and tests are resolved when the template is parsed: every name jinja2 has must be known (those we do
    # not implement are an error only when a render reaches them), or a template transformers loads would not load.
    import jinja2.defaults

    names = [f"{{{{ x | {name} }}}}" for name in jinja2.defaults.DEFAULT_FILTERS]
    names += [f"{{{{ x is {name} }}}}" for name in jinja2.defaults.DEFAULT_TESTS if name.isidentifier()]
    for expression in names:
        template = "{% if false %}" + expression + "{% endif %}ok"
        assert reference(template, [])["text"] == "ok"
        got = ours(chat, template, [])
        assert got.get("text") == "ok", (expression, got)


def reference_compile(template):
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(template)


def test_raise_exception_carries_the_template_message(chat):
    got = ours(chat, GEMMA, WITH_SYSTEM["system+single"])
    assert got["kind"] == "raised"
    assert got["message"] == "System role not supported"
    assert "System role not supported" in got["error"]


def test_runaway_loop_is_stopped(chat):
    template = "{% for i in range(1000000) %}{% for j in range(1000000) %}{% endfor %}{% endfor %}"
    got = ours(chat, template, [], max_steps=100000)
    assert got["kind"] == "limit" and "steps" in got["error"]


def test_runaway_output_is_stopped(chat):
    template = "{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{{ ns.s }}{% endfor %}"
    got = ours(chat, template, [], max_output_bytes=1 << 20)
    assert got["kind"] == "limit" and "bytes" in got["error"]


def test_runaway_recursion_is_stopped(chat):
    got = ours(chat, "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", [])
    assert got["kind"] == "limit" and "nested" in got["error"]


def test_no_host_access(chat):
    # What reaches Python internals in an unsandboxed jinja2 is undefined here, and an error at worst.
    for template in ["{{ ''.__class__ }}", "{{ messages.__len__ }}", "{{ range.__globals__ }}", "{{ self }}",
                     "{{ lipsum }}", "{{ config }}", "{{ cycler }}"]:
        got = ours(chat, template, [])
        assert got.get("text", "") == "", (template, got)


def test_undefined_behaves_as_jinja2_default(chat):
    template = "[{{ nope }}]{% if nope %}t{% else %}f{% endif %}{{ nope is defined }}{% for x in nope %}x{% endfor %}{{ nope | length }}"
    expected = reference(template, [])
    assert ours(chat, template, [])["text"] == expected["text"]
    got = ours(chat, "{{ nope.attr }}", [])
    assert got["kind"] == "render" and "'nope' is undefined" in got["error"]


def test_lists_are_immutable(chat):
    got = ours(chat, "{% set l = [1] %}{{ l.append(2) }}", [])
    assert got["kind"] == "render" and "immutable" in got["error"]


# ---- The template of a model directory, found as transformers finds it ------------------------------------------


def save_tokenizer(directory):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "a": 3}
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, "<unk>")),
                                  bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.save_pretrained(directory)
    for leftover in ("chat_template.jinja",):
        (directory / leftover).unlink(missing_ok=True)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    # Special tokens as AddedToken objects, as older tokenizer_config.json files write them.
    config["bos_token"] = {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False,
                           "rstrip": False, "single_word": False}
    config["eos_token"] = "</s>"
    return config_path, config


@pytest.mark.parametrize("layout", ["config-string", "config-list-default", "config-list-tool-use", "jinja-file"])
def test_model_directory_template(chat, tmp_path, layout):
    from transformers import AutoTokenizer

    config_path, config = save_tokenizer(tmp_path)
    if layout == "config-string":
        config["chat_template"] = ZEPHYR
    elif layout.startswith("config-list"):
        config["chat_template"] = [{"name": "default", "template": LLAMA2}, {"name": "tool_use", "template": QWEN25}]
    else:
        config["chat_template"] = LLAMA2  # the file beside it takes priority
        (tmp_path / "chat_template.jinja").write_text(ZEPHYR)
    config_path.write_text(json.dumps(config))
    tools = [WEATHER_TOOL] if layout == "config-list-tool-use" else None
    messages = WITH_SYSTEM["system+multi-turn"]

    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    expected = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    got = chat(model_dir=str(tmp_path), messages=messages, tools=tools, add_generation_prompt=True)
    assert got.get("text") == expected, got
    assert got["origin"].endswith("chat_template.jinja" if layout == "jinja-file" else "(chat_template)")


def test_model_directory_without_template(chat, tmp_path):
    config_path, config = save_tokenizer(tmp_path)
    config_path.write_text(json.dumps(config))
    got = chat(model_dir=str(tmp_path), messages=[])
    assert "no chat template" in got["error"] and str(tmp_path) in got["error"]
