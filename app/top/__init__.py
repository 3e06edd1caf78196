"""`hivejet top`: a live terminal view of every conversation (agent) on a HiveJet server, and `--run N`, which
drives N tool-using coding agents against it (the multi-agent benchmark's load).

The CLI calls add_top_args(parser) and run_top(args). See docs/TOP.md.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from urllib.parse import urlparse

__all__ = ["add_top_args", "run_top"]

DEFAULT_URL = "http://127.0.0.1:18080"


def add_top_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help=f"the server (default {DEFAULT_URL})")
    p.add_argument("--api-key", default=None, help="API key for the server (default: HIVEJET_API_KEY)")
    p.add_argument("--interval", type=float, default=0.25, help="seconds between refreshes (default 0.25)")
    p.add_argument("--sort", default="agent", choices=["agent", "tok/s", "context", "state"],
                   help="initial sort (the s key cycles)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--no-gpu", action="store_true", help="do not read NVML")
    g = p.add_argument_group("agents (--run)")
    g.add_argument("--run", type=int, default=0, metavar="N",
                   help="start N coding agents against the server (starting one if none answers at --url)")
    g.add_argument("--tasks", default=None, metavar="DIR",
                   help="task folder (default: the exercises in resources/agent_tasks)")
    g.add_argument("--steps", type=int, default=12, help="step limit per agent (default 12)")
    g.add_argument("--max-tokens", type=int, default=1024, help="tokens per agent step (default 1024)")
    g.add_argument("--temp", type=float, default=0.2, help="sampling temperature (default 0.2)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--tool-choice", default="required", choices=["required", "auto"],
                   help="required (default): every step is a grammar-constrained tool call")
    g.add_argument("--test-timeout", type=float, default=60.0, help="seconds run_tests may take (default 60)")
    g.add_argument("--test-runner", default="pytest", choices=["pytest", "builtin"],
                   help="run_tests uses `python -m pytest -q` (default) or a minimal built-in runner")
    g.add_argument("--no-view", action="store_true", help="print progress lines instead of the live view")
    g.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    s = p.add_argument_group("the server started by --run when none is running")
    s.add_argument("-m", "--model", default="demo", help="GGUF file or catalog name (default demo)")
    s.add_argument("-c", "--ctx", type=int, default=0, help="context per conversation (default: the model's)")
    s.add_argument("--threads", type=int, default=0, help="CPU threads (default: the engine's)")
    s.add_argument("--device", default="auto", help="auto (default: the GPU when torch sees one), cpu or cuda")


class Terminated(KeyboardInterrupt):
    """SIGTERM while agents run: stopped like Ctrl-C (streams broken off, temporary folders removed)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _interrupt_code(e: KeyboardInterrupt) -> int:
    """The exit code for a run ended by a signal: 130 for Ctrl-C, 143 for SIGTERM (128 + the signal)."""
    return 128 + int(e.signum if isinstance(e, Terminated) else signal.SIGINT)


def _terminate_as_interrupt():
    """Make SIGTERM raise Terminated and SIGINT KeyboardInterrupt in the main thread for the run's duration
    (SIGINT's own handler may have been replaced by what the process ran before: a Qt application, a server);
    returns the undo."""
    fired = []

    def on_term(signum, _frame):
        if not fired:          # once: a second SIGTERM must not break off the clean stop the first started
            fired.append(signum)
            raise Terminated(signum)
    try:
        old = signal.signal(signal.SIGTERM, on_term)
    except (ValueError, OSError, AttributeError):     # not the main thread, or no SIGTERM here
        return lambda: None
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)

    def undo():
        signal.signal(signal.SIGTERM, old)
        signal.signal(signal.SIGINT, old_int)
    return undo


def _err(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)


class LocalServer:
    """An engine and the API server in this process (for --run when nothing answers at the URL)."""

    def __init__(self, url: str, model: str, ctx: int, max_seqs: int, threads: int = 0, api_key: str | None = None,
                 device: str = "auto"):
        from app.server.app import ServerThread, create_app
        from app.server.security import ServerSettings
        from engine.engine import Engine, EngineConfig
        u = urlparse(url)
        host, port = u.hostname or "127.0.0.1", u.port or 18080
        settings = ServerSettings(host=host, port=port, api_keys=[api_key] if api_key else [])
        settings.validate()
        print(f"hivejet top: starting a server for {model} at {url} ...", file=sys.stderr)
        self.engine = Engine(EngineConfig(model=model, ctx_size=ctx, max_seqs=max_seqs, threads=threads, device=device),
                             progress=lambda msg: print(msg, file=sys.stderr))
        try:
            self.server = ServerThread(create_app(self.engine, settings), host, port).start()
        except Exception:
            self.engine.shutdown()
            raise

    def stop(self) -> None:
        self.server.stop()
        self.engine.shutdown()


def _wait_ready(client, timeout: float = 900.0) -> str | None:
    t0 = time.monotonic()
    while True:
        status, info = client.health()
        if status == "ok":
            return None
        if status == "down" or time.monotonic() - t0 > timeout:
            return info
        time.sleep(0.5)


def _plain_progress(run, interval: float = 0.5, out=None) -> None:
    """Progress lines (no terminal): one line whenever an agent changes step or state."""
    out = out or sys.stdout
    seen = {}
    while True:
        finished = run.wait(interval)
        for s in run.statuses:
            key = (s.step, s.state)
            if seen.get(s.name) != key:
                seen[s.name] = key
                line = s.last_line[:100]
                print(f"[{time.monotonic() - run.t0:7.1f}s] {s.name} {s.task} step {s.step}/{s.max_steps} "
                      f"{s.state}" + (f": {line}" if line and not s.state.startswith("generating") else ""),
                      file=out, flush=True)
        if finished:
            return


def run_top(args, console=None) -> int:
    """`hivejet top`. Returns the exit code. `console`: a rich Console to draw on (default: the terminal)."""
    from rich.console import Console

    from app.top.client import Client
    console = console or Console()
    if args.run < 0 or args.steps < 1 or args.max_tokens < 1 or args.interval <= 0:
        _err("--run must be >= 0, --steps and --max-tokens >= 1, --interval > 0")
        return 2
    client = Client(args.url, api_key=args.api_key)
    if not args.run:
        return _watch(args, client, console)
    return _drive_agents(args, client, console)


def _watch(args, client, console) -> int:
    """The live view of a server (or one frame with --once or without a terminal)."""
    from app.top.view import KeyReader, Poller, TopScreen, frame_text, render
    poller = Poller(client, gpu=False if args.no_gpu else None)
    if args.once or not console.is_terminal:
        snap = poller.poll()
        if console.is_terminal:
            console.print(render(snap, args.sort, show_keys=False))
        else:
            console.file.write(frame_text(snap, width=console.width, sort=args.sort, show_keys=False))
        return 0 if snap.status == "ok" else 1
    screen = TopScreen(poller, args.interval, console, args.sort)
    restore = _terminate_as_interrupt()        # SIGTERM too leaves through KeyReader's terminal restore
    try:
        with KeyReader() as keys:
            screen.run(keys=keys)
    finally:
        restore()
    return _interrupt_code(screen.interrupted) if screen.interrupted is not None else 0


def _drive_agents(args, client, console) -> int:
    """--run N: N coding agents on the server (started here when none answers), followed live, then the
    summary."""
    from app.top.agents import AgentConfig, AgentRun
    from app.top.tasks import TaskError, load_tasks
    try:
        tasks = load_tasks(args.tasks)
    except TaskError as e:
        _err(e)
        return 2
    server = None
    restore = _terminate_as_interrupt()
    try:
        status, info = client.health()
        if status == "down":
            try:
                server = LocalServer(client.url, args.model, args.ctx, max(16, args.run), args.threads,
                                     client.api_key, args.device)
            except Exception as e:
                _err(f"cannot start a server: {e}")
                return 1
        problem = _wait_ready(client)
        if problem:
            _err(f"the server at {client.url} is not ready: {problem}")
            return 1
        cfg = AgentConfig(model=client.model_id(), max_steps=args.steps, max_tokens=args.max_tokens,
                          temperature=args.temp, seed=args.seed, tool_choice=args.tool_choice,
                          test_timeout=args.test_timeout, test_runner=args.test_runner)
        run = AgentRun(client, tasks, args.run, cfg)
        try:   # (a signal while the agents' threads start, the first ones already running, stops them all)
            run.start()
        except KeyboardInterrupt as e:
            return _finish_run(args, run, console, e)
        interrupted = _follow(args, run, client, console)
        return _finish_run(args, run, console, interrupted)
    finally:
        if server is not None:
            server.stop()
        restore()


def _follow(args, run, client, console) -> KeyboardInterrupt | None:
    """Show the run (the live view on a terminal, else progress lines) until it ends, the view is quit or a
    signal stops it; returns the interrupt that stopped it, if one did."""
    from app.top.view import KeyReader, Poller, TopScreen, render
    try:
        if not args.no_view and console.is_terminal:
            poller = Poller(client, agents=lambda: run.statuses, gpu=False if args.no_gpu else None)
            screen = TopScreen(poller, args.interval, console, args.sort)
            with KeyReader() as keys:
                last = screen.run(until=run.done, keys=keys)
            if screen.interrupted is not None:
                raise screen.interrupted        # (after the view is closed: stopped as below)
            if screen.quit_requested and not run.done():
                run.cancel()
            if last is not None and console.is_terminal:
                console.print(render(last, screen.sort, show_keys=False))
        else:
            _plain_progress(run, out=console.file)
    except KeyboardInterrupt as e:
        run.cancel()
        return e
    return None


def _finish_run(args, run, console, interrupted: KeyboardInterrupt | None) -> int:
    """Stop what still runs, print (and with --json write) the summary; the exit code."""
    from app.top.agents import format_summary
    if not run.done():
        run.cancel()
    run.wait(60)       # the agents' threads remove their temporary folders as they stop
    summary = run.summary()
    console.file.write("\n" + format_summary(summary) + "\n")
    console.file.flush()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    if interrupted is not None:
        return _interrupt_code(interrupted)     # after the clean stop
    return 1 if summary["agents"] and all(a["state"] == "error" for a in summary["per_agent"]) else 0
