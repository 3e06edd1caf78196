"""Server pieces that need no model: tool-call formats, reasoning split, security rules, auth, bind rules."""
from __future__ import annotations

import asyncio
import base64
import json

import pytest

from app.server.security import (ImageError, ServerSettings, SettingsError, check_api_key, is_loopback,
                                 load_image)
from app.server.tools import (HERMES, LLAMA3, MISTRAL, OutputParser, detect_format, forced_call_grammar,
                              prepare_messages)

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16


def run_parser(parser: OutputParser, text: str, step: int = 1):
    items = []
    for i in range(0, len(text), step):
        items += parser.feed(text[i:i + step])
    items += parser.finish()
    return OutputParser.collect(items)


# ----------------------------------------------------------------------------------------------- tool formats
def test_detect_format_from_template():
    assert detect_format("...<tool_call>...").name == "hermes"
    assert detect_format("[TOOL_CALLS] ...").name == "mistral"
    assert detect_format("<|python_tag|> ... ipython").name == "llama3"
    f = detect_format(None)
    assert f.name == "hermes" and not f.native


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_hermes_parallel_calls_streamed(step):
    text = ('Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    reasoning, content, calls = run_parser(OutputParser(HERMES), text, step)
    assert content == "Sure. " and reasoning == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("f", {"a": 1}), ("g", {})]
    assert len({c["id"] for c in calls}) == 2


def test_invalid_call_stays_text_and_partial_marker_is_flushed():
    _, content, calls = run_parser(OutputParser(HERMES), "a <tool_call>not json</tool_call> b <tool")
    assert calls == [] and content == "a <tool_call>not json</tool_call> b <tool"


def test_llama3_bare_json_and_mistral_array():
    _, content, calls = run_parser(OutputParser(LLAMA3), ' {"name": "f", "parameters": {"x": "y"}}')
    assert content == "" and calls[0]["name"] == "f" and json.loads(calls[0]["arguments"]) == {"x": "y"}
    _, content, calls = run_parser(OutputParser(LLAMA3), "Hello {not a call}")
    assert content == "Hello {not a call}" and calls == []
    _, _, calls = run_parser(OutputParser(MISTRAL), '[TOOL_CALLS][{"name": "f", "arguments": {}}, '
                                                    '{"name": "g", "arguments": {"k": 2}}]')
    assert [c["name"] for c in calls] == ["f", "g"]
    _, _, calls = run_parser(OutputParser(MISTRAL), '[TOOL_CALLS]get[ARGS]{"k": 2}')
    assert calls[0]["name"] == "get" and json.loads(calls[0]["arguments"]) == {"k": 2}


@pytest.mark.parametrize("step", [1, 5])
def test_reasoning_split(step):
    r, c, _ = run_parser(OutputParser(None, reasoning=True), "<think>I think</think>\nAnswer", step)
    assert (r, c) == ("I think", "Answer")
    # the prompt already opened <think>
    r, c, _ = run_parser(OutputParser(HERMES, reasoning=True, in_reasoning=True), "hmm</think>Done", step)
    assert (r, c) == ("hmm", "Done")
    r, c, _ = run_parser(OutputParser(None, reasoning=False), "<think>x</think>y", step)
    assert (r, c) == ("", "<think>x</think>y")


def test_prepare_messages_for_template_without_tools():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "!"}]},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    out, out_tools = prepare_messages(msgs, tools, detect_format(None), None)
    assert out_tools is None
    assert out[0]["role"] == "system" and "<tools>" in out[0]["content"]
    assert out[1] == {"role": "user", "content": "hi!"}
    assert "<tool_call>" in out[2]["content"] and '"a": 1' in out[2]["content"]
    assert out[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}


def test_forced_call_grammar_compiles():
    llg = pytest.importorskip("llguidance")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g"}}]
    for fmt in (HERMES, LLAMA3, MISTRAL):
        for only in (None, "f"):
            g = forced_call_grammar(fmt, tools, only)
            assert llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_lark(g)) == "", g


# ----------------------------------------------------------------------------------------------- security
def test_loopback_and_bind_rules():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.3.4.5")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2") and not is_loopback("::")
    ServerSettings(host="127.0.0.1").validate()
    with pytest.raises(SettingsError, match="API key"):
        ServerSettings(host="0.0.0.0").validate()
    ServerSettings(host="0.0.0.0", api_keys=["s3cret-key-1"]).validate()
    with pytest.raises(SettingsError):
        ServerSettings(host="0.0.0.0", api_keys=["short"]).validate()


def test_check_api_key_uses_compare_digest(monkeypatch):
    import hmac
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    assert check_api_key("key-number-2", ["key-number-1", "key-number-2"])
    assert len(calls) == 2  # every key is compared, no early exit
    assert not check_api_key("wrong", ["key-number-1"])
    assert not check_api_key(None, ["key-number-1"]) and not check_api_key("", ["key-number-1"])
    assert check_api_key(None, [])


def test_load_image_rules(tmp_path):
    s = ServerSettings()
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert load_image(url, s) == PNG
    for bad in ("data:image/png;base64,@@@", "data:image/png," + "abc",
                "data:image/png;base64," + base64.b64encode(b"not an image").decode(),
                "http://example.com/cat.png", "file:///etc/passwd", "ftp://x/y.png", ""):
        with pytest.raises(ImageError):
            load_image(bad, s)
    media = tmp_path / "media"
    media.mkdir()
    (media / "a.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    s = ServerSettings(media_dir=str(media))
    assert load_image(f"file://{media}/a.png", s) == PNG
    for bad in (f"file://{tmp_path}/secret.png", f"file://{media}/../secret.png", f"file://{media}/missing.png"):
        with pytest.raises(ImageError):
            load_image(bad, s)
    with pytest.raises(ImageError, match="disabled"):
        load_image("https://example.com/a.png", ServerSettings())


# ----------------------------------------------------------------------------------------------- HTTP without a model
LAST_CALL: dict = {}   # what the last _call saw (pieces_read: body pieces the app asked for)


async def _call(app, method, path, headers=None, body=None, chunk: int = 0):
    """One request through the ASGI app (no network, no engine). chunk > 0: the body arrives in pieces of
    that size with no Content-Length (Transfer-Encoding: chunked)."""
    sent = {"status": None, "headers": {}, "body": b"", "pieces_read": 0}
    payload = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else b"")
    hdrs = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if not chunk:
        hdrs.append((b"content-length", str(len(payload)).encode()))
    else:
        hdrs.append((b"transfer-encoding", b"chunked"))
    if body is not None:
        hdrs.append((b"content-type", b"application/json"))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "headers": hdrs, "scheme": "http",
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 5000), "root_path": ""}
    done = False

    pieces = [payload[i:i + chunk] for i in range(0, len(payload), chunk)] if chunk else [payload]

    async def receive():
        nonlocal done
        if not done:
            sent["pieces_read"] += 1
            piece = pieces.pop(0)
            done = not pieces
            return {"type": "http.request", "body": piece, "more_body": not done}
        await asyncio.sleep(3600)

    async def send(msg):
        if msg["type"] == "http.response.start":
            sent["status"] = msg["status"]
            sent["headers"] = {k.decode(): v.decode() for k, v in msg["headers"]}
        elif msg["type"] == "http.response.body":
            sent["body"] += msg.get("body", b"")

    await app(scope, receive, send)
    LAST_CALL.clear()
    LAST_CALL.update(sent)
    return sent["status"], sent["headers"], sent["body"]


def call(app, method, path, headers=None, body=None, chunk: int = 0):
    status, headers, raw = asyncio.run(_call(app, method, path, headers, body, chunk))
    try:
        return status, headers, json.loads(raw)
    except ValueError:
        return status, headers, raw.decode()


def test_auth_required_on_every_api_route_and_health_503_while_loading():
    from app.server.app import create_app
    app = create_app(None, ServerSettings(host="0.0.0.0", api_keys=["the-right-key"]))
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
    for method, path, b in (("GET", "/v1/models", None), ("POST", "/v1/chat/completions", body),
                            ("POST", "/v1/completions", {"model": "x", "prompt": "a"}), ("GET", "/metrics", None),
                            ("GET", "/slots", None), ("POST", "/tokenize", {"content": "a"})):
        status, headers, err = call(app, method, path, body=b)
        assert status == 401 and err["error"]["type"] == "invalid_request_error", path   # OpenAI's type
        assert err["error"]["code"] == "invalid_api_key"
        status, _, err = call(app, method, path, headers={"Authorization": "Bearer wrong-key"}, body=b)
        assert status == 401
    status, _, err = call(app, "POST", "/v1/messages", body={"model": "x", "max_tokens": 1,
                                                              "messages": [{"role": "user", "content": "hi"}]})
    assert status == 401 and err == {"type": "error", "error": {"type": "authentication_error",
                                                                 "message": err["error"]["message"]}}
    # the right key (either header) gets through to "still loading"
    status, headers, err = call(app, "GET", "/v1/models", headers={"Authorization": "Bearer the-right-key"})
    assert status == 503 and "error" in err and headers.get("retry-after")
    status, _, _ = call(app, "POST", "/v1/messages", headers={"x-api-key": "the-right-key"},
                        body={"model": "x", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 503
    status, _, err = call(app, "GET", "/health")
    assert status == 503 and err["error"]["type"] == "server_error"


def test_body_limit_cors_and_unknown_route():
    from app.server.app import create_app
    app = create_app(None, ServerSettings(max_body_bytes=2048, cors_origins=["http://ok.example"]))
    status, _, err = call(app, "POST", "/v1/chat/completions", body={"model": "x", "pad": "a" * 5000,
                                                                      "messages": [{"role": "user", "content": "hi"}]})
    assert status == 413 and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["code"] == "request_too_large"
    status, headers, _ = call(app, "OPTIONS", "/v1/chat/completions",
                              headers={"Origin": "http://ok.example", "Access-Control-Request-Method": "POST"})
    assert status == 200 and headers.get("access-control-allow-origin") == "http://ok.example"
    status, headers, _ = call(app, "OPTIONS", "/v1/chat/completions",
                              headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert headers.get("access-control-allow-origin") is None
    status, _, err = call(app, "GET", "/nope")
    assert status == 404 and "error" in err
    # CORS is off by default
    app = create_app(None, ServerSettings())
    _, headers, _ = call(app, "GET", "/health", headers={"Origin": "http://ok.example"})
    assert "access-control-allow-origin" not in headers


def test_chunked_body_over_the_limit_is_413_while_it_arrives():
    """A chunked body (no Content-Length) is counted as it arrives and refused with 413 as soon as it passes
    the limit: the rest is not read and nothing parses it."""
    from app.server.app import create_app
    app = create_app(None, ServerSettings(max_body_bytes=4096))
    big = json.dumps({"model": "x", "pad": "a" * 40_000, "messages": [{"role": "user", "content": "hi"}]}).encode()
    status, _, err = call(app, "POST", "/v1/chat/completions", body=big, chunk=1000)
    assert status == 413 and err["error"]["code"] == "request_too_large", err
    assert LAST_CALL["pieces_read"] == 5          # 5 x 1000 bytes > 4096: refused there, not at the end
    status, _, err = call(app, "POST", "/v1/messages", body=big, chunk=1000)
    assert status == 413 and err["type"] == "error" and err["error"]["type"] == "request_too_large"
    # a chunked body within the limit reaches the route whole (here: 503, no model loaded)
    ok = json.dumps({"model": "x", "messages": [{"role": "user", "content": "hi"}]}).encode()
    status, _, err = call(app, "POST", "/v1/chat/completions", body=ok, chunk=7)
    assert status == 503, err


def test_body_of_too_many_json_values_is_refused_before_parsing():
    """Many small objects cost tens of times their bytes once parsed and validated: a body with more than
    max_json_values objects and arrays is refused unparsed; brackets inside strings do not count."""
    from app.server.app import create_app
    from app.server.security import json_counts
    text = json.dumps({"a": [1, {"b": 'x{[",\\'}], "c": '{{{\\",', "d": []}).encode()
    assert json_counts(text) == (4, 7)            # 4 objects and arrays; 6 values, counted as 3 commas + 4
    assert json_counts(text, block=3) == (4, 7)   # counted a block at a time, strings across blocks
    app = create_app(None, ServerSettings(max_json_values=50))
    msgs = [{"role": "user", "content": "hi"}] * 60
    status, _, err = call(app, "POST", "/v1/chat/completions", body={"model": "x", "messages": msgs})
    assert status == 413 and "62" in err["error"]["message"] and "JSON objects" in err["error"]["message"], err
    code = "{[" * 100        # brackets in a string are text, not values
    status, _, err = call(app, "POST", "/v1/chat/completions", body={"model": "x", "messages": [
        {"role": "user", "content": code}]})
    assert status == 503, err


def test_body_of_too_many_json_values_in_arrays_is_refused_before_parsing():
    """A token-id list (or a stop list) of millions of entries costs tens of bytes an entry once parsed and
    validated, gigabytes for a 31 MB body: more than max_json_items values is refused unparsed (413);
    commas inside strings do not count."""
    from app.server.app import create_app
    app = create_app(None, ServerSettings(max_json_items=1000))
    status, _, err = call(app, "POST", "/v1/completions", body={"model": "x", "prompt": [12345] * 2000})
    assert status == 413 and err["error"]["code"] == "request_too_large", err
    assert "2,00" in err["error"]["message"] and "JSON values" in err["error"]["message"], err
    status, _, err = call(app, "POST", "/v1/messages", body={"model": "x", "max_tokens": 1, "stop_sequences": ["a"] * 2000,
                                                              "messages": [{"role": "user", "content": "hi"}]})
    assert status == 413 and err["error"]["type"] == "request_too_large", err
    for body in ({"model": "x", "prompt": [12345] * 900}, {"model": "x", "prompt": "a, " * 5000}):
        status, _, err = call(app, "POST", "/v1/completions", body=body)
        assert status == 503, err                 # within the limits: reaches the route (no model loaded)


@pytest.mark.parametrize("host,keys,allowed,status", [
    ("127.0.0.1:18080", [], [], 503), ("localhost:18080", [], [], 503), ("[::1]:18080", [], [], 503),
    ("LOCALHOST", [], [], 503), (None, [], [], 503),
    ("evil.example", [], [], 403), ("evil.example:18080", [], [], 403), ("127.0.0.1.evil.example", [], [], 403),
    ("my-box.lan:18080", [], ["my-box.lan"], 503), ("anything.example", [], ["*"], 503),
    ("evil.example", ["the-right-key"], [], 503),                # a key guards it: any name
    ("evil.example", ["the-right-key"], ["my-box.lan"], 403),     # unless names are given
])
def test_host_header_check(host, keys, allowed, status):
    """DNS rebinding: a keyless server answers only requests addressed to a loopback name (or a configured
    one)."""
    from app.server.app import create_app
    app = create_app(None, ServerSettings(api_keys=keys, allowed_hosts=allowed))
    headers = {"Authorization": "Bearer the-right-key"} if keys else {}
    if host is not None:
        headers["Host"] = host
    got, _, err = call(app, "GET", "/v1/models", headers=headers)
    assert got == status, err
    if status == 403:
        assert err["error"]["code"] == "host_not_allowed" and "--allowed-hosts" in err["error"]["message"]
        got, _, err = call(app, "POST", "/v1/messages", headers=headers,
                           body={"model": "x", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
        assert got == 403 and err["error"]["type"] == "permission_error"


def test_allowed_hosts_option():
    import argparse

    from app.server import add_serve_args, settings_from_args
    p = argparse.ArgumentParser()
    add_serve_args(p)
    s = settings_from_args(p.parse_args(["--allowed-hosts", "a.lan,b.lan", "--allowed-hosts", "c.lan"]))
    assert s.allowed_hosts == ["a.lan", "b.lan", "c.lan"]
    with pytest.raises(SettingsError):
        ServerSettings(allowed_hosts=["http://a.lan/"]).validate()


def test_openai_error_types_are_openais():
    """The OpenAI routes write OpenAI's error types: invalid_request_error for client errors (401, 404, 413
    included; `code` tells them apart), "requests" for 429, server_error for 5xx."""
    from app.server.core import ApiError, error_body
    assert ApiError(404, "x").type == "invalid_request_error"
    assert ApiError(401, "x").type == "invalid_request_error"
    assert ApiError(429, "x").type == "requests" and ApiError(503, "x").type == "server_error"
    assert error_body("/v1/messages", 404, "x")["error"]["type"] == "not_found_error"   # Anthropic's own


def test_serve_refuses_public_bind_without_key(capsys, monkeypatch):
    import argparse

    from app.server import add_serve_args, run_serve
    monkeypatch.delenv("HIVEJET_API_KEY", raising=False)
    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert run_serve(p.parse_args(["--host", "0.0.0.0"])) == 2
    assert "API key" in capsys.readouterr().err
    assert run_serve(p.parse_args(["--cache-type-k", "turbo5"])) == 2
    assert "unknown KV cache type" in capsys.readouterr().err
    for bad in ("100", "-16"):
        assert run_serve(p.parse_args(["--prefill-chunk", bad])) == 2
        assert "--prefill-chunk" in capsys.readouterr().err


def test_serve_shared_passes_switch():
    """--no-shared-passes turns off the GPU path's shared prompt passes (EngineConfig.shared_prompt_passes)."""
    import argparse

    from app.server import add_serve_args
    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args([]).shared_passes is True
    assert p.parse_args(["--no-shared-passes"]).shared_passes is False
