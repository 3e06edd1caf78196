"""The OpenAI-compatible API on the demo model, through the official `openai` SDK (and raw HTTP for errors)."""
from __future__ import annotations

import base64
import json
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")
jsonschema = pytest.importorskip("jsonschema")

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["tz"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(smollm2_path):
    from app.server.app import ServerThread, create_app
    from app.server.security import ServerSettings
    from engine.engine import Engine, EngineConfig
    eng = Engine(EngineConfig(model=str(smollm2_path), ctx_size=512, max_seqs=8, max_queue=16))
    srv = ServerThread(create_app(eng, ServerSettings())).start()
    srv.engine = eng
    yield srv
    srv.stop()
    eng.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def chat(client, model, content="Say hello.", **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], **kw)


def test_models(client, server):
    cards = client.models.list().data
    assert len(cards) == 1
    d = cards[0].model_dump()
    assert d["context_length"] == 512 and d["capabilities"]["tools"] is True and d["capabilities"]["vision"] is False
    assert client.models.retrieve(cards[0].id).id == cards[0].id


def test_chat_non_streaming_and_streaming_agree(client, model):
    r = chat(client, model, max_tokens=6)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "length" and text
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(chat(client, model, max_tokens=6, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_list_content_parts_are_flattened(client, model):
    r = client.chat.completions.create(model=model, max_tokens=3, temperature=0, messages=[
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello."}]}])
    assert r.choices[0].message.content


def test_stop_strings(client, model):
    full = chat(client, model, max_tokens=10).choices[0].message.content
    words = full.split()
    assert len(words) >= 3, full
    stop = " " + words[2]
    r = chat(client, model, max_tokens=10, stop=[stop, "<never>"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[:full.index(stop)]


def test_seed_reproducibility(client, model):
    kw = dict(max_tokens=8, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    a = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell a story."}],
                                       extra_body={k: kw.pop(k) for k in ("top_k", "min_p")}, **kw)
    kw2 = dict(max_tokens=8, temperature=1.0, top_p=1.0, seed=1234)
    b = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell a story."}],
                                       extra_body={"top_k": 0, "min_p": 0.0}, **kw2)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_logprobs(client, model):
    r = chat(client, model, max_tokens=4, logprobs=True, top_logprobs=3)
    lps = r.choices[0].logprobs.content
    assert len(lps) == r.usage.completion_tokens == 4
    assert "".join(x.token for x in lps) == r.choices[0].message.content
    for x in lps:
        assert x.logprob <= 0 and len(x.top_logprobs) == 3
        assert x.top_logprobs[0].token == x.token  # greedy picks the most probable
        assert [t.logprob for t in x.top_logprobs] == sorted((t.logprob for t in x.top_logprobs), reverse=True)
        assert bytes(x.bytes).decode("utf-8", "replace") == x.token


def test_forced_tool_call_round_trip(client, model):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=model, messages=msgs, tools=[WEATHER, TIME], max_tokens=40,
                                       temperature=0, tool_choice={"type": "function",
                                                                   "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    msgs += [choice.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21, "sky": "clear"})}]
    r2 = client.chat.completions.create(model=model, messages=msgs, tools=[WEATHER, TIME], max_tokens=8,
                                        temperature=0)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens


def test_required_tool_call_streamed(client, model):
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What time is it in UTC?"}], tools=[WEATHER, TIME],
        tool_choice="required", max_tokens=40, temperature=0, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].index == 0 and deltas[0].id and deltas[0].function.name in ("get_weather", "get_time")
    args = json.loads("".join(d.function.arguments or "" for d in deltas))
    assert isinstance(args, dict)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


class _Address(__import__("pydantic").BaseModel):
    street: str
    city: str


class _Person(__import__("pydantic").BaseModel):
    name: str
    address: _Address


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "_Person"}}])
def test_forced_tool_call_with_defs_and_refs(client, model, choice):
    """A tool schema with $defs/$ref (a pydantic model with a nested model, as openai.pydantic_function_tool
    makes it) still resolves when the forced call's grammar embeds it; the arguments validate against it."""
    tool = openai.pydantic_function_tool(_Person)
    assert "$defs" in tool["function"]["parameters"]
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Ann lives at 1 Main St, Oslo."}],
                                       tools=[tool, WEATHER], tool_choice=choice, max_tokens=60, temperature=0)
    c = r.choices[0]
    assert c.finish_reason in ("tool_calls", "length"), c
    if c.finish_reason == "tool_calls":
        args = json.loads(c.message.tool_calls[0].function.arguments)
        if c.message.tool_calls[0].function.name == "_Person":
            _Person.model_validate(args)


def test_forced_call_grammar_reroots_references():
    from app.server.tools import HERMES, forced_call_grammar
    recursive = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"label": {"type": "string"},
                                         "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
        "required": ["label"], "definitions": {"unused": {"$ref": "#/definitions/unused2"}, "unused2": {}}}}}
    g = forced_call_grammar(HERMES, [recursive, openai.pydantic_function_tool(_Person)])
    assert '"#/$defs/hivejet_tool_0"' in g and '"#/$defs/hivejet_tool_1/$defs/_Address"' in g
    assert '"#/$defs/hivejet_tool_0/definitions/unused2"' in g


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_call_cut_by_max_tokens_is_length_not_text(client, model, stream):
    """A forced call that max_tokens cuts is finish_reason "length", with no half call shown as content."""
    kw = dict(model=model, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
              tools=[WEATHER], tool_choice="required", max_tokens=6, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        finish = chunks[-1].choices[0].finish_reason
    else:
        c = client.chat.completions.create(**kw).choices[0]
        content, calls, finish = c.message.content or "", c.message.tool_calls or [], c.finish_reason
    assert finish == "length" and not calls
    assert "<tool_call>" not in content and "get_weather" not in content, content


def test_constraint_that_cannot_finish_is_not_success(server):
    """A constrained generation that ends with its grammar incomplete (or in error) is a failure, not
    finish_reason "stop": the server answers 400 constraint_unsatisfiable."""
    from app.server.core import ApiError, constraint_error, constraint_failure
    from app.server.grammar import GrammarConstraint, json_schema_grammar
    from engine.types import FinishEvent, Timings, Usage
    tok = server.engine.tokenizer
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fin = FinishEvent(reason="stop", usage=Usage(), timings=Timings())
    c = GrammarConstraint(tok, json_schema_grammar(schema))
    for t in tok.encode('{"a', add_special=False):
        c.accept(t)
    assert constraint_failure(c, fin) == "the output ended before the grammar was complete"
    for t in tok.encode('": "x"', add_special=False):     # a string where an integer must be
        c.accept(t)
    assert c.error and constraint_failure(c, fin) == c.error
    assert constraint_failure(c, FinishEvent(reason="length", usage=Usage(), timings=Timings())) is None
    done = GrammarConstraint(tok, json_schema_grammar(schema))
    for t in tok.encode('{"a": 1}', add_special=False):
        done.accept(t)
    assert constraint_failure(done, fin) is None
    e = constraint_error("x", "response_format")
    assert isinstance(e, ApiError) and e.status == 400 and e.code == "constraint_unsatisfiable"


def test_unsatisfiable_schema_is_400(client, model):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 2}},
              "required": ["a"]}
    with pytest.raises(openai.BadRequestError, match="nsatisfiable"):
        chat(client, model, "JSON", response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                                           "schema": schema}})


# compiles, but has no finite instance: the grammar fails once the output has begun ('{"')
ENDLESS = {"type": "object", "$defs": {"X": {"type": "object", "properties": {"x": {"$ref": "#/$defs/X"}},
                                             "required": ["x"]}},
           "properties": {"a": {"$ref": "#/$defs/X"}}, "required": ["a"]}


@pytest.mark.parametrize("stream", [False, True])
def test_schema_that_fails_mid_output_is_an_error(client, model, stream):
    """A schema the grammar accepts but no output can complete: an error (400 constraint_unsatisfiable, or
    an error event when streaming), not a 200 with the broken start and finish_reason "stop"."""
    rf = {"type": "json_schema", "json_schema": {"name": "endless", "schema": ENDLESS}}
    if not stream:
        with pytest.raises(openai.BadRequestError) as ei:
            chat(client, model, "JSON", max_tokens=40, response_format=rf)
        assert ei.value.code == "constraint_unsatisfiable" and ei.value.param == "response_format", ei.value
        return
    with httpx.Client(timeout=120) as c:
        with c.stream("POST", str(client.base_url) + "chat/completions", json={
                "model": model, "messages": _msgs("JSON"), "max_tokens": 40, "temperature": 0, "stream": True,
                "response_format": rf}) as r:
            assert r.status_code == 200
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    errors = [e["error"] for e in events if "error" in e]
    assert errors and errors[0]["code"] == "constraint_unsatisfiable", events[-3:]
    assert "stop" not in [ch["finish_reason"] for e in events for ch in e.get("choices", [])]


def test_tool_choice_none_gives_text(client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], tools=[WEATHER],
                                       tool_choice="none", max_tokens=4, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_json_schema_output_validates(client, model):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                               "member": {"type": "boolean"}},
              "required": ["name", "age", "member"], "additionalProperties": False}
    r = chat(client, model, "Describe a person as JSON.", max_tokens=48,
             response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = chat(client, model, "Give me JSON.", max_tokens=48, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_completions_list_of_prompts(client, model, server, stream):
    """A list of prompts (strings or token-id lists) gets one choice per prompt, with its index, as OpenAI's
    /v1/completions does; each is what the prompt alone gives."""
    prompts = ["The capital of France is", "One, two, three,"]
    alone = [client.completions.create(model=model, prompt=p, max_tokens=4, temperature=0).choices[0].text
             for p in prompts]
    tok = server.engine.tokenizer
    for batch in (prompts, [tok.encode(p, add_special=False) for p in prompts]):
        if stream:
            texts = {0: "", 1: ""}
            finish = {}
            for ch in client.completions.create(model=model, prompt=batch, max_tokens=4, temperature=0,
                                                stream=True):
                for c in ch.choices:
                    texts[c.index] += c.text
                    if c.finish_reason:
                        finish[c.index] = c.finish_reason
            assert finish == {0: "length", 1: "length"}
            got = [texts[0], texts[1]]
        else:
            r = client.completions.create(model=model, prompt=batch, max_tokens=4, temperature=0)
            assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 8
            got = [c.text for c in r.choices]
        assert got == alone
    with pytest.raises(openai.BadRequestError, match="at most"):
        client.completions.create(model=model, prompt=["a"] * 65, max_tokens=1)


def test_cancelled_requests_counted_in_metrics(server, model):
    """A stream whose client goes away is counted in /metrics as finished with reason "cancelled"."""
    def cancelled():
        m = httpx.get(server.url + "/metrics").text
        return sum(float(line.split()[-1]) for line in m.splitlines()
                   if line.startswith('hivejet_requests_finished_total{reason="cancelled"}'))
    before = cancelled()
    body = {"model": model, "messages": _msgs("Write a long story."), "max_tokens": 300, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            for n, line in enumerate(r.iter_lines()):
                if n >= 6:
                    break
    t0 = time.monotonic()
    while cancelled() < before + 1:
        assert time.monotonic() - t0 < 10, httpx.get(server.url + "/metrics").text
        time.sleep(0.1)


def test_model_without_a_chat_template_says_which_it_uses(gemma3_path, caplog):
    """Gemma-3-270M's GGUF has no chat template: the server's log and /v1/models say which fallback the chats
    use (Gemma's turns, from the vocabulary), and a reply through the API carries none of its markers."""
    import logging

    from app.server.app import ServerThread, create_app
    from app.server.security import ServerSettings
    from engine.engine import Engine, EngineConfig
    with caplog.at_level(logging.WARNING, logger="hivejet.engine"):
        eng = Engine(EngineConfig(model=str(gemma3_path), ctx_size=256, max_seqs=1))
    srv = ServerThread(create_app(eng, ServerSettings())).start()
    try:
        said = [r.getMessage() for r in caplog.records if "no chat template" in r.getMessage()]
        assert said and "gemma fallback template" in said[0] and "<end_of_turn>" in said[0], said
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        card = c.models.list().data[0]
        assert card.model_dump()["chat_template"] == "fallback:gemma"
        r = c.chat.completions.create(model=card.id, messages=_msgs("What color is the sky?"), max_tokens=40,
                                      temperature=0)
        text = r.choices[0].message.content
        assert not any(m in text for m in ("<start_of_turn>", "<end_of_turn>", "<|im_", "\nuser\n")), text
    finally:
        srv.stop()
        eng.shutdown()


def test_completions_text_ids_echo_logprobs(client, model, server):
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0,
                                  logprobs=2, echo=True)
    c = r.choices[0]
    assert c.text.startswith("The capital of France is") and len(c.text) > len("The capital of France is")
    assert len(c.logprobs.tokens) == 4 and all(len(t) <= 2 for t in c.logprobs.top_logprobs)
    ids = server.engine.tokenizer.encode("The capital of France is")
    r2 = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0)
    assert r2.choices[0].text == c.text[len("The capital of France is"):]
    streamed = "".join(x.choices[0].text for x in client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=4, temperature=0, stream=True) if x.choices)
    assert streamed == r2.choices[0].text


def _post(server, path, body, raw=False):
    content = body if raw else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=60)


def _msgs(text="hi"):
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("body,status,needle", [
    ("{not json", 400, "malformed JSON"),
    ({"model": "no-such-model", "messages": _msgs()}, 404, "not served"),
    ({"messages": _msgs()}, 400, "model"),
    ({"MODEL": True, "messages": []}, 400, ""),
    ({"MODEL": True, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ({"MODEL": True, "messages": _msgs(), "temperature": -1}, 400, "temperature"),
    ({"MODEL": True, "messages": _msgs(), "top_p": 0}, 400, "top_p"),
    ({"MODEL": True, "messages": _msgs(), "n": 2}, 400, "n"),
    ({"MODEL": True, "messages": _msgs(), "max_tokens": 0}, 400, "max_tokens"),
    ({"MODEL": True, "messages": _msgs(), "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"MODEL": True, "messages": _msgs(), "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ({"MODEL": True, "messages": _msgs(), "top_logprobs": 2}, 400, "top_logprobs"),
    ({"MODEL": True, "messages": _msgs(), "seed": -1}, 400, "seed"),
    ({"MODEL": True, "messages": _msgs(), "stop": [""]}, 400, "stop"),
    ({"MODEL": True, "messages": _msgs(), "tool_choice": "required"}, 400, "tools"),
    ({"MODEL": True, "messages": _msgs(), "tools": [WEATHER],
      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "nope"),
    ({"MODEL": True, "messages": _msgs(), "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     400, "schema"),
    ({"MODEL": True, "messages": _msgs(), "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, 400, ""),
    ({"MODEL": True, "messages": _msgs("word " * 600)}, 400, "too many"),
    ({"MODEL": True, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}]}]}, 400, "base64"),
    ({"MODEL": True, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]}, 400, "remote"),
    ({"MODEL": True, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]}, 400, "file"),
    ({"MODEL": True, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(PNG).decode()}}]}]},
     400, "does not accept images"),
])
def test_errors_have_openai_shape(server, model, body, status, needle):
    if isinstance(body, dict) and body.pop("MODEL", None):
        body = {"model": model, "max_tokens": 2, **body}
    r = _post(server, "/v1/chat/completions", body, raw=isinstance(body, str))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["type"] and set(err) == {"message", "type", "param", "code"}
    assert needle.lower() in err["message"].lower() or needle == (err["param"] or ""), err


def test_context_too_long_says_by_how_much(server, model):
    r = _post(server, "/v1/completions", {"model": model, "prompt": "word " * 600})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "too many" in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", {"model": model, "prompt": []})
    assert r.status_code == 400


def test_context_overflow_in_openai_words(client, model):
    """Clients match OpenAI's wording and code to offer their token-limit help (litellm:
    ContextWindowExceededError on "This model's maximum context length is"; aider on top of it)."""
    import re
    with pytest.raises(openai.BadRequestError) as ei:
        chat(client, model, "word " * 600)
    e = ei.value
    assert e.code == "context_length_exceeded" and e.type == "invalid_request_error" and e.param == "messages"
    m = re.search(r"This model's maximum context length is (\d+) tokens\. However, your messages resulted in "
                 r"(\d+) tokens", e.message)
    assert m and int(m.group(1)) == 512 and int(m.group(2)) > 512, e.message
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=model, prompt="word " * 600, max_tokens=2)
    assert ei.value.code == "context_length_exceeded"
    assert "maximum context length is 512 tokens. However, your prompt resulted in" in ei.value.message


def test_huge_prompt_is_refused_without_tokenizing_it(server, model, monkeypatch):
    """A prompt far over the context is refused before the whole text is rendered or tokenized (a 30 MB body
    took a minute of CPU and gigabytes): the tokenizer never sees more than a bounded head of it."""
    tok = server.engine.tokenizer
    seen = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, *a, **k: seen.append(len(text)) or real(text, *a, **k))
    for body, path in (({"model": model, "messages": _msgs("word " * 400_000), "max_tokens": 2}, "/v1/chat/completions"),
                       ({"model": model, "prompt": "w" * 50_000, "max_tokens": 2}, "/v1/completions"),
                       ({"model": model, "prompt": "word " * 400_000, "max_tokens": 2}, "/v1/completions")):
        r = _post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert "resulted in at least" in r.json()["error"]["message"]
    assert max(seen, default=0) <= 8 * 512, seen


def test_a_refused_prompt_is_freed_at_once(server, model):
    """A prompt refused as too long is freed with its answer: no error object is left in a reference cycle
    (its traceback's frames hold the prompt) for a cyclic collection that may come much later. The tests
    run with automatic collection off, so a cycle would stay."""
    import gc

    from app.server.core import ApiError
    from engine.types import ContextTooLongError
    gc.collect()
    for path, body in (("/v1/chat/completions", {"model": model, "messages": _msgs("word " * 200_000)}),
                       ("/v1/chat/completions", {"model": model, "messages": _msgs("word " * 700)}),
                       ("/v1/completions", {"model": model, "prompt": "word " * 200_000}),
                       ("/v1/completions", {"model": model, "prompt": "word " * 700}),
                       ("/v1/completions", {"model": model, "prompt": [1] * 600})):
        r = _post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    time.sleep(0.2)
    left = [t.__name__ for t in map(type, gc.get_objects()) if issubclass(t, (ContextTooLongError, ApiError))]
    assert not left, left


def test_sdk_raises_typed_errors(client, model):
    """The SDK's typed errors, with OpenAI's error type: invalid_request_error for an unknown model (code
    model_not_found), not Anthropic's not_found_error."""
    with pytest.raises(openai.NotFoundError) as ei:
        chat(client, "missing-model")
    assert ei.value.type == "invalid_request_error" and ei.value.code == "model_not_found", ei.value.body
    with pytest.raises(openai.NotFoundError) as ei:
        client.get("/no-such-route", cast_to=object)
    assert ei.value.type == "invalid_request_error", ei.value.body
    with pytest.raises(openai.BadRequestError):
        chat(client, model, temperature=7)


def test_tokenize_detokenize_health_metrics_slots(server, model):
    r = _post(server, "/tokenize", {"content": "Hello world"})
    ids = r.json()["tokens"]
    assert ids == server.engine.tokenizer.encode("Hello world", add_special=False)
    assert _post(server, "/detokenize", {"tokens": ids}).json()["content"] == "Hello world"
    assert _post(server, "/detokenize", {"tokens": [10 ** 7]}).status_code == 400
    pieces = _post(server, "/tokenize", {"content": "Hello world", "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == "Hello world"
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    m = httpx.get(server.url + "/metrics").text
    for name in ("hivejet_prompt_tokens_total", "hivejet_generated_tokens_total", "hivejet_tokens_per_second",
                 "hivejet_requests_running", "hivejet_requests_queued", "hivejet_kv_usage_ratio",
                 "hivejet_cached_prompt_tokens_total", "hivejet_draft_acceptance_ratio"):
        assert f"\n{name}" in m or m.startswith(name) or f"# TYPE {name}" in m, name
    s = httpx.get(server.url + "/slots").json()
    assert s["running"] == 0 and s["slots"] == []


def test_client_disconnect_cancels_at_once(server, model):
    eng = server.engine
    body = {"model": model, "messages": _msgs("Write a long story."), "max_tokens": 400, "stream": True,
            "session": "disconnecting-agent"}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            n = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    n += 1
                if n >= 3:
                    break
            seqs = eng.stats()["sequences"]
            assert any(q["session"] == "disconnecting-agent" for q in seqs)
    # non-streaming: the client gives up (timeout) and the engine stops too
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=1.5)
    t0 = time.monotonic()
    while eng.stats()["running"] or eng.stats()["waiting"]:
        assert time.monotonic() - t0 < 5, eng.stats()
        time.sleep(0.05)


def test_sigterm_during_a_stream_sends_an_error_event(smollm2_path, tmp_path):
    """`hivejet serve` stopped by SIGTERM mid-stream: each client (an OpenAI and an Anthropic stream) gets an
    error event saying the server is shutting down (not a stream cut without a word), and the process exits."""
    import signal
    import socket
    import subprocess
    import sys
    import threading
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "app.server", "-m", str(smollm2_path), "--port", str(port),
                             "-c", "512", "--log-level", "warning"], stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while "serving" not in proc.stderr.readline():
            assert proc.poll() is None and time.monotonic() - t0 < 120
        base = f"http://127.0.0.1:{port}"
        model = httpx.get(base + "/v1/models", timeout=60).json()["data"][0]["id"]
        streams = {"/v1/chat/completions": {"model": model, "messages": _msgs("Write a long story."),
                                            "max_tokens": 400, "stream": True},
                   "/v1/messages": {"model": model, "messages": _msgs("Write a long story."), "max_tokens": 400,
                                    "stream": True}}
        lines = {path: [] for path in streams}
        started = threading.Barrier(len(streams) + 1, timeout=120)

        def read(path):
            with httpx.Client(timeout=60) as c, c.stream("POST", base + path, json=streams[path]) as r:
                for line in r.iter_lines():
                    lines[path].append(line)
                    if len(lines[path]) == 6:
                        started.wait()
        readers = [threading.Thread(target=read, args=(path,)) for path in streams]
        for t in readers:
            t.start()
        started.wait()                   # both streams under way
        proc.send_signal(signal.SIGTERM)
        for t in readers:
            t.join(60)
        got = lines["/v1/chat/completions"]
        errors = [json.loads(x[6:])["error"] for x in got if x.startswith("data: {\"error\"")]
        assert errors and "shutting down" in errors[0]["message"], got[-4:]
        got = lines["/v1/messages"]
        events = [json.loads(x[6:]) for x in got if x.startswith("data: {")]
        errors = [e["error"] for e in events if e["type"] == "error"]
        assert errors and "shutting down" in errors[0]["message"], got[-4:]     # Anthropic's error event
        assert events[-1]["type"] == "error" and "message_stop" not in [e["type"] for e in events]
        assert proc.wait(30) in (0, -signal.SIGTERM)      # uvicorn re-raises the signal once stopped
    finally:
        if proc.poll() is None:
            proc.kill()
