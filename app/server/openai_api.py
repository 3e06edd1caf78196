"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import secrets
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from app.server import schemas as S
from app.server.core import (ApiError, EventStream, ServerState, SSEResponse, collect, constraint_error,
                             constraint_failure, overflow_error, sampling_params, session_of, submit, token_piece,
                             without_traceback)
from app.server.grammar import GrammarConstraint, GrammarError, json_schema_grammar
from app.server.security import ImageError, load_image
from app.server.tools import OutputParser, forced_call_grammar, prepare_messages

router = APIRouter()

ERRORS = {400: {"model": S.ErrorResponse, "description": "bad request"},
          401: {"model": S.ErrorResponse, "description": "missing or wrong API key"},
          404: {"model": S.ErrorResponse, "description": "unknown model"},
          413: {"model": S.ErrorResponse, "description": "request body too large"},
          429: {"model": S.ErrorResponse, "description": "queue full; retry after Retry-After seconds"},
          500: {"model": S.ErrorResponse, "description": "generation failed"},
          503: {"model": S.ErrorResponse, "description": "the model is loading"}}
SSE = {"text/event-stream": {"schema": {"type": "object", "description": "server-sent events"}}}


def _state(request: Request) -> ServerState:
    return request.app.state.hivejet


def _usage(fin) -> dict:
    u = fin.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _chat_logprobs(engine, lps) -> list[dict]:
    out = []
    for lp in lps:
        tok, b = token_piece(engine, lp.token_id)
        top = []
        for tid, v in lp.top:
            t, tb = token_piece(engine, tid)
            top.append({"token": t, "logprob": v, "bytes": tb})
        out.append({"token": tok, "logprob": lp.logprob, "bytes": b, "top_logprobs": top})
    return out


def _check_images(messages: list[dict], state: ServerState) -> int:
    n = 0
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if part.get("type") == "image_url":
                url = part.get("image_url", {}).get("url", "")
                try:
                    data = load_image(url, state.settings, where=f"messages[{i}].content[{j}]")
                except ImageError as e:
                    raise ApiError(400, str(e), param=f"messages[{i}].content[{j}]", code="invalid_image") from None
                if not url.startswith("data:"):  # a media-folder file or a fetched URL: the engine gets the bytes
                    part["image_url"] = {**part["image_url"], "url": "data:image;base64,"
                                         + base64.b64encode(data).decode()}
                n += 1
    if n and not state.info()["vision"]:
        raise ApiError(400, f"the loaded model ({state.model_id()}) does not accept images",
                       param="messages", code="images_not_supported")
    return n


def _template_kwargs(body: S.ChatCompletionRequest, messages: list[dict]) -> dict:
    """The chat template's extra variables a request sets (enable_thinking, continue_final_message, ...)."""
    kwargs = {}
    if body.chat_template_kwargs:
        for k in body.chat_template_kwargs:
            if k in ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token"):
                raise ApiError(400, f"chat_template_kwargs may not set {k!r}", param="chat_template_kwargs")
        kwargs.update(body.chat_template_kwargs)
    if body.enable_thinking is not None:
        kwargs["enable_thinking"] = body.enable_thinking
    if body.reasoning_effort == "none":
        kwargs["enable_thinking"] = False
    if body.continue_final_message:
        if messages[-1].get("role") != "assistant":
            raise ApiError(400, "continue_final_message needs an assistant message last", param="messages")
        kwargs["continue_final_message"] = True
    return kwargs


def _refuse_surely_too_long(eng, messages) -> None:
    """A prompt whose message texts alone cannot fit the context is refused before it is copied, rendered
    and tokenized (a 30 MB body would otherwise take hundreds of MB and seconds to refuse)."""
    from engine.types import ContextTooLongError
    n = 0
    for m in messages:
        c = m.content
        if isinstance(c, str):
            n += len(c)
        elif c:
            n += sum(len(p.text) for p in c if getattr(p, "type", None) == "text")
    try:
        eng.check_prompt_chars(n)
    except ContextTooLongError as e:
        raise overflow_error(without_traceback(e), "messages") from None


def _finish_reason(fin, calls) -> str:
    if fin.reason == "length":
        return "length"
    return "tool_calls" if calls else "stop"


def _tool_choice(body: S.ChatCompletionRequest):
    """(tools as dicts or None, whether to parse tool calls, the tool that tool_choice forces or None)."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice
    forced_name = None
    parse_tools = bool(tools)
    if choice is not None and not tools and choice != "none":
        raise ApiError(400, "tool_choice needs tools", param="tool_choice")
    if choice == "none":
        tools, parse_tools = None, False
    elif isinstance(choice, S.NamedToolChoice):
        forced_name = choice.function.name
        if forced_name not in [t["function"]["name"] for t in tools]:
            raise ApiError(400, f"tool_choice names {forced_name!r}, which is not in tools", param="tool_choice")
    return tools, parse_tools, forced_name


def _output_grammar(body: S.ChatCompletionRequest, fmt, tools, forced_name):
    """The grammar the output must follow: a forced tool call, else response_format's JSON (None for
    plain text)."""
    if tools and (body.tool_choice == "required" or forced_name):
        return forced_call_grammar(fmt, tools, forced_name)
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise ApiError(400, "response_format json_schema needs json_schema.schema", param="response_format")
        schema = rf.json_schema.schema_
    else:
        schema = None
    try:
        return json_schema_grammar(schema)
    except GrammarError as e:
        raise ApiError(400, str(e), param="response_format") from None


def _opens_in_reasoning(eng, prompt_messages, prompt_tools, kwargs) -> bool:
    """True when the rendered prompt ends inside an open <think> block (the reply starts with reasoning)."""
    try:
        rendered = eng.render_chat(prompt_messages, True, prompt_tools, **kwargs)
    except Exception as e:
        raise ApiError(400, str(e), param="messages") from None
    return rendered.rstrip().endswith("<think>")


class ChatPlan:
    """Everything decided about a chat request before it runs."""

    def __init__(self, body: S.ChatCompletionRequest, state: ServerState, request: Request):
        from engine.types import Request as EngineRequest
        eng = state.engine_or_503()
        state.check_model(body.model)
        _refuse_surely_too_long(eng, body.messages)
        info = state.info()
        fmt = info["tool_format"]
        messages = [m.model_dump(exclude_none=True, by_alias=True) for m in body.messages]
        _check_images(messages, state)
        tools, parse_tools, forced_name = _tool_choice(body)
        if body.n not in (None, 1):
            raise ApiError(400, "only n=1 is supported", param="n")
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")

        kwargs = _template_kwargs(body, messages)
        forced_call = bool(tools and (body.tool_choice == "required" or forced_name))
        grammar = _output_grammar(body, fmt, tools, forced_name)
        constraint = None
        if grammar is not None:
            kwargs.setdefault("enable_thinking", False)
            try:
                constraint = GrammarConstraint(eng.tokenizer, grammar)
            except GrammarError as e:
                raise ApiError(400, str(e), param="response_format" if not tools else "tools") from None

        src = info["template_source"]
        prompt_messages, prompt_tools = prepare_messages(messages, tools, fmt, src)
        in_reasoning = bool(info["reasoning"]) and grammar is None and _opens_in_reasoning(
            eng, prompt_messages, prompt_tools, kwargs)
        self.parser = OutputParser(fmt if parse_tools else None, reasoning=info["reasoning"] and grammar is None,
                                   in_reasoning=in_reasoning)
        max_tokens = body.max_completion_tokens or body.max_tokens
        sp = sampling_params(engine=eng, settings=state.settings, max_tokens=max_tokens,
                             temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                             seed=body.seed, presence_penalty=body.presence_penalty,
                             frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                             repeat_last_n=body.repeat_last_n, logit_bias=body.logit_bias, stop=body.stop,
                             ignore_eos=body.ignore_eos,
                             logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        self.engine = eng
        self.constraint_param = "tools" if forced_call else "response_format"
        self.req = EngineRequest(messages=prompt_messages, tools=prompt_tools, sampling=sp,
                                 session=session_of(request, body.session, body.user),
                                 template_kwargs=kwargs, constraint=constraint)
        self.logprobs = bool(body.logprobs)
        self.model = state.model_id()
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.created = int(time.time())

    def raise_for(self, fin, stream: EventStream) -> None:
        raise_for_finish(fin, stream, self.req.constraint, self.constraint_param)


def raise_for_finish(fin, stream: EventStream, constraint=None, param: str = "response_format") -> None:
    """An ApiError for a generation that did not end well: failed, cancelled (the server stopping, or the
    client gone), or a constrained output that could not be completed."""
    if fin.reason == "error":
        raise ApiError(500, f"generation failed: {fin.error}")
    if fin.reason == "cancelled":
        raise ApiError(503, stream.cancelled_message())
    why = constraint_failure(constraint, fin)
    if why:
        raise constraint_error(why, param)


@router.post("/v1/chat/completions", responses={200: {"model": S.ChatCompletionResponse, "content": SSE}, **ERRORS},
             tags=["openai"])
async def chat_completions(body: S.ChatCompletionRequest, request: Request):
    from engine.types import FinishEvent, TokenEvent
    state = _state(request)
    plan = await run_in_threadpool(ChatPlan, body, state, request)   # may fetch remote images
    handle = await submit(plan.engine, plan.req)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = EventStream(handle, state)
        return SSEResponse(_chat_stream(plan, stream, include_usage), stream)
    stream = EventStream(handle, state)
    events = await collect(stream, request)
    items, lps = [], []
    for ev in events:
        if isinstance(ev, TokenEvent):
            items += plan.parser.feed(ev.text)
            if ev.logprobs:
                lps += ev.logprobs
    fin = events[-1]
    items += plan.parser.finish(truncated=fin.reason == "length")
    assert isinstance(fin, FinishEvent)
    plan.raise_for(fin, stream)
    reasoning, content, calls = OutputParser.collect(items)
    message = {"role": "assistant", "content": content if (content or not calls) else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    choice = {"index": 0, "message": message, "finish_reason": _finish_reason(fin, calls),
              "logprobs": {"content": _chat_logprobs(plan.engine, lps)} if plan.logprobs else None}
    return JSONResponse({"id": plan.id, "object": "chat.completion", "created": plan.created, "model": plan.model,
                         "system_fingerprint": "hivejet", "choices": [choice], "usage": _usage(fin)})


async def _chat_stream(plan: ChatPlan, stream: EventStream, include_usage: bool):
    from engine.types import FinishEvent, TokenEvent
    base = {"id": plan.id, "object": "chat.completion.chunk", "created": plan.created, "model": plan.model,
            "system_fingerprint": "hivejet"}
    if include_usage:
        base["usage"] = None

    def chunk(delta, finish=None, logprobs=None):
        return _sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})

    n_calls = 0

    def render(items, lps=None):
        nonlocal n_calls
        out = []
        for kind, v in items:
            if kind == "content":
                out.append(chunk({"content": v}, logprobs=lps))
                lps = None
            elif kind == "reasoning":
                out.append(chunk({"reasoning_content": v}, logprobs=lps))
                lps = None
            else:
                out.append(chunk({"tool_calls": [{"index": n_calls, "id": v["id"], "type": "function",
                                                  "function": {"name": v["name"], "arguments": v["arguments"]}}]}))
                n_calls += 1
        if lps:
            out.append(chunk({}, logprobs=lps))
        return "".join(out)

    try:
        yield chunk({"role": "assistant", "content": ""})
        while True:
            ev = await stream.next()
            if isinstance(ev, TokenEvent):
                lps = {"content": _chat_logprobs(plan.engine, ev.logprobs)} if (plan.logprobs and ev.logprobs) else None
                s = render(plan.parser.feed(ev.text), lps)
                if s:
                    yield s
                continue
            assert isinstance(ev, FinishEvent)
            s = render(plan.parser.finish(truncated=ev.reason == "length"))
            if s:
                yield s
            try:
                plan.raise_for(ev, stream)
            except ApiError as e:
                yield _sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
            else:
                yield chunk({}, finish="tool_calls" if n_calls else ("length" if ev.reason == "length" else "stop"))
            if include_usage:
                yield _sse({**base, "choices": [], "usage": _usage(ev)})
            yield "data: [DONE]\n\n"
            return
    finally:
        stream.close()


# ----------------------------------------------------------------------------------------------- completions
def _completion_logprobs(engine, lps, start_offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    off = start_offset
    for lp in lps:
        t, _ = token_piece(engine, lp.token_id)
        tokens.append(t)
        token_lps.append(lp.logprob)
        tops.append({token_piece(engine, tid)[0]: v for tid, v in lp.top} if lp.top else None)
        offsets.append(off)
        off += len(t)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


MAX_PROMPTS = 64


def _prompt_list(prompt) -> list:
    """The prompts of a /v1/completions request, as OpenAI takes them: a string, a list of token ids, a list
    of strings or a list of token-id lists (one choice each)."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt is empty", param="prompt")
    if len(prompt) > MAX_PROMPTS:
        raise ApiError(400, f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}", param="prompt")
    return list(prompt)


class _Group:
    """The EventStreams of one request's prompts: close() cancels them all."""

    def __init__(self, streams):
        self.streams = streams

    def close(self) -> None:
        for s in self.streams:
            s.close()


async def _merged(streams):
    """(index, event) from several EventStreams as they come, until each has finished."""
    from engine.types import FinishEvent
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, st):
        while True:
            ev = await st.next()
            await queue.put((i, ev))
            if isinstance(ev, FinishEvent):
                return

    tasks = [asyncio.ensure_future(pump(i, st)) for i, st in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, ev = await queue.get()
            left -= isinstance(ev, FinishEvent)
            yield i, ev
    finally:
        for t in tasks:
            t.cancel()


@router.post("/v1/completions", responses={200: {"model": S.CompletionResponse, "content": SSE}, **ERRORS},
             tags=["openai"])
async def completions(body: S.CompletionRequest, request: Request):
    from engine.types import Request as EngineRequest
    state = _state(request)
    eng = state.engine_or_503()
    state.check_model(body.model)
    if body.n not in (None, 1):
        raise ApiError(400, "only n=1 is supported", param="n")
    if body.suffix:
        raise ApiError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
    prompts = _prompt_list(body.prompt)
    grammar = None
    if body.response_format is not None and body.response_format.type != "text":
        rf = body.response_format
        schema = rf.json_schema.schema_ if (rf.type == "json_schema" and rf.json_schema) else None
        try:
            grammar = json_schema_grammar(schema)
            GrammarConstraint(eng.tokenizer, grammar)
        except GrammarError as e:
            raise ApiError(400, str(e), param="response_format") from None
    session = session_of(request, body.session, body.user)
    reqs = []
    for p in prompts:
        sp = sampling_params(engine=eng, settings=state.settings, max_tokens=body.max_tokens or 16,
                             temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                             seed=body.seed, presence_penalty=body.presence_penalty,
                             frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                             repeat_last_n=body.repeat_last_n, logit_bias=body.logit_bias, stop=body.stop,
                             ignore_eos=body.ignore_eos, logprobs=body.logprobs)
        constraint = GrammarConstraint(eng.tokenizer, grammar) if grammar is not None else None
        text = isinstance(p, str)
        reqs.append(EngineRequest(prompt=p if text else None, prompt_ids=None if text else list(p), sampling=sp,
                                  session=session, constraint=constraint))
    handles = []
    try:
        for req in reqs:
            handles.append(await submit(eng, req))
    except ApiError:
        for h in handles:
            h.cancel()
        raise
    echoes = [((p if isinstance(p, str) else eng.tokenizer.decode(p)) if body.echo else "") for p in prompts]
    streams = [EventStream(h, state) for h in handles]
    reply = _Completion(body, state, eng, reqs, echoes)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        group = _Group(streams)
        return SSEResponse(reply.stream(streams, include_usage), group)
    return JSONResponse(await reply.collect(streams, request))


class _Completion:
    """Writes a /v1/completions answer: one choice per prompt, by index."""

    def __init__(self, body: S.CompletionRequest, state: ServerState, eng, reqs, echoes: list[str]):
        self.eng, self.reqs, self.echoes = eng, reqs, echoes
        self.want_lp = body.logprobs is not None
        self.base = {"id": "cmpl-" + secrets.token_hex(12), "object": "text_completion",
                     "created": int(time.time()), "model": state.model_id()}

    def _check(self, i: int, fin, stream) -> None:
        raise_for_finish(fin, stream, self.reqs[i].constraint)

    @staticmethod
    def _usage(fins) -> dict:
        p = sum(f.usage.prompt_tokens for f in fins)
        c = sum(f.usage.completion_tokens for f in fins)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": sum(f.usage.cached_tokens for f in fins)}}

    async def collect(self, streams, request) -> dict:
        from engine.types import FinishEvent, TokenEvent
        group = _Group(streams)

        async def watch():
            while True:
                if (await request.receive())["type"] == "http.disconnect":
                    group.close()
                    return

        watcher = asyncio.ensure_future(watch())
        events = [[] for _ in streams]
        try:
            async for i, ev in _merged(streams):
                events[i].append(ev)
        finally:
            watcher.cancel()
            group.close()
        choices, fins = [], []
        for i, evs in enumerate(events):
            fin = evs[-1]
            assert isinstance(fin, FinishEvent)
            self._check(i, fin, streams[i])
            fins.append(fin)
            text = "".join(ev.text for ev in evs if isinstance(ev, TokenEvent))
            lps = [lp for ev in evs if isinstance(ev, TokenEvent) for lp in (ev.logprobs or [])]
            choices.append({"index": i, "text": self.echoes[i] + text, "finish_reason": fin.reason,
                            "logprobs": _completion_logprobs(self.eng, lps, len(self.echoes[i]))
                            if self.want_lp else None})
        return {**self.base, "choices": choices, "usage": self._usage(fins)}

    async def stream(self, streams, include_usage: bool):
        from engine.types import TokenEvent
        base = self.base
        offsets = [len(e) for e in self.echoes]
        fins: list = []
        failed = False
        try:
            for i, echo in enumerate(self.echoes):
                if echo:
                    yield _sse({**base, "choices": [{"index": i, "text": echo, "logprobs": None,
                                                     "finish_reason": None}]})
            async with contextlib.aclosing(_merged(streams)) as merged:
                async for i, ev in merged:
                    if isinstance(ev, TokenEvent):
                        lp = _completion_logprobs(self.eng, ev.logprobs or [], offsets[i]) if self.want_lp else None
                        offsets[i] += len(ev.text)
                        yield _sse({**base, "choices": [{"index": i, "text": ev.text, "logprobs": lp,
                                                         "finish_reason": None}]})
                        continue
                    fins.append(ev)
                    try:
                        self._check(i, ev, streams[i])
                    except ApiError as e:    # the first failure ends the whole answer
                        failed = True
                        yield _sse({"error": {"message": e.message, "type": e.type, "param": e.param,
                                              "code": e.code}})
                        break
                    yield _sse({**base, "choices": [{"index": i, "text": "", "logprobs": None,
                                                     "finish_reason": ev.reason}]})
            if include_usage and not failed:
                yield _sse({**base, "choices": [], "usage": self._usage(fins)})
            yield "data: [DONE]\n\n"
        finally:
            _Group(streams).close()


@router.get("/v1/models", response_model=S.ModelList, responses=ERRORS, tags=["openai"])
async def list_models(request: Request):
    state = _state(request)
    state.engine_or_503()
    return JSONResponse({"object": "list", "data": [_card(state)]})


@router.get("/v1/models/{model_id:path}", response_model=S.ModelCard, responses=ERRORS, tags=["openai"])
async def get_model(model_id: str, request: Request):
    state = _state(request)
    state.engine_or_503()
    state.check_model(model_id)
    return JSONResponse(_card(state))


def _card(state: ServerState) -> dict:
    eng, info = state.engine, state.info()
    tpl = eng.template
    return {"id": state.model_id(), "object": "model", "created": int(state.started), "owned_by": "hivejet",
            "context_length": eng.ctx_size,
            "capabilities": {"tools": True, "vision": info["vision"], "reasoning": info["reasoning"],
                             "json_schema": True},
            "chat_template": f"fallback:{tpl.name}" if tpl.is_fallback else "gguf"}
