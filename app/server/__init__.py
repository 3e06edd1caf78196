"""HiveJet's local HTTP API: OpenAI- and Anthropic-compatible, over the Engine contract.

`hivejet serve` uses add_serve_args / run_serve; the GUI's toggle uses start_server(engine, settings).
"""
from __future__ import annotations

import argparse
import logging
import sys
import threading

from app.cli_options import add_spec_args
from app.server.security import ServerSettings, SettingsError
from engine.types import DEFAULT_MAX_SEQS

__all__ = ["add_serve_args", "run_serve", "create_app", "start_server", "ServerSettings", "SettingsError"]


def create_app(engine=None, settings=None):
    from app.server.app import create_app as _create
    return _create(engine, settings)


def start_server(engine, settings=None):
    from app.server.app import start_server as _start
    return _start(engine, settings)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Arguments of `hivejet serve` (includes -m/--model)."""
    p.add_argument("-m", "--model", default="demo", help="GGUF file or catalog name; default: demo")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; any other address needs --api-key)")
    p.add_argument("--port", type=int, default=18080, help="port (default 18080)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accepted API key (repeatable; also HIVEJET_API_KEY, comma-separated)")
    p.add_argument("--agents", type=int, default=DEFAULT_MAX_SEQS, metavar="N",
                   help=f"conversations run at once (default {DEFAULT_MAX_SEQS})")
    p.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="waiting requests beyond the running ones; more get 429 (default 64)")
    p.add_argument("-c", "--ctx", "--ctx-size", dest="ctx", type=int, default=0, metavar="N",
                   help="context per conversation (default: the model's)")
    p.add_argument("--cache-type-k", default="f16",
                   help="KV cache type for K: f32, f16, bf16, q8_0, turbo4, turbo3, turbo2, turbo3_tcq, "
                        "turbo2_tcq (default f16; the CPU and GPU paths alike)")
    p.add_argument("--cache-type-v", default="f16", help="KV cache type for V (same choices)")
    p.add_argument("--kv-memory", type=float, default=0.0, metavar="GIB",
                   help="KV cache memory on the CPU in GiB (default: a quarter of the RAM); when full, "
                        "finished conversations are evicted and the newest request waits")
    p.add_argument("--prefill-share", type=float, default=0.5, metavar="F",
                   help="GPU path: while conversations generate, a long prompt's chunks after its first take "
                        "about this share of the GPU's time (default 0.5: they keep half their speed; 1: "
                        "no pacing)")
    p.add_argument("--prefill-chunk", type=int, default=0, metavar="N",
                   help="prompts are read in chunks cut at multiples of N tokens (a multiple of 16; default 0: "
                        "1024 on a GPU with 16 GiB or more free after the weights, else 512): larger chunks "
                        "read long prompts faster, smaller ones keep the other conversations' steps shorter "
                        "and leave more memory to the KV cache; shared prefixes are reused in whole chunks")
    p.add_argument("--no-shared-passes", dest="shared_passes", action="store_false",
                   help="GPU path: read each arriving prompt in a pass of its own (by default the short prompts "
                        "of requests that arrive together share one pass; its graphs take ~0.4 GB on a 27B, "
                        "which this leaves to the KV cache)")
    p.add_argument("--state-checkpoints", type=int, default=-1, metavar="N",
                   help="GPU path, models with recurrent layers (Qwen3.5/3.6): keep up to N snapshots of the "
                        "recurrent state at prompt chunk ends, so that a regenerated or edited reply, a "
                        "follow-up whose history dropped the last reply's reasoning, or another agent's shared "
                        "prefix reads only the rest (default -1: automatic, see --checkpoint-memory; 0: none)")
    p.add_argument("--checkpoint-memory", default="auto", choices=("auto", "device", "host"),
                   help="where those snapshots live: device (GPU memory, beside the KV cache), host (pinned "
                        "RAM; each save or restore is a copy over PCIe) or auto (default: host when fewer than "
                        "8 fit in 2 %% of the KV cache, as on a 24 GiB card with a 27B model)")
    p.add_argument("--device", default="auto", help="auto (default: the GPU when torch sees one), cpu or cuda")
    add_spec_args(p)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="allow browser requests from this origin (repeatable; default: CORS off)")
    p.add_argument("--allowed-hosts", action="append", default=[], metavar="NAME[,NAME...]",
                   help="Host header names the server answers to besides localhost, 127.0.0.1 and [::1] "
                        "(repeatable or comma-separated; '*': any). Without an API key only those are "
                        "answered (a guard against DNS rebinding); with a key, any unless this is given")
    p.add_argument("--max-body-mb", type=float, default=32.0, help="request body limit in MB (default 32)")
    p.add_argument("--allow-remote-images", action="store_true", help="allow http(s) image URLs in requests")
    p.add_argument("--media-dir", default=None, help="folder that file:// image URLs may name (default: none)")
    p.add_argument("--alias", action="append", default=[], metavar="NAME",
                   help="name the model is served as (repeatable; the first is shown in /v1/models)")
    p.add_argument("--any-model", action="store_true",
                   help="accept any model name in requests (for clients with fixed model names, e.g. Claude Code)")
    p.add_argument("--max-tokens-limit", type=int, default=0, help="cap on tokens generated per request (0 = none)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def settings_from_args(args) -> ServerSettings:
    keys = list(args.api_key) + ServerSettings.keys_from_env()
    return ServerSettings(host=args.host, port=args.port, api_keys=keys, cors_origins=list(args.cors_origin),
                          max_body_bytes=int(args.max_body_mb * 1024 * 1024),
                          allow_remote_images=args.allow_remote_images, media_dir=args.media_dir,
                          model_aliases=list(args.alias), accept_any_model=args.any_model,
                          max_tokens_limit=args.max_tokens_limit,
                          allowed_hosts=[h.strip() for v in args.allowed_hosts for h in v.split(",") if h.strip()])


def run_serve(args) -> int:
    """`hivejet serve`: listen at once (GET /health answers 503 while the model loads), then serve until
    Ctrl-C. Returns the exit code."""
    from app.server.app import create_app as _create, uvicorn_server
    err = lambda msg: print(f"error: {msg}", file=sys.stderr)  # noqa: E731
    settings = settings_from_args(args)
    try:
        settings.validate()
    except SettingsError as e:
        err(e)
        return 2
    problem = _check_engine_args(args)
    if problem:
        err(problem)
        return 2
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(levelname)s %(name)s: %(message)s")
    app = _create(None, settings)
    holder: dict = {}
    threading.Thread(target=_load_engine, args=(app, args, settings, holder), name="hivejet-load", daemon=True).start()
    from app.server.access_log import quiet_polls
    quiet_polls(args.log_level)      # monitoring polls (hivejet top, Prometheus) stay out of the access log
    try:
        uvicorn_server(app, host=settings.host, port=settings.port, log_level=args.log_level,
                       timeout_graceful_shutdown=5, lifespan="off").run()
    except (OSError, SystemExit) as e:
        err(f"cannot listen on {settings.host}:{settings.port}: {e}")
        return 1
    finally:
        eng = holder.get("engine")
        if eng is not None:
            eng.shutdown()
    return 0


def _check_engine_args(args) -> str | None:
    """What is wrong with the engine's arguments (None when nothing); normalizes the cache type names and
    --spec none."""
    from kernels.kvcodec import cache_type_name
    for name in ("cache_type_k", "cache_type_v"):
        try:
            setattr(args, name, cache_type_name(getattr(args, name).lower()))
        except ValueError as e:
            return f"--{name.replace('_', '-')}: {e}"
    if args.spec == "none":
        args.spec = "off"
    from engine.spec import SPEC_MODES
    if args.spec not in SPEC_MODES:
        return f"--spec {args.spec}: choose {', '.join(SPEC_MODES)}"
    if "dflash" in args.spec and not args.spec_drafter:
        return f"--spec {args.spec} needs --spec-drafter (a DFlash drafter directory or GGUF)"
    if args.agents < 1 or args.max_queue < 0 or args.ctx < 0 or args.kv_memory < 0:
        return "--agents must be >= 1, --max-queue >= 0, --ctx >= 0 and --kv-memory >= 0"
    if not 0 < args.prefill_share <= 1:
        return "--prefill-share must be in (0, 1]"
    if args.prefill_chunk < 0 or args.prefill_chunk % 16:
        return f"--prefill-chunk {args.prefill_chunk}: a multiple of 16 (0: automatic)"
    return None


def _load_engine(app, args, settings: ServerSettings, holder: dict) -> None:
    """Load the model (on its own thread) and hand the engine to the app; a failure is shown by /health
    and the log, and the server keeps answering 503."""
    from app.server.app import set_engine
    from engine.engine import Engine, EngineConfig
    try:
        eng = Engine(EngineConfig(model=args.model, ctx_size=args.ctx, max_seqs=args.agents,
                                  max_queue=args.max_queue, threads=args.threads,
                                  device=args.device, spec=args.spec, spec_drafter=args.spec_drafter,
                                  device_sampling=not getattr(args, "host_sampling", False),
                                  overlap_steps=not getattr(args, "host_sampling", False),
                                  cache_type_k=args.cache_type_k,
                                  kv_memory=int(args.kv_memory * 2**30),
                                  prefill_share=args.prefill_share,
                                  shared_prompt_passes=args.shared_passes,
                                  state_checkpoints=args.state_checkpoints,
                                  checkpoint_memory=args.checkpoint_memory,
                                  prefill_chunk=args.prefill_chunk,
                                  cache_type_v=args.cache_type_v),
                     progress=lambda msg: print(msg, file=sys.stderr))
    except Exception as e:
        logging.getLogger("hivejet.server").error("model failed to load: %s", e)
        set_engine(app, None, error=str(e))
        return
    holder["engine"] = eng
    set_engine(app, eng)
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    print(f"HiveJet: serving {eng.model_name} (context {eng.ctx_size}) at http://{host}:{settings.port}/v1",
          file=sys.stderr)


def main(argv=None) -> int:  # python -m app.server
    p = argparse.ArgumentParser(prog="hivejet serve", description="OpenAI/Anthropic-compatible local API")
    add_serve_args(p)
    return run_serve(p.parse_args(argv))
