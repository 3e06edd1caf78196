"""Anthropic Messages API: POST /v1/messages (and /v1/messages/count_tokens), so the anthropic SDK and Claude
Code work against the local model. A request is translated into the OpenAI chat form and runs through the
same plan (tools, grammars, reasoning); the answer is written back as Anthropic content blocks and events."""
from __future__ import annotations

import json
import secrets

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from pydantic import ValidationError

from app.server import schemas as S
from app.server.core import ApiError, EventStream, SSEResponse, collect, submit, without_traceback
from app.server.openai_api import ChatPlan
from app.server.tools import OutputParser

router = APIRouter()

ERRORS = {400: {"model": S.AnthropicErrorResponse, "description": "bad request"},
          401: {"model": S.AnthropicErrorResponse, "description": "missing or wrong API key"},
          404: {"model": S.AnthropicErrorResponse, "description": "unknown model"},
          413: {"model": S.AnthropicErrorResponse, "description": "request body too large"},
          429: {"model": S.AnthropicErrorResponse, "description": "queue full; retry after Retry-After seconds"},
          500: {"model": S.AnthropicErrorResponse, "description": "generation failed"},
          503: {"model": S.AnthropicErrorResponse, "description": "the model is loading"}}
SSE = {"text/event-stream": {"schema": {"type": "object", "description": "server-sent events"}}}


def _image_url(block: S.AnthropicBlock, where: str) -> str:
    src = block.source
    if src is None:
        raise ApiError(400, f"{where}: an image block needs a source")
    if src.type == "base64":
        if not src.data or not src.media_type:
            raise ApiError(400, f"{where}: a base64 image needs media_type and data")
        return f"data:{src.media_type};base64,{src.data}"
    if not src.url:
        raise ApiError(400, f"{where}: a url image needs url")
    return src.url


def _tool_result_text(block: S.AnthropicBlock) -> str:
    c = block.content
    if c is None:
        text = ""
    elif isinstance(c, str):
        text = c
    else:
        text = "".join(p.get("text", "") for p in c if isinstance(p, dict) and p.get("type") == "text")
    return ("Error: " + text) if block.is_error else text


def to_openai(body: S.MessagesRequest | S.CountTokensRequest) -> dict:
    """The equivalent OpenAI chat request (as a dict)."""
    msgs: list[dict] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "\n\n".join(b.text for b in body.system)
        msgs.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            msgs.append({"role": m.role, "content": m.content})
            continue
        parts, calls, results, reasoning = [], [], [], []
        for j, b in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if b.type == "text":
                parts.append({"type": "text", "text": b.text or ""})
            elif b.type == "image":
                if m.role != "user":
                    raise ApiError(400, f"{where}: images belong in user messages")
                parts.append({"type": "image_url", "image_url": {"url": _image_url(b, where)}})
            elif b.type == "tool_use":
                if m.role != "assistant" or not b.name:
                    raise ApiError(400, f"{where}: tool_use blocks belong in assistant messages and need a name")
                calls.append({"id": b.id or ("toolu_" + secrets.token_hex(12)), "type": "function",
                              "function": {"name": b.name, "arguments": json.dumps(b.input or {}, ensure_ascii=False)}})
            elif b.type == "tool_result":
                if m.role != "user" or not b.tool_use_id:
                    raise ApiError(400, f"{where}: tool_result blocks belong in user messages and need tool_use_id")
                results.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _tool_result_text(b)})
            elif b.type == "thinking":
                reasoning.append(b.thinking or "")
            elif b.type == "redacted_thinking":
                continue
            else:
                raise ApiError(400, f"{where}: content blocks of type {b.type!r} are not supported")
        msgs.extend(results)
        if m.role == "assistant":
            text = "".join(p["text"] for p in parts)
            msg = {"role": "assistant", "content": text or None}
            if calls:
                msg["tool_calls"] = calls
            if reasoning:
                msg["reasoning_content"] = "".join(reasoning)
            if text or calls or reasoning:
                msgs.append(msg)
        elif parts:
            msgs.append({"role": "user", "content": parts})
    out: dict = {"model": body.model, "messages": msgs}
    if body.tools:
        out["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                          "parameters": t.input_schema or {"type": "object"}}}
                        for t in body.tools]
    return out


def _chat_request(body: S.MessagesRequest, request: Request) -> S.ChatCompletionRequest:
    d = to_openai(body)
    d.update(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
             stop=body.stop_sequences)
    tc = body.tool_choice
    if tc is not None and body.tools:
        if tc.type == "tool":
            if not tc.name:
                raise ApiError(400, "tool_choice of type 'tool' needs a name")
            d["tool_choice"] = {"type": "function", "function": {"name": tc.name}}
        else:
            d["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[tc.type]
    if body.thinking is not None:
        d["enable_thinking"] = body.thinking.type != "disabled"
    last = d["messages"][-1] if d["messages"] else None
    if last and last["role"] == "assistant" and last.get("content") and not last.get("tool_calls"):
        d["continue_final_message"] = True    # a prefill: the reply continues it, as Anthropic's API does
    meta = body.metadata or {}
    if isinstance(meta.get("user_id"), str):
        d["user"] = meta["user_id"][:256]
    try:
        return S.ChatCompletionRequest(**{k: v for k, v in d.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        raise ApiError(400, f"{'.'.join(str(x) for x in err.get('loc', ()))}: {err.get('msg')}") from None


def _stop_reason(fin, calls) -> str:
    if calls:
        return "tool_use"
    if fin.reason == "length":
        return "max_tokens"
    if getattr(fin, "stop_string", None):
        return "stop_sequence"
    return "end_turn"


def _usage(fin) -> dict:
    """Anthropic's usage: input_tokens counts the prompt tokens read afresh, without those read from the
    prefix cache (cache_read_input_tokens); their sum is the prompt."""
    u = fin.usage
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def _tool_input(args: str):
    try:
        v = json.loads(args)
        return v if isinstance(v, dict) else {"value": v}
    except ValueError:
        return {}


@router.post("/v1/messages", responses={200: {"model": S.MessagesResponse, "content": SSE}, **ERRORS},
             tags=["anthropic"])
async def messages(body: S.MessagesRequest, request: Request):
    from engine.types import FinishEvent, TokenEvent
    state = request.app.state.hivejet
    plan = await run_in_threadpool(ChatPlan, _chat_request(body, request), state, request)  # may fetch images
    handle = await submit(plan.engine, plan.req)
    mid = "msg_" + secrets.token_hex(12)
    if body.stream:
        stream = EventStream(handle, state)
        return SSEResponse(_stream(plan, stream, handle.n_prompt, mid, body.model), stream)
    stream = EventStream(handle, state)
    events = await collect(stream, request)
    items = []
    for ev in events:
        if isinstance(ev, TokenEvent):
            items += plan.parser.feed(ev.text)
    fin = events[-1]
    items += plan.parser.finish(truncated=fin.reason == "length")
    assert isinstance(fin, FinishEvent)
    plan.raise_for(fin, stream)
    reasoning, text, calls = OutputParser.collect(items)
    content = []
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text or not calls:
        content.append({"type": "text", "text": text})
    for c in calls:
        content.append({"type": "tool_use", "id": "toolu_" + c["id"].removeprefix("call_"), "name": c["name"],
                        "input": _tool_input(c["arguments"])})
    return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": body.model, "content": content,
                         "stop_reason": _stop_reason(fin, calls), "stop_sequence": getattr(fin, "stop_string", None),
                         "usage": _usage(fin)})


_ERROR_TYPES = {400: "invalid_request_error", 503: "overloaded_error"}   # Anthropic's, mid-stream


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _stream(plan: ChatPlan, stream: EventStream, n_prompt: int, mid: str, model: str):
    from engine.types import TokenEvent
    index = -1
    open_kind = None          # "text" | "thinking" while a block is open
    n_calls = 0

    def close_block():
        nonlocal open_kind
        if open_kind is None:
            return ""
        open_kind = None
        return _event("content_block_stop", {"type": "content_block_stop", "index": index})

    def render(items) -> str:
        nonlocal index, open_kind, n_calls
        out = []
        for kind, v in items:
            if kind in ("content", "reasoning"):
                want = "text" if kind == "content" else "thinking"
                if open_kind != want:
                    out.append(close_block())
                    index += 1
                    open_kind = want
                    block = {"type": "text", "text": ""} if want == "text" else {"type": "thinking", "thinking": ""}
                    out.append(_event("content_block_start", {"type": "content_block_start", "index": index,
                                                              "content_block": block}))
                delta = {"type": "text_delta", "text": v} if want == "text" else {"type": "thinking_delta",
                                                                                  "thinking": v}
                out.append(_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                          "delta": delta}))
            else:
                out.append(close_block())
                index += 1
                n_calls += 1
                out.append(_event("content_block_start", {
                    "type": "content_block_start", "index": index,
                    "content_block": {"type": "tool_use", "id": "toolu_" + v["id"].removeprefix("call_"),
                                      "name": v["name"], "input": {}}}))
                out.append(_event("content_block_delta", {
                    "type": "content_block_delta", "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": json.dumps(_tool_input(v["arguments"]))}}))
                out.append(_event("content_block_stop", {"type": "content_block_stop", "index": index}))
        return "".join(out)

    try:
        yield _event("message_start", {"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": n_prompt, "output_tokens": 0, "cache_read_input_tokens": 0,
                      "cache_creation_input_tokens": 0}}})
        yield _event("ping", {"type": "ping"})
        while True:
            ev = await stream.next()
            if isinstance(ev, TokenEvent):
                s = render(plan.parser.feed(ev.text))
                if s:
                    yield s
                continue
            s = render(plan.parser.finish(truncated=ev.reason == "length"))
            try:
                plan.raise_for(ev, stream)
            except ApiError as e:
                s += close_block()
                yield s + _event("error", {"type": "error", "error": {
                    "type": _ERROR_TYPES.get(e.status, "api_error"), "message": e.anthropic_message}})
                return
            if index == -1:
                s += render([("content", "")])   # an empty answer is still one (empty) text block
            s += close_block()
            if s:
                yield s
            yield _event("message_delta", {"type": "message_delta",
                                           "delta": {"stop_reason": _stop_reason(ev, n_calls),
                                                     "stop_sequence": getattr(ev, "stop_string", None)},
                                           "usage": _usage(ev)})
            yield _event("message_stop", {"type": "message_stop"})
            return
    finally:
        stream.close()


@router.post("/v1/messages/count_tokens", response_model=S.CountTokensResponse, responses=ERRORS,
             tags=["anthropic"])
async def count_tokens(body: S.CountTokensRequest, request: Request):
    from engine.types import EngineError, Request as EngineRequest
    state = request.app.state.hivejet
    eng = state.engine_or_503()
    state.check_model(body.model)
    try:
        chat = S.ChatCompletionRequest(**to_openai(body))
    except ValidationError as e:
        err = e.errors()[0]
        raise ApiError(400, f"{'.'.join(str(x) for x in err.get('loc', ()))}: {err.get('msg')}") from None
    plan = await run_in_threadpool(ChatPlan, chat, state, request)
    try:
        ids = await run_in_threadpool(eng.prompt_ids, EngineRequest(messages=plan.req.messages,
                                                                    tools=plan.req.tools,
                                                                    template_kwargs=plan.req.template_kwargs))
    except (EngineError, ValueError) as e:
        raise ApiError(400, str(without_traceback(e))) from None
    return JSONResponse({"input_tokens": len(ids)})
