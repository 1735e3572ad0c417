"""Chat templates: our renderer against transformers' own apply_chat_template(tokenize=False), on the real
Qwen2.5 (Coder-)Instruct template and on templates that use bos/eos tokens, raise_exception, tojson,
strftime_now, loop controls, namespace and {% generation %}; and the error messages."""
import pytest

from llaisys.chat import _compile, render_chat_template

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# tokenizer_config.json "chat_template" of Qwen/Qwen2.5-Coder-*-Instruct (the standard Qwen2.5 template).
QWEN25_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Llama-2-chat: bos/eos tokens, strip(), and raise_exception when roles do not alternate.
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

# Exercises the rest of what transformers provides: tojson options, strftime_now, namespace, loop controls,
# {% generation %}, reasoning fields, extra keyword arguments, trim_blocks/lstrip_blocks whitespace rules.
FEATURES_TEMPLATE = """{%- set ns = namespace(turns=0) -%}
{{ bos_token }}[{{ strftime_now("%Y") }}]
{% if tools %}
  TOOLS {{ tools | tojson(indent=2, sort_keys=true) }}
  compact {{ tools | tojson(separators=(',', ':')) }}
{% endif %}
{% for m in messages %}
    {% if m.role == 'system' %}{% continue %}{% endif %}
    {% set ns.turns = ns.turns + 1 %}
<{{ m.role }}>{% if m.role == 'assistant' %}
{% if m.reasoning_content is defined %}<think>{{ m.thinking }}</think>{% endif %}
{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content | trim }}{% endif %}</{{ m.role }}>
    {% if ns.turns >= 5 %}{% break %}{% endif %}
{% endfor %}
{% if enable_thinking is defined and not enable_thinking %}(no thinking){% endif %}
{% if add_generation_prompt %}<assistant>{% endif %}"""

TEMPLATES = {"qwen2.5": QWEN25_TEMPLATE, "llama2": LLAMA2_TEMPLATE, "features": FEATURES_TEMPLATE}

CONVERSATIONS = {
    "system+user": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}],
    "user only": [{"role": "user", "content": "What is 2+2?"}],
    "multi-turn": [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Translate: the cat sleeps."},
        {"role": "assistant", "content": "Le chat dort."},
        {"role": "user", "content": "And: the dog runs."},
        {"role": "assistant", "content": "Le chien court."},
        {"role": "user", "content": "  Thanks!  "},
    ],
    "unicode": [
        {"role": "user", "content": "你好，世界 🌍👋🏽 — naïve café, Ωμέγα, \u200b zero-width, tab\tnewline\n"},
        {"role": "assistant", "content": "こんにちは 😀 {{ not a template }} {% raw %}"},
        {"role": "user", "content": "<|im_start|> is just text here ✓"},
    ],
}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "天气 for a city — returns °C",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "e.g. 北京"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "description": "current time", "parameters": {}}},
]

TOOL_CHAT = [
    {"role": "user", "content": "Weather in 北京 and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "北京", "unit": "celsius"}}},
        {"type": "function", "function": {"name": "now", "arguments": {}}}]},
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "tool", "content": "12:00"},
    {"role": "assistant", "content": "21 °C at noon.", "tool_calls": None},
    {"role": "user", "content": "Thanks"},
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    """A transformers tokenizer whose apply_chat_template is the reference (the vocabulary is irrelevant)."""
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
    inner = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")


def reference(hf_tokenizer, template, messages, **kwargs):
    return hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)


def ours(template, messages, **kwargs):
    return render_chat_template(template, messages, bos_token="<s>", eos_token="</s>", **kwargs)


@pytest.mark.parametrize("template", sorted(TEMPLATES))
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(hf_tokenizer, template, conversation, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    if template == "llama2" and conversation == "unicode":
        messages = messages[:1]  # llama2 needs user/assistant alternation ending with a user turn
    expected = reference(hf_tokenizer, TEMPLATES[template], messages, add_generation_prompt=add_generation_prompt)
    assert ours(TEMPLATES[template], messages, add_generation_prompt=add_generation_prompt) == expected


def test_qwen_default_system_prompt_and_exact_text():
    text = render_chat_template(QWEN25_TEMPLATE, [{"role": "user", "content": "Hi 😀"}])
    assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                    "<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = render_chat_template(QWEN25_TEMPLATE, [{"role": "user", "content": "Hi 😀"}],
                                     add_generation_prompt=False)
    assert text == no_prompt + "<|im_start|>assistant\n"


@pytest.mark.parametrize("template", ["qwen2.5", "features"])
@pytest.mark.parametrize("with_system", [False, True])
def test_tools_match_transformers(hf_tokenizer, template, with_system):
    messages = ([{"role": "system", "content": "Use tools."}] if with_system else []) + TOOL_CHAT
    expected = reference(hf_tokenizer, TEMPLATES[template], messages, tools=TOOLS, add_generation_prompt=True)
    text = ours(TEMPLATES[template], messages, tools=TOOLS)
    assert text == expected
    if template == "qwen2.5":
        assert '"description": "天气 for a city — returns °C"' in text  # tojson keeps non-ASCII as is
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "北京", "unit": "celsius"}}' in text


def test_reasoning_fields_and_extra_kwargs_match_transformers(hf_tokenizer):
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning": "two plus two"},
                {"role": "user", "content": "3+3?"}]
    expected = reference(hf_tokenizer, FEATURES_TEMPLATE, messages, add_generation_prompt=True, enable_thinking=False)
    text = ours(FEATURES_TEMPLATE, messages, enable_thinking=False)
    assert text == expected and "<think>two plus two</think>" in text and "(no thinking)" in text
    assert "reasoning_content" not in messages[1]  # the caller's messages are left alone


def test_break_limits_turns_and_bos_is_optional():
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(9)]
    text = render_chat_template(FEATURES_TEMPLATE, many)
    assert "m4" in text and "m5" not in text
    assert not render_chat_template(FEATURES_TEMPLATE, many[:1]).startswith("<s>")  # no bos_token given


def test_compiled_templates_are_cached():
    render_chat_template(QWEN25_TEMPLATE, CONVERSATIONS["user only"])
    hits = _compile.cache_info().hits
    render_chat_template(QWEN25_TEMPLATE, CONVERSATIONS["system+user"])
    assert _compile.cache_info().hits == hits + 1


# ---- errors ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    (None, "non-empty list"),
    ([{"role": "user", "content": "a"}, "b"], "message 1 must be a dict"),
    ([{"content": "no role"}], "message 0 needs a 'role'"),
    ([{"role": "user", "content": "ok"}, {"role": 3, "content": "x"}], "message 1 needs a 'role'"),
    ([{"role": "user"}], r"message 0 \(role 'user'\) has no 'content'"),
    ([{"role": "user", "content": 42}], r"message 0 \(role 'user'\): content must be a string, got 42"),
    ([{"role": "user", "content": None}], "None is accepted only for assistant messages"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": ["x"]}], "message 1"),
])
def test_bad_messages_name_the_message(messages, match):
    with pytest.raises(ValueError, match=match):
        render_chat_template(QWEN25_TEMPLATE, messages)


@pytest.mark.parametrize("template", [None, ""])
def test_no_template_suggests_raw_prompts(template):
    with pytest.raises(ValueError, match="no chat template.*raw prompt"):
        render_chat_template(template, [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("template", ["{% for m in messages %}{{ m.content }}", "{{ messages[0]. }}",
                                      "{% generation %}unclosed", "{% endif %}"])
def test_syntax_error_is_reported_as_invalid_template(template):
    with pytest.raises(ValueError, match="chat template is invalid: .*template line 1"):
        render_chat_template(template, [{"role": "user", "content": "hi"}])


def test_raise_exception_message_reaches_the_user(hf_tokenizer):
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="must alternate"):  # transformers refuses it too
        reference(hf_tokenizer, LLAMA2_TEMPLATE, bad)
    with pytest.raises(ValueError, match=r"^Conversation roles must alternate user/assistant/user/assistant/\.\.\.$"):
        render_chat_template(LLAMA2_TEMPLATE, bad, bos_token="<s>", eos_token="</s>")


def test_template_runtime_failures_are_value_errors():
    # None values are dropped as in transformers, so Qwen's `'\n' + message.content` fails on an assistant
    # turn that has neither content nor tool calls.
    reply_without_content = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]
    with pytest.raises(ValueError, match="chat template failed: .*no attribute 'content'"):
        render_chat_template(QWEN25_TEMPLATE, reply_without_content)
    with pytest.raises(ValueError, match="chat template failed on these messages: TypeError"):
        render_chat_template("{{ messages[0].content + 1 }}", [{"role": "user", "content": "x"}])
    # the sandbox refuses interpreter internals and mutation
    for escape in ("{{ messages.__class__.__mro__[1] }}", "{{ (messages.pop)() }}",
                   "{% set _ = messages.append(1) %}"):
        with pytest.raises(ValueError, match="chat template failed: .*unsafe"):
            render_chat_template(escape, [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="underscore"):
        render_chat_template("{% set ns = namespace(_x=1) %}", [{"role": "user", "content": "x"}])


def test_bad_tools_and_non_string_template():
    with pytest.raises(ValueError, match="tools must be a list"):
        render_chat_template(QWEN25_TEMPLATE, CONVERSATIONS["user only"], tools=["get_weather"])
    with pytest.raises(ValueError, match="must be a string"):
        render_chat_template(b"{{ 1 }}", CONVERSATIONS["user only"])


@pytest.mark.parametrize("template, match", [
    ("{% for i in range(10**9) %}{% endfor %}", "stopped: it passed 1000000000 to a function"),
    ("{{ 'x' * 10**10 }}", r"stopped: it repeated a str 10000000000 times \(limit 4194304 items\)"),
    ("{{ [0] * 10**10 }}", "stopped: it repeated a list"),
    ("{{ 7 ** 100000 }}", r"stopped: it computed 7 \*\* 100000"),
    ("{{ 'x'.center(10**9) }}", "integer arguments are limited to 100000"),
    ("{{ 'x' | center(10**9) }}", "integer arguments are limited to 100000"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "stopped: it built a str of 8388608 items"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "stopped: it built a str"),
    ("{% for i in range(100000) %}{{ 'abcdefghij' * 100 }}{% endfor %}", "stopped: its output passed 4194304"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "failed: RecursionError"),
    ("{{ 1 // 0 }}", "failed: ZeroDivisionError"),
])
def test_every_template_failure_and_runaway_is_a_value_error(template, match):
    with pytest.raises(ValueError, match=match):
        render_chat_template(template, CONVERSATIONS["user only"])


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set s = 'ab' * 50000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",  # no calls, no output
])
def test_templates_that_run_too_long_are_stopped(monkeypatch, template):
    import llaisys.chat

    monkeypatch.setattr(llaisys.chat, "TIME_LIMIT_S", 0.2)
    with pytest.raises(ValueError, match=r"chat template stopped: it ran longer than 0.2 s"):
        render_chat_template(template, CONVERSATIONS["user only"])


def test_bounded_loops_keep_loop_variables():
    template = "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ '.' if loop.last }} {% endfor %}"
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert render_chat_template(template, msgs) == "1/2 2/2. "
    assert render_chat_template("{{ 'a' ~ 1 ~ none }}{{ range(3) | list }}", msgs) == "a1None[0, 1, 2]"


def test_lone_surrogates_in_messages_are_named():
    with pytest.raises(ValueError, match=r"message 1 \(role 'user'\) content is not valid Unicode: lone surrogate "
                                         r"'\\ud800' at position 3"):
        render_chat_template(QWEN25_TEMPLATE, [{"role": "system", "content": "s"},
                                               {"role": "user", "content": "abc\ud800"}])
