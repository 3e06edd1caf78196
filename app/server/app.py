"""The FastAPI application: create_app(engine, settings), the shared routes (/health, /metrics, /slots,
/tokenize, /detokenize), error handling in the OpenAI/Anthropic shapes, API-key checks, CORS and the body
size limit; and ServerThread, which runs it under uvicorn in a background thread (the app's toggle, tests)."""
from __future__ import annotations

import logging
import socket
import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.server import schemas as S
from app.server.core import ApiError, ServerState, error_body, is_anthropic_path
from app.server.metrics import Metrics
from app.server.security import BodySizeLimit, ServerSettings, check_api_key, host_refusal, key_from_headers

log = logging.getLogger("hivejet.server")

PUBLIC_PATHS = {"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
KNOWN_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages/count_tokens", "/v1/messages",
                "/v1/models", "/health", "/metrics", "/slots", "/tokenize", "/detokenize")
ERRORS = {400: {"model": S.ErrorResponse, "description": "bad request"},
          401: {"model": S.ErrorResponse, "description": "missing or wrong API key"},
          503: {"model": S.ErrorResponse, "description": "the model is loading"}}


def _route_of(path: str) -> str:
    for r in KNOWN_ROUTES:
        if path == r or path.startswith(r + "/"):
            return r
    return "other"


class AuthAndMetrics:
    """ASGI middleware: API-key check (Authorization: Bearer KEY or x-api-key: KEY) and per-route counts."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        status_seen = [0]

        async def tracking_send(msg):
            if msg["type"] == "http.response.start":
                status_seen[0] = msg["status"]
            await send(msg)

        try:
            from starlette.datastructures import Headers
            refusal = host_refusal(Headers(scope=scope).get("host"), self.state.settings)
            if refusal:
                resp = JSONResponse(error_body(path, 403, refusal, code="host_not_allowed"), status_code=403)
                return await resp(scope, receive, tracking_send)
            keys = self.state.settings.api_keys
            public = path in PUBLIC_PATHS and (path != "/health" or self.state.settings.public_health)
            if keys and not public and scope.get("method") != "OPTIONS" \
                    and not check_api_key(key_from_headers(Headers(scope=scope)), keys):
                resp = JSONResponse(error_body(path, 401, "missing or invalid API key (send Authorization: "
                                                          "Bearer KEY or x-api-key: KEY)",
                                               code="invalid_api_key"),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await resp(scope, receive, tracking_send)
            await self.app(scope, receive, tracking_send)
        finally:
            if self.state.metrics is not None and status_seen[0]:
                self.state.metrics.request_done(_route_of(path), status_seen[0])


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        return f"malformed JSON in the request body: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    param = ".".join(loc) or None
    msg = e.get("msg", "invalid value")
    more = f" (and {len(errs) - 1} more problems)" if len(errs) > 1 else ""
    return (f"{param}: {msg}" if param else msg) + more, param


def create_app(engine=None, settings: ServerSettings | None = None) -> FastAPI:
    """The API for `engine` (None while it loads: then generation routes answer 503; set it later with
    set_engine(app, engine))."""
    settings = settings or ServerSettings()
    state = ServerState(settings=settings, engine=engine, metrics=Metrics())
    app = FastAPI(title="HiveJet local API", version="0.1.0",
                  description="OpenAI- and Anthropic-compatible API over the HiveJet engine.")
    app.state.hivejet = state
    _add_error_handlers(app)
    from app.server import anthropic_api, openai_api
    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    _add_server_routes(app, state)
    _add_middleware(app, state, settings)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as the API family's error body (OpenAI or Anthropic shape, by the request's path)."""
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        path = request.url.path
        msg = exc.anthropic_message if is_anthropic_path(path) else exc.message
        return JSONResponse(error_body(path, exc.status, msg, exc.type, exc.param, exc.code),
                            status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        return JSONResponse(error_body(request.url.path, 400, msg, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        msg = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404:
            msg = f"no such route: {request.method} {request.url.path}"
        return JSONResponse(error_body(request.url.path, exc.status_code, msg), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(request.url.path, 500, f"internal error: {type(exc).__name__}"),
                            status_code=500)


def _add_server_routes(app: FastAPI, state: ServerState) -> None:
    """The server's own routes: /health, /metrics, /slots, /tokenize, /detokenize."""
    @app.get("/health", response_model=S.HealthResponse, responses={503: {"model": S.ErrorResponse}}, tags=["server"])
    async def health():
        if state.engine is None:
            msg = f"the model failed to load: {state.load_error}" if state.load_error else "loading model"
            return JSONResponse(error_body("/health", 503, msg), status_code=503, headers={"Retry-After": "2"})
        return {"status": "ok", "model": state.model_id()}

    @app.get("/metrics", response_class=PlainTextResponse, responses={401: ERRORS[401]}, tags=["server"])
    async def metrics():
        stats = state.engine.stats() if state.engine is not None else None
        return PlainTextResponse(state.metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/slots", response_model=S.SlotsResponse, responses=ERRORS, tags=["server"])
    async def slots():
        eng = state.engine_or_503()
        st = eng.stats()
        return {"slots": [dict(id=q["id"], session=q.get("session"), state=q.get("state"), context=q.get("context"),
                               ctx_limit=q.get("ctx_limit"), prompt_tokens=q.get("prompt_tokens"),
                               generated=q.get("generated"), cached_tokens=q.get("cached_tokens", 0),
                               tok_per_s=q.get("tok_per_s"), queue_position=q.get("queue_position"),
                               draft_proposed=q.get("drafted", 0), draft_accepted=q.get("accepted", 0))
                          for q in st["sequences"]],
                "running": st["running"], "waiting": st["waiting"]}

    @app.post("/tokenize", response_model=S.TokenizeResponse, responses=ERRORS, tags=["server"])
    async def tokenize(body: S.TokenizeRequest):
        eng = state.engine_or_503()
        ids = await run_in_threadpool(eng.tokenizer.encode, body.content, bool(body.add_special),
                                      body.parse_special is not False)
        if body.with_pieces:
            return {"tokens": [{"id": i, "piece": eng.tokenizer.token_bytes(i).decode("utf-8", "replace")}
                               for i in ids]}
        return {"tokens": ids}

    @app.post("/detokenize", response_model=S.DetokenizeResponse, responses=ERRORS, tags=["server"])
    async def detokenize(body: S.DetokenizeRequest):
        eng = state.engine_or_503()
        n = eng.tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < n]
        if bad:
            raise ApiError(400, f"token ids outside the vocabulary (0..{n - 1}): {bad[:5]}", param="tokens")
        return {"content": eng.tokenizer.decode(body.tokens)}


def _add_middleware(app: FastAPI, state: ServerState, settings: ServerSettings) -> None:
    # Middleware, innermost first: auth + metrics, CORS (answers preflights before auth), body size limit.
    app.add_middleware(AuthAndMetrics, state=state)
    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    app.add_middleware(BodySizeLimit, limit=settings.max_body_bytes, error_body=error_body,
                       max_json_values=settings.max_json_values, max_json_items=settings.max_json_items)


def set_engine(app: FastAPI, engine, error: str | None = None) -> None:
    st: ServerState = app.state.hivejet
    st.engine, st.load_error, st._info = engine, error, None


def uvicorn_server(app: FastAPI, **config):
    """A uvicorn Server for `app` that, when told to stop (SIGTERM, Ctrl-C, should_exit), first ends the
    running requests so each stream sends an error event saying the server is shutting down, instead of
    being cut mid-answer."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.hivejet.begin_shutdown()
            super().handle_exit(sig, frame)

    return Server(uvicorn.Config(app, **config))


class ServerThread:
    """uvicorn serving `app` on host:port in a daemon thread (port 0 picks a free one)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.app = app
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn_server(app, log_level=log_level, timeout_graceful_shutdown=3, lifespan="off",
                                     timeout_keep_alive=5)
        self.thread = threading.Thread(target=self._run, name="hivejet-server", daemon=True)

    def _run(self):
        self.server.run(sockets=[self.sock])

    @property
    def url(self) -> str:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{h}:{self.port}"

    def start(self, timeout: float = 10.0) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("the API server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.app.state.hivejet.begin_shutdown()
        self.server.should_exit = True
        self.thread.join(timeout)
        try:
            self.sock.close()
        except OSError:
            pass


def start_server(engine, settings: ServerSettings | None = None) -> ServerThread:
    """Start the API for an already loaded engine in a background thread (the GUI's toggle)."""
    settings = settings or ServerSettings()
    settings.validate()
    return ServerThread(create_app(engine, settings), settings.host, settings.port).start()
