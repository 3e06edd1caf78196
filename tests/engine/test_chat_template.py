"""Chat template rendering (engine/chat_template.py)."""
from __future__ import annotations

import json
from datetime import datetime, timedelta

import pytest

from engine.chat_template import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError


@pytest.fixture(scope="module")
def smollm2_template(smollm2_path) -> str:
    from engine.gguf.reader import GGUFFile
    return GGUFFile(smollm2_path).metadata["tokenizer.chat_template"]


# --- SmolLM2 (the real template from the GGUF) -------------------------------------------------------

def test_smollm2_system_and_user(smollm2_template):
    t = ChatTemplate(smollm2_template)
    assert not t.is_fallback
    out = t.render([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ])
    assert out == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_default_system_prompt(smollm2_template):
    t = ChatTemplate(smollm2_template)
    out = t.render([{"role": "user", "content": "Hi"}])
    assert out == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_multi_turn_without_generation_prompt(smollm2_template):
    t = ChatTemplate(smollm2_template)
    out = t.render([
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ], add_generation_prompt=False)
    assert out.endswith("<|im_start|>assistant\nHello!<|im_end|>\n")
    assert out.count("<|im_start|>") == 3


def test_template_type_error_is_chat_template_error(smollm2_template):
    # This template concatenates strings; list content makes it fail: a clear ChatTemplateError.
    t = ChatTemplate(smollm2_template)
    with pytest.raises(ChatTemplateError, match="TypeError"):
        t.render([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])


# --- Qwen3-style template with tools -----------------------------------------------------------------

QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo actuelle d'une ville, en °C",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}


def test_qwen3_tools_rendered():
    t = ChatTemplate(QWEN3_TEMPLATE)
    out = t.render(
        [{"role": "system", "content": "Be helpful."}, {"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER_TOOL],
    )
    # tojson like transformers: json.dumps with ensure_ascii=False and no HTML escaping.
    tool_json = json.dumps(WEATHER_TOOL, ensure_ascii=False)
    assert "°C" in tool_json
    assert out == (
        "<|im_start|>system\nBe helpful.\n\n# Tools\n\nYou may call one or more functions to assist with the "
        "user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + tool_json
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen3_tool_call_round_trip_and_enable_thinking():
    t = ChatTemplate(QWEN3_TEMPLATE)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"temp": 21}'},
    ]
    out = t.render(messages, tools=[WEATHER_TOOL], enable_thinking=False)
    assert (
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n"
    ) in out
    assert out.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # Without tools (None or empty list) there is no tools block.
    for tools in (None, []):
        plain = t.render([{"role": "user", "content": "Hi"}], tools=tools)
        assert plain == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_tojson_options():
    t = ChatTemplate("{{ tools | tojson(indent=2, sort_keys=true) }}|{{ tools | tojson(separators=(',', ':')) }}")
    tools = [{"b": 1, "a": "é<>&"}]
    out = t.render([{"role": "user", "content": "x"}], tools=tools)
    assert out == (json.dumps(tools, ensure_ascii=False, indent=2, sort_keys=True) + "|"
                   + json.dumps(tools, ensure_ascii=False, separators=(",", ":")))


# --- Llama-3-style template: bos_token and strftime_now ----------------------------------------------

LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"""


def _llama3_expected(date: str) -> str:
    return (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\n"
        f"Today Date: {date}\n\n"
        "Be brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_llama3_bos_and_strftime_now():
    t = ChatTemplate(LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    msgs = [{"role": "system", "content": "  Be brief. "}, {"role": "user", "content": "Hello\n"}]
    before = datetime.now()
    out = t.render(msgs)
    after = datetime.now()
    dates = {before.strftime("%d %b %Y"), after.strftime("%d %b %Y")}
    assert out in {_llama3_expected(d) for d in dates}
    # Extra variables reach the template (and a given date_string wins).
    assert t.render(msgs, date_string="01 Jan 2030") == _llama3_expected("01 Jan 2030")
    # The date really is today's, not a fixed string.
    assert (before - timedelta(days=1)).strftime("%d %b %Y") not in dates or len(dates) == 2


def test_extra_variables_and_eos_token():
    t = ChatTemplate("{{ bos_token }}{% for d in documents %}[{{ d.title }}]{% endfor %}{{ eos_token }}",
                     bos_token="<s>", eos_token="</s>")
    out = t.render([{"role": "user", "content": "x"}], documents=[{"title": "a"}, {"title": "b"}])
    assert out == "<s>[a][b]</s>"


def test_generation_tag_is_accepted():
    t = ChatTemplate("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
                     "{{ m.content }}{% endgeneration %}{% else %}<{{ m.content }}>{% endif %}{% endfor %}")
    assert t.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]) == "<q>a"


def test_loopcontrols_and_trim_blocks():
    src = ("{% for m in messages %}\n"
           "    {% if m.role == 'system' %}{% continue %}{% endif %}\n"
           "{{ m.content }};\n"
           "    {% if loop.index >= 2 %}{% break %}{% endif %}\n"
           "{% endfor %}")
    t = ChatTemplate(src)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert t.render(msgs) == "a;\n"


# --- errors and the sandbox --------------------------------------------------------------------------

def test_raise_exception_surfaces():
    t = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}"
                     "{% endif %}ok")
    assert t.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="Conversation must start with user"):
        t.render([{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize("src", [
    "{{ messages.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages['__class__'] }}",
    "{{ raise_exception.__globals__ }}",
    "{{ messages.append({'role': 'x'}) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
])
def test_unsafe_access_blocked(src):
    t = ChatTemplate(src)
    with pytest.raises(ChatTemplateError, match="unsafe"):
        t.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("src", [
    "{% for m in messages %}{{ m.content }}",     # missing endfor
    "{{ messages[0].content ",                    # unclosed expression
    "{% if %}x{% endif %}",
    "{% frobnicate %}",
])
def test_syntax_error(src):
    with pytest.raises(ChatTemplateError, match="syntax error"):
        ChatTemplate(src)


def test_undefined_variable_in_expression_is_error():
    t = ChatTemplate("{{ nope + 1 }}")
    with pytest.raises(ChatTemplateError):
        t.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("messages", [
    "hello",
    [{"content": "no role"}],
    [{"role": 3, "content": "x"}],
    [{"role": "", "content": "x"}],
    [{"role": "user"}],
    [{"role": "user", "content": 42}],
    [{"role": "user", "content": {"type": "text", "text": "x"}}],
    [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": [{"type": "bogus", "text": "x"}]}],
    [{"role": "user", "content": ["just a string"]}],
    ["not a dict"],
])
def test_bad_messages(messages):
    t = ChatTemplate(None)
    with pytest.raises(ChatTemplateError):
        t.render(messages)


def test_bad_tools():
    with pytest.raises(ChatTemplateError):
        ChatTemplate(None).render([{"role": "user", "content": "x"}], tools=["get_weather"])


def test_good_message_shapes_accepted():
    t = ChatTemplate(None)
    out = t.render([
        {"role": "user", "content": [{"type": "text", "text": "look: "}, {"type": "image"},
                                     {"type": "text", "text": "what is it?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
    ], add_generation_prompt=False)
    assert out == ("<|im_start|>user\nlook: what is it?<|im_end|>\n"
                   "<|im_start|>assistant\n<|im_end|>\n"
                   "<|im_start|>assistant\n<|im_end|>\n")


# --- ChatML fallback -----------------------------------------------------------------------------------

@pytest.mark.parametrize("source", [None, ""])
def test_fallback_chatml(source):
    t = ChatTemplate(source)
    assert t.is_fallback and t.source == CHATML_TEMPLATE
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert t.render(msgs) == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                              "<|im_start|>assistant\n")
    assert t.render(msgs, add_generation_prompt=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n")


def test_fallback_gemma_turns():
    from engine.chat_template import fallback_for
    t = ChatTemplate(None, bos_token="<bos>", fallback="gemma")
    assert t.is_fallback and t.name == "gemma" and "<end_of_turn>" in t.stop_strings
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]},
            {"role": "assistant", "content": "A "}, {"role": "user", "content": "V"}]
    assert t.render(msgs) == ("<bos><start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\nA<end_of_turn>\n"
                              "<start_of_turn>user\nV<end_of_turn>\n<start_of_turn>model\n")
    vocab = {"<start_of_turn>", "<end_of_turn>"}
    assert fallback_for(vocab.__contains__) == "gemma"
    assert fallback_for({"<|start_header_id|>", "<|eot_id|>"}.__contains__) == "llama3"
    assert fallback_for(set().__contains__) == "chatml"
    assert ChatTemplate("{{ 'x' }}").name == "gguf" and ChatTemplate("{{ 'x' }}").stop_strings == ()


def test_continue_final_message():
    """Assistant prefill: the rendering stops right after the final assistant text (no end of turn, no new
    turn), so generation continues it."""
    t = ChatTemplate(None)
    msgs = [{"role": "user", "content": "Sky colour?"}, {"role": "assistant", "content": "The color is"}]
    assert t.render(msgs, continue_final_message=True) == (
        "<|im_start|>user\nSky colour?<|im_end|>\n<|im_start|>assistant\nThe color is")
    g = ChatTemplate(None, fallback="gemma")
    assert g.render(msgs + [], continue_final_message=True).endswith("<start_of_turn>model\nThe color is")
    with pytest.raises(ChatTemplateError, match="assistant"):
        t.render(msgs[:1], continue_final_message=True)


def test_gemma3_without_template_stops_at_its_end_marker(gemma3_path):
    """Gemma-3-270M's GGUF has no chat template: the engine says which fallback it uses, picks Gemma's turns
    from the vocabulary, and no turn marker leaks into the reply."""
    from engine.engine import Engine, EngineConfig
    from engine.sampling import SamplingParams
    from engine.types import FinishEvent, Request
    eng = Engine(EngineConfig(model=str(gemma3_path), ctx_size=256, max_seqs=1))
    try:
        assert eng.template.is_fallback and eng.template.name == "gemma"
        sp = SamplingParams(max_tokens=40, temperature=0.0)
        events = list(eng.submit(Request(messages=[{"role": "user", "content": "What color is the sky?"}],
                                         sampling=sp)))
        text = "".join(getattr(e, "text", "") for e in events)
        assert not any(m in text for m in ("<|im_", "<start_of_turn>", "<end_of_turn>", "\nuser\n")), text
        fin = events[-1]
        assert isinstance(fin, FinishEvent) and fin.stop_string is None
    finally:
        eng.shutdown()


def test_chat_template_error_is_value_error():
    assert issubclass(ChatTemplateError, ValueError)


# --- parity with transformers (runs only where transformers is installed) ------------------------------

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_PARITY_CASES = [
    (SMOLLM2_TEMPLATE, [{"role": "user", "content": "Hi"}], None, {}),
    (SMOLLM2_TEMPLATE, [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], None, {}),
    (QWEN3_TEMPLATE, [{"role": "system", "content": "Be helpful."}, {"role": "user", "content": "Weather?"},
                      {"role": "assistant", "content": "", "tool_calls": [
                          {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Nîmes"}}}]},
                      {"role": "tool", "content": "21"}], [WEATHER_TOOL], {"enable_thinking": False}),
    (LLAMA3_TEMPLATE, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}], None,
     {"date_string": "01 Jan 2030"}),
    (CHATML_TEMPLATE, [{"role": "user", "content": "x"}], None, {}),
    ("{{ tools | tojson(indent=2, sort_keys=true) }}{{ messages | tojson }}", [{"role": "user", "content": "é<>"}],
     [WEATHER_TOOL], {}),
]


@pytest.mark.parametrize("case", range(len(_PARITY_CASES)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(case, add_generation_prompt):
    pytest.importorskip("transformers")
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        pytest.skip("this transformers version has no _compile_jinja_template")
    src, messages, tools, extra = _PARITY_CASES[case]
    tokens = dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    want = _compile_jinja_template(src).render(messages=messages, tools=tools,
                                               add_generation_prompt=add_generation_prompt, **tokens, **extra)
    got = ChatTemplate(src, **tokens).render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                             **extra)
    assert got == want
