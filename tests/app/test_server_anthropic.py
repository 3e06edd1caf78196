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
    assert r2.usage.input_tokens > r.usage.input_tokens
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
    assert r.status_code == 400 and "too many" in r.json()["error"]["message"]
