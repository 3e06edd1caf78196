"""The Anthropic Messages API on the demo model, through the official `anthropic` SDK."""
from __future__ import annotations


import pytest

anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx2")

WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(smollm2_path):
    from app.server.app import ServerThread, create_app
    from app.server.security import ServerSettings
    from engine.engine import Engine, EngineConfig
    eng = Engine(EngineConfig(model=str(smollm2_path), ctx_size=512, max_seqs=4, max_queue=8))
    # Claude Code sends its own model names: --any-model maps them to the loaded model
    srv = ServerThread(create_app(eng, ServerSettings(api_keys=["sk-local-test-key"], accept_any_model=True))).start()
    srv.engine = eng
    yield srv
    srv.stop()
    eng.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="sk-local-test-key", max_retries=0, timeout=120)


def test_messages(client):
    r = client.messages.create(model="claude-local", max_tokens=6, extra_body={"temperature": 0}, system="Be brief.",
                               messages=[{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}])
    assert r.type == "message" and r.role == "assistant"
    assert r.content[0].type == "text" and r.content[0].text
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 6 and r.usage.input_tokens > 5


def test_streaming_events_in_order(client):
    ref = client.messages.create(model="m", max_tokens=6, extra_body={"temperature": 0},
                                 messages=[{"role": "user", "content": "Say hello."}])
    with client.messages.stream(model="m", max_tokens=6, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": "Say hello."}]) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert final.content[0].text == ref.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    raw = [e for e in events if e in ("message_start", "content_block_start", "content_block_delta",
                                      "content_block_stop", "message_delta", "message_stop")]
    assert raw[0] == "message_start" and raw[1] == "content_block_start"
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_tool_use_round_trip(client):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.messages.create(model="m", max_tokens=40, extra_body={"temperature": 0}, tools=[WEATHER], messages=msgs,
                               tool_choice={"type": "tool", "name": "get_weather"})
    assert r.stop_reason == "tool_use"
    use = [b for b in r.content if b.type == "tool_use"][0]
    assert use.name == "get_weather" and isinstance(use.input["city"], str) and use.id.startswith("toolu_")
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": [{"type": "text", "text": "21 C, clear"}]},
                                          {"type": "text", "text": "Thanks!"}]}]
    r2 = client.messages.create(model="m", max_tokens=6, extra_body={"temperature": 0}, tools=[WEATHER], messages=msgs)
    assert r2.stop_reason in ("end_turn", "max_tokens", "tool_use")
    total = lambda u: u.input_tokens + u.cache_read_input_tokens
    assert total(r2.usage) > total(r.usage)
    # the same call, streamed: a tool_use block with input_json_delta
    with client.messages.stream(model="m", max_tokens=40, extra_body={"temperature": 0}, tools=[WEATHER], messages=msgs[:1],
                                tool_choice={"type": "any"}) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    assert final.content[-1].input == use.input


def test_count_tokens_and_errors(client, server):
    n = client.messages.count_tokens(model="m", messages=[{"role": "user", "content": "Say hello."}])
    assert n.input_tokens > 3
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong-key-123", max_retries=0).messages.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError) as ei:
        client.messages.create(model="m", max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    assert ei.value.body["type"] == "error" and ei.value.body["error"]["type"] == "invalid_request_error"
    bad_image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "@@notbase64"}}
    with pytest.raises(anthropic.BadRequestError, match="base64"):
        client.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [bad_image]}])
    r = httpx.post(server.url + "/v1/messages", content=b"{oops", headers={"x-api-key": "sk-local-test-key",
                                                                           "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.post(server.url + "/v1/messages", json={"model": "m", "max_tokens": 5,
                                                      "messages": [{"role": "user", "content": "word " * 600}]},
                   headers={"x-api-key": "sk-local-test-key"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt is too long: ")


PERSON = {"name": "save_person", "description": "Save a person",
          "input_schema": {"type": "object", "$defs": {"Address": {
              "type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
              "required": ["street", "city"], "additionalProperties": False}},
              "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/Address"}},
              "required": ["name", "address"], "additionalProperties": False}}


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "save_person"}])
def test_forced_tool_use_with_defs_and_refs(client, choice):
    jsonschema = pytest.importorskip("jsonschema")
    r = client.messages.create(model="m", max_tokens=60, extra_body={"temperature": 0}, tools=[PERSON, WEATHER],
                               tool_choice=choice, messages=[{"role": "user", "content": "Ann, 1 Main St, Oslo."}])
    assert r.stop_reason in ("tool_use", "max_tokens")
    uses = [b for b in r.content if b.type == "tool_use"]
    if r.stop_reason == "tool_use" and uses[0].name == "save_person":
        jsonschema.validate(uses[0].input, PERSON["input_schema"])


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_use_cut_by_max_tokens_is_max_tokens_not_text(client, stream):
    """A forced tool_use that max_tokens cuts: stop_reason "max_tokens", no tool_use block and no half call
    shown as text."""
    kw = dict(model="m", max_tokens=6, extra_body={"temperature": 0}, tools=[WEATHER],
              tool_choice={"type": "any"}, messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    if stream:
        with client.messages.stream(**kw) as s:
            r = s.get_final_message()
    else:
        r = client.messages.create(**kw)
    assert r.stop_reason == "max_tokens" and [b.type for b in r.content] == ["text"], r
    assert "<tool_call>" not in r.content[0].text and "get_weather" not in r.content[0].text, r


def test_usage_input_tokens_exclude_cache_reads(client):
    """Anthropic's input_tokens counts only the prompt tokens not read from the cache."""
    msgs = [{"role": "user", "content": "Tell me about the sea, the sky and the hills. " * 8}]
    full = client.messages.count_tokens(model="m", messages=msgs).input_tokens
    client.messages.create(model="m", max_tokens=2, extra_body={"temperature": 0}, messages=msgs)
    r = client.messages.create(model="m", max_tokens=2, extra_body={"temperature": 0}, messages=msgs)
    u = r.usage
    assert u.cache_read_input_tokens > 0
    assert u.input_tokens + u.cache_read_input_tokens == full
    with client.messages.stream(model="m", max_tokens=2, extra_body={"temperature": 0}, messages=msgs) as s:
        fu = s.get_final_message().usage
    assert fu.cache_read_input_tokens > 0 and fu.input_tokens + fu.cache_read_input_tokens == full


def test_prompt_too_long_in_anthropic_words(client):
    """Clients (litellm, Claude Code) recognise an overflow by Anthropic's text "prompt is too long"."""
    with pytest.raises(anthropic.BadRequestError) as ei:
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "word " * 600}])
    err = ei.value.body["error"]
    assert err["type"] == "invalid_request_error"
    import re
    m = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", err["message"])
    assert m and int(m.group(1)) > int(m.group(2)) - 1 and int(m.group(2)) == 511, err


def test_assistant_prefill_is_continued(client, server):
    """A trailing assistant message is a prefill: the reply continues it (it does not start a new turn that
    repeats it), as Anthropic's API does; the prompt ends with the prefill's text."""
    msgs = [{"role": "user", "content": "What color is the sky? Answer in one sentence."},
            {"role": "assistant", "content": "The color of the sky is"}]
    r = client.messages.create(model="m", max_tokens=8, extra_body={"temperature": 0}, messages=msgs)
    text = r.content[0].text
    assert not text.lstrip().startswith("The color"), text
    eng = server.engine
    from engine.types import Request
    ids = eng.prompt_ids(Request(messages=[{"role": "user", "content": msgs[0]["content"]}, msgs[1]],
                                 template_kwargs={"continue_final_message": True}))
    assert eng.tokenizer.decode(ids).endswith("The color of the sky is")
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(ids)


def test_model_field_same_streaming_and_not(client):
    kw = {"model": "claude-sonnet-4-5", "max_tokens": 3, "extra_body": {"temperature": 0},
          "messages": [{"role": "user", "content": "Hi"}]}
    r = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert r.model == final.model == "claude-sonnet-4-5"
