"""`hivejet bench agents`: several coding agents against one server, HiveJet and llama.cpp's
llama-server (same model, same client code, same run).

Each server is started as a subprocess and driven over its OpenAI-compatible /v1/completions with
streamed responses (token-id prompts, `ignore_eos`, usage in the last chunk). Scenarios:
  1. decode: N agents (for N in --agents) each generate -n/--n-gen tokens after a short prompt:
     per-agent and total tok/s;
  2. long context: four agents each hold a --context-token conversation: per-agent decode tok/s;
  3. follow-up: each of those conversations sends 50 more tokens: time to first token;
  4. three agents decode while a fourth sends a --long-prompt-token prompt: the three's tok/s during
     the prefill against before it, and the fourth's time to first token;
  5. four agents that pause 0.5-3 s between requests (as agents do while running tools), for
     --duration seconds: total tok/s.
Prompts are random token ids (speed does not depend on them).
"""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess reachable at `url`, ready once /health answers 200."""

    def __init__(self, name: str, cmd: list[str], port: int, timeout: float = 600.0):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        t_end = time.time() + timeout
        while time.time() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}: {self.proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"{name} did not become ready in {timeout:.0f} s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def hivejet_server(model: str, agents: int, ctx: int, device: str = "auto", extra: tuple = ()) -> Server:
    """extra: more `hivejet serve` arguments (e.g. --prefill-chunk 512)."""
    port = _free_port()
    return Server("HiveJet", [sys.executable, "-m", "app.cli", "serve", "-m", model, "--port", str(port),
                              "--agents", str(agents), "--ctx", str(ctx), "--any-model", "--device", device,
                              "--max-queue", "256", *extra], port)


def llama_server(llamacpp: str, model: str, agents: int, ctx: int) -> Server:
    port = _free_port()
    return Server("llama.cpp", [os.path.join(llamacpp, "llama-server"), "-m", model, "-ngl", "99", "-fa", "on",
                                "-np", str(agents), "-c", str(agents * ctx), "--port", str(port)], port)


def complete(url: str, prompt: list[int], max_tokens: int, on_token=None) -> dict:
    """One streamed completion: time to first token, end time, tokens generated, each token's arrival
    time; `on_token()` is called as each one arrives."""
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, n_chunks, usage, times = None, 0, None, []
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if "error" in ev:
                raise RuntimeError(f"server error: {ev['error']}")
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices") or []:
                if ch.get("text"):
                    n_chunks += 1
                    times.append(time.perf_counter())
                    first = first or times[-1]
                    if on_token is not None:
                        on_token()
    t_end = time.perf_counter()
    tokens = (usage or {}).get("completion_tokens") or n_chunks
    return dict(t0=t0, ttft=(first or t_end) - t0, t_first=first or t_end, t_end=t_end, tokens=tokens, times=times)


def _decode_rate(r: dict) -> float:
    return (r["tokens"] - 1) / max(r["t_end"] - r["t_first"], 1e-9) if r["tokens"] > 1 else 0.0


def _rate(ts: list[float]) -> float:
    """tok/s of tokens that arrived at times ts (0 for fewer than two)."""
    return (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 1 and ts[-1] > ts[0] else 0.0


def _window_rates(rs: list[dict]) -> list[float]:
    """Each stream's tok/s while all of them were decoding (from the last one's first token to the first
    one's end); a stream's whole decode rate where they never all decoded at once."""
    lo, hi = max(r["t_first"] for r in rs), min(r["t_end"] for r in rs)
    out = []
    for r in rs:
        ts = [t for t in r["times"] if lo <= t <= hi]
        out.append(_rate(ts) if len(ts) > 2 and ts[-1] > ts[0] else _decode_rate(r))
    return out


def _parallel(fns) -> list:
    out = [None] * len(fns)

    def run(i, f):
        out[i] = f()
    ts = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(fns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def _log(msg: str) -> None:
    """Progress on stderr (a benchmark on a remote machine must show how far it got)."""
    print(f"[bench agents {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


SCENARIOS = (1, 2, 3, 4, 5)


def run_scenarios(url: str, vocab: int, agents=(1, 4, 8, 16), gen: int = 128, context: int = 23000,
                  new_tokens: int = 50, long_prompt: int = 20000, duration: float = 60.0, seed: int = 0,
                  on_result=None, scenarios=SCENARIOS) -> dict:
    """The five scenarios (or those in `scenarios`) against one server; `on_result(res)` after each
    (partial results survive a benchmark cut short). Scenario 3 reads its conversations first when 2 did
    not run, and 4 its three when 3 did not (the three agents then start decoding together, as in a full
    run)."""
    rng = random.Random(seed)
    res: dict = {}
    done = on_result or (lambda r: None)
    complete(url, _prompt(rng, 32, vocab), 16)   # one-time costs (kernel compilation, graphs) out of the figures
    if 1 in scenarios:
        res["decode"] = []
        for n in agents:
            t0 = time.perf_counter()
            rs = _parallel([lambda: complete(url, _prompt(rng, 32, vocab), gen) for _ in range(n)])
            wall = time.perf_counter() - t0
            # where the wall time beyond decoding goes: the first tokens (prompts read) and the ends' spread
            ttft = sorted(r["ttft"] for r in rs)
            res["decode"].append(dict(agents=n, per_agent=sum(map(_decode_rate, rs)) / n,
                                      total=sum(r["tokens"] for r in rs) / wall, wall_s=wall,
                                      ttft_s=dict(min=ttft[0], median=ttft[len(ttft) // 2], max=ttft[-1]),
                                      end_spread_s=max(r["t_end"] for r in rs) - min(r["t_end"] for r in rs)))
            _log(f"1. {n} agents: {res['decode'][-1]['total']:.1f} tok/s total ({wall:.1f} s; first token "
                 f"{ttft[0]:.3f}-{ttft[-1]:.3f} s)")
            done(res)
    convs = [_prompt(rng, context, vocab) for _ in range(4)]
    if 2 in scenarios or 3 in scenarios:
        t0 = time.perf_counter()
        # the four conversations are read first (together), then each asks again and all four decode at once
        pre = _parallel([lambda c=c: complete(url, c, 1) for c in convs])
    if 2 in scenarios:
        rs = _parallel([lambda c=c: complete(url, c, gen) for c in convs])
        res["long_context"] = dict(context=context, per_agent=_window_rates(rs), whole=[_decode_rate(r) for r in rs],
                                   prefill_s=[r["ttft"] for r in pre], again_ttft=[r["ttft"] for r in rs])
        _log(f"2. 4 x {context} tokens: {[round(x, 1) for x in res['long_context']['per_agent']]} tok/s each "
             f"({time.perf_counter() - t0:.1f} s; first reads {[round(r['ttft'], 1) for r in pre]} s)")
        done(res)
    follow = [c + _prompt(rng, new_tokens, vocab) for c in convs]
    if 3 in scenarios:
        res["follow_up_ttft"] = [complete(url, f, 8)["ttft"] for f in follow]
        _log(f"3. follow-up first token: {[round(x, 2) for x in res['follow_up_ttft']]} s")
        done(res)
    if 4 in scenarios:
        if 3 not in scenarios:   # (the three conversations resident, as after scenario 3: they start together)
            _parallel([lambda f=f: complete(url, f, 1) for f in follow[:3]])
        _during_prefill(url, vocab, rng, follow[:3], gen, long_prompt, res)
        done(res)
    if 5 in scenarios:
        _paused_agents(url, vocab, seed, gen, duration, res)
        done(res)
    return res


def _during_prefill(url: str, vocab: int, rng: random.Random, follow: list, gen: int, long_prompt: int,
                    res: dict) -> None:
    """Scenario 4 into res["during_prefill"]."""
    # three agents decode; a fourth sends a long prompt once they are going
    progress, ended, sent = [0, 0, 0], [False] * 3, {}

    def intruder():
        # once all three are decoding (8 tokens each), 2 s of their speed before the long prompt is sent
        while not all(progress[i] >= 8 or ended[i] for i in range(3)):
            time.sleep(0.05)
        time.sleep(2.0)
        sent["t"] = time.perf_counter()
        sent["r"] = complete(url, _prompt(rng, long_prompt, vocab), 8)
    th = threading.Thread(target=intruder)
    th.start()

    def follower(i, f):
        try:
            return complete(url, f, gen * 8, on_token=lambda: progress.__setitem__(i, progress[i] + 1))
        finally:
            ended[i] = True   # (a follower that ended early does not hold the intruder back)
    rs = _parallel([lambda i=i, f=f: follower(i, f) for i, f in enumerate(follow)])
    th.join()
    t_sent, t_first = sent["t"], sent["r"]["t_first"]
    res["during_prefill"] = dict(long_prompt=long_prompt,
                                 before=[_rate([t for t in r["times"] if t < t_sent]) for r in rs],
                                 during=[_rate([t for t in r["times"] if t_sent <= t < t_first]) for r in rs],
                                 intruder_ttft=sent["r"]["ttft"])
    _log(f"4. {res['during_prefill']}")


def _paused_agents(url: str, vocab: int, seed: int, gen: int, duration: float, res: dict) -> None:
    """Scenario 5 (agents with tool pauses) into res["paused_agents"]."""
    t_end = time.perf_counter() + duration
    counts = [0] * 4

    def agent(i):
        r = random.Random(seed + i)
        while time.perf_counter() < t_end:
            counts[i] += complete(url, _prompt(r, 64, vocab), gen // 2)["tokens"]
            time.sleep(r.uniform(0.5, 3.0))
    t0 = time.perf_counter()
    _parallel([lambda i=i: agent(i) for i in range(4)])
    res["paused_agents"] = dict(duration=time.perf_counter() - t0, total=sum(counts) / (time.perf_counter() - t0))
    _log(f"5. {res['paused_agents']}")


def bench_agents(model: str, llamacpp: str | None = None, device: str = "auto", servers=("hivejet", "llama.cpp"),
                 json_path: str | None = None, serve_args: tuple = (), **kw) -> dict:
    """Both servers (or those in `servers`) through run_scenarios; with json_path the results so far
    are written after every scenario. serve_args: more `hivejet serve` arguments."""
    from engine.gguf.reader import GGUFFile
    from engine.gguf.spec import spec_from_gguf
    f = GGUFFile(model)
    try:
        vocab = spec_from_gguf(f).vocab_size
    finally:
        f.close()
    ctx = kw.get("context", 23000) + kw.get("new_tokens", 50) + 2 * kw.get("gen", 128) * 4 + 64
    ctx = max(ctx, kw.get("long_prompt", 20000) + 64)
    n_agents = max(max(kw.get("agents", (1, 4, 8, 16))), 4)
    out = dict(model=os.path.basename(model), date=time.strftime("%Y-%m-%d %H:%M"), results={},
               serve_args=list(serve_args), scenarios=list(kw.get("scenarios", SCENARIOS)))
    makers = []
    if "hivejet" in servers:
        makers.append(("HiveJet", lambda: hivejet_server(model, n_agents, ctx, device, tuple(serve_args))))
    if llamacpp and "llama.cpp" in servers:
        makers.append(("llama.cpp", lambda: llama_server(llamacpp, model, n_agents, ctx)))

    def save(name, res):
        out["results"][name] = res
        if json_path:
            with open(json_path, "w") as f:
                json.dump(out, f, indent=1)
    for name, make in makers:
        t0 = time.perf_counter()
        srv = make()
        _log(f"{name} ready in {time.perf_counter() - t0:.1f} s")
        try:
            run_scenarios(srv.url, vocab, on_result=lambda r, name=name: save(name, r), **kw)
        finally:
            srv.close()
    return out


def print_agents(res: dict) -> None:
    """The results as text, the scenarios every server ran."""
    names = list(res["results"])
    print(f"model {res['model']}; " + " | ".join(names))
    runs = [res["results"][n] for n in names]

    def ran(key):
        return all(key in r for r in runs)
    if ran("decode"):
        for i, d in enumerate(runs[0]["decode"]):
            cells = []
            for r in runs:
                di = r["decode"][i]
                cells.append(f"{di['total']:.1f} total, {di['per_agent']:.1f}/agent"
                             + (f", last first token {di['ttft_s']['max']:.2f} s" if "ttft_s" in di else ""))
            print(f"1. {d['agents']:2d} agents decode: " + " | ".join(cells))
    if ran("long_context"):
        print("2. 4 agents at long context, tok/s each: " + " | ".join(
            ", ".join(f"{x:.1f}" for x in r["long_context"]["per_agent"]) for r in runs))
    if ran("follow_up_ttft"):
        print("3. follow-up first token, s: " + " | ".join(
            ", ".join(f"{x:.2f}" for x in r["follow_up_ttft"]) for r in runs))
    if ran("during_prefill"):
        print("4. 3 agents before / during a long prompt, tok/s; its first token: " + " | ".join(
            f"{sum(d['before']) / 3:.1f} / {sum(d['during']) / 3:.1f}; {d['intruder_ttft']:.2f} s"
            for d in (r["during_prefill"] for r in runs)))
    if ran("paused_agents"):
        print("5. 4 agents with pauses, total tok/s: " + " | ".join(f"{r['paused_agents']['total']:.1f}" for r in runs))


def plot_agents(results: dict, out_png: str, title: str = "") -> None:
    """The scenarios every server ran (all five in a full run) as grouped bars, one colour per server
    (Pillow). results: server name -> run_scenarios' result (several result files merged: each server
    may come from its own run)."""
    from PIL import Image, ImageDraw
    names = list(results)
    colors = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]
    runs = [results[n] for n in names]
    makers = [
        ("decode", lambda: ("1. decode, short prompts: total tok/s", [f"{d['agents']} agents" for d in runs[0]["decode"]],
                            {n: [d["total"] for d in results[n]["decode"]] for n in names})),
        ("long_context", lambda: ("2. four agents at 23K: tok/s each (mean)", ["per agent"],
                                  {n: [sum(results[n]["long_context"]["per_agent"]) / 4] for n in names})),
        ("follow_up_ttft", lambda: ("3. follow-up first token, s (lower is better)", ["conv 1", "conv 2", "conv 3", "conv 4"],
                                    {n: results[n]["follow_up_ttft"] for n in names})),
        ("during_prefill", lambda: ("4. three agents' tok/s before / during a 20K prompt; its first token, s",
                                    ["before", "during", "1st token s"],
                                    {n: [sum(results[n]["during_prefill"]["before"]) / 3,
                                         sum(results[n]["during_prefill"]["during"]) / 3,
                                         results[n]["during_prefill"]["intruder_ttft"]] for n in names})),
        ("paused_agents", lambda: ("5. four agents pausing for tools: total tok/s", ["total"],
                                   {n: [results[n]["paused_agents"]["total"]] for n in names})),
    ]
    panels = [make() for key, make in makers if all(key in r for r in runs)]
    if not panels:
        raise ValueError("no scenario that every server ran")
    W, PH, L = 900, 190, 20
    img = Image.new("RGB", (W, 40 + PH * len(panels)), "white")
    d = ImageDraw.Draw(img)
    d.text((L, 8), title or "hivejet bench agents", fill="black")
    for i, n in enumerate(names):
        d.rectangle([W - 260 + 120 * i, 8, W - 250 + 120 * i, 18], fill=colors[i % 4])
        d.text((W - 245 + 120 * i, 8), n, fill="black")
    for pi, (label, groups, vals) in enumerate(panels):
        top = 40 + pi * PH
        d.text((L, top), label, fill="black")
        y0, y1 = top + 18, top + PH - 30
        vmax = max(max(v) for v in vals.values()) * 1.15 or 1
        gw = (W - 2 * L) / len(groups)
        bw = min(60, gw / (len(names) + 1))
        for gi, g in enumerate(groups):
            gx = L + gi * gw + (gw - bw * len(names)) / 2
            for si, n in enumerate(names):
                v = vals[n][gi]
                x = gx + si * bw
                yt = y1 - v / vmax * (y1 - y0)
                d.rectangle([x, yt, x + bw - 4, y1], fill=colors[si % 4])
                d.text((x, yt - 12), f"{v:.1f}", fill="black")
            d.text((L + gi * gw + gw / 2 - 3 * len(g), y1 + 4), g, fill="black")
        d.line([L, y1, W - L, y1], fill="black")
    img.save(out_png)
