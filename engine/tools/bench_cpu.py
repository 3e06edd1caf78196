"""`hivejet bench decode --device cpu`: the CPU path's prompt and decode speed, llama.cpp's CPU build beside it.

- pp{n_prompt}: one forward over an n_prompt-token prompt (the engine's CPU step: a prompt chunk is 512 tokens,
  engine/planner.py), `reps` times, each into a fresh cache;
- tg{n_gen}: n_gen single-token decode steps after the prompt, greedy (the argmax fed back), the tok/s of the whole
  run and the min / median step;
- with llamacpp (a folder holding llama-bench, or "build": engine/tools/llamacpp_cpu.py builds llama.cpp b11434's
  CPU version once into the cache folder): `llama-bench -m MODEL -p P -n N -t THREADS -r REPS -o json` in the same run;
- with runner: the same prompt and decode steps through engine/runner/runner.py on the CPU (one slot, the prompt in
  one chunk; what `static_slots` steps through), so the two step paths' speeds come from one run.
Both at the same thread count: the engine's default (engine/engine.py: default_threads) unless -t is given. The
machine may be shared: the figures are the min and median of the repeats, and the load average is recorded.
Tokens are random ids (speed does not depend on them).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from typing import TYPE_CHECKING

from engine.tools.bench_decode import _log

if TYPE_CHECKING:
    import torch


class _ModelPath:
    """The CPU path's steps: model.forward over a fresh SequenceKV per prompt."""

    def __init__(self, model):
        self.model, self.kv = model, None

    def prompt(self, tokens) -> torch.Tensor:
        from engine.models.common import SeqChunk
        self.kv = self.model.new_kv()
        return self.model.forward([SeqChunk(tokens, 0, self.kv)])[0]

    def step(self, tok: int, pos: int) -> torch.Tensor:
        import torch

        from engine.models.common import SeqChunk
        return self.model.forward([SeqChunk(torch.tensor([tok]), pos, self.kv)])[0]


class _RunnerPath:
    """The runner's steps on the CPU: slot 0, reset before each prompt, the prompt in one chunk."""

    def __init__(self, runner):
        self.runner = runner

    def prompt(self, tokens) -> torch.Tensor:
        self.runner.reset(0)
        return self.runner.prefill(0, tokens.tolist(), chunk=len(tokens))

    def step(self, tok: int, pos: int) -> torch.Tensor:
        return self.runner.decode([0], [tok], [pos])


def _prompt_runs(path, tokens, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        path.prompt(tokens)
        times.append(time.perf_counter() - t)
    return times


def _decode_run(path, tokens, n_gen: int) -> list[float]:
    """Per-step seconds of n_gen greedy decode steps after the prompt."""
    logits = path.prompt(tokens)
    tok, pos, steps = int(logits[-1].argmax()), len(tokens), []
    for _ in range(n_gen):
        t = time.perf_counter()
        logits = path.step(tok, pos)
        tok = int(logits[-1].argmax())
        steps.append(time.perf_counter() - t)
        pos += 1
    return steps


def _measure(path, tokens, n_gen: int, reps: int) -> list[dict]:
    """pp and tg of one step path: reps prompts, then reps - 1 (at least one) decode runs."""
    prompt_s = _prompt_runs(path, tokens, reps)
    return _figures(len(tokens), n_gen, prompt_s, [_decode_run(path, tokens, n_gen) for _ in range(max(1, reps - 1))])


def _figures(n_prompt: int, n_gen: int, prompt_s: list[float], runs: list[list[float]]) -> list[dict]:
    """The pp and tg entries of a result from the prompt runs' seconds and the decode runs' step seconds."""
    pp = [n_prompt / t for t in prompt_s]
    tg = [n_gen / sum(r) for r in runs]
    steps = sorted(s for r in runs for s in r)
    _log(f"pp{n_prompt}: median {statistics.median(pp):.1f} tok/s, best {max(pp):.1f}; "
         f"tg{n_gen}: median {statistics.median(tg):.1f} tok/s, best {max(tg):.1f}")
    return [dict(test=f"pp{n_prompt}", tok_s=statistics.median(pp), tok_s_max=max(pp), tok_s_runs=pp),
            dict(test=f"tg{n_gen}", tok_s=statistics.median(tg), tok_s_max=max(tg), tok_s_runs=tg,
                 step_ms_min=steps[0] * 1e3, step_ms_median=steps[len(steps) // 2] * 1e3)]


def run_llama_bench_cpu(exe: str, model: str, n_prompt: int, n_gen: int, threads: int, reps: int) -> list[dict]:
    cmd = [exe, "-m", model, "-p", str(n_prompt), "-n", str(n_gen), "-t", str(threads), "-r", str(reps), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({out.returncode}): {out.stderr[-2000:]}")
    return [dict(test=("pp" if r["n_prompt"] else "tg") + str(r["n_prompt"] or r["n_gen"]), tok_s=r["avg_ts"],
                 stddev=r["stddev_ts"], samples=r.get("samples_ts"), build=r.get("build_commit"),
                 threads=r.get("n_threads")) for r in json.loads(out.stdout)]


def _llama_bench_path(llamacpp: str) -> str:
    from engine.tools import llamacpp_cpu
    if llamacpp == "build":
        return str(llamacpp_cpu.llama_bench(build_if_missing=True))
    exe = os.path.join(llamacpp, "llama-bench.exe" if os.name == "nt" else "llama-bench")
    if not os.path.isfile(exe):
        raise FileNotFoundError(f"no llama-bench in {llamacpp} (or pass --llamacpp build)")
    return exe


def bench_cpu(model_path: str, n_prompt: int = 512, n_gen: int = 128, threads: int | None = None, reps: int = 3,
              llamacpp: str | None = None, json_path: str | None = None, runner: bool = False) -> dict:
    import torch

    from engine.engine import default_threads
    from engine.models import open_model
    from engine.models.common import SeqChunk
    threads = threads or default_threads()
    torch.set_num_threads(threads)
    res: dict = dict(device="cpu", cpu=_cpu_name(), cores=os.cpu_count(), threads=threads,
                     model=os.path.basename(model_path), date=time.strftime("%Y-%m-%d %H:%M"),
                     load_before=_loadavg())
    t0 = time.perf_counter()
    model = open_model(model_path)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.spec.vocab_size, (n_prompt,), generator=g)
    model.forward([SeqChunk(tokens[:16], 0, model.new_kv())])
    res["load_s"] = time.perf_counter() - t0        # opening, repacking the weights, compiling or loading kernels
    _log(f"loaded and warm in {res['load_s']:.1f} s, {threads} threads")
    res["hivejet"] = _measure(_ModelPath(model), tokens, n_gen, reps)
    if runner:
        from engine.runner import Runner
        r = Runner(model, device="cpu", n_slots=1, max_ctx=n_prompt + n_gen + 16, cache_type="f16")
        try:
            r.prefill(0, tokens[:16].tolist(), chunk=16)
            _log("runner:")
            res["runner"] = _measure(_RunnerPath(r), tokens, n_gen, reps)
        finally:
            r.close()
    if llamacpp:
        exe = _llama_bench_path(llamacpp)
        _log(f"llama-bench ({exe}) ...")
        res["llamacpp"] = run_llama_bench_cpu(exe, model_path, n_prompt, n_gen, threads, reps)
    res["load_after"] = _loadavg()
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
    return res


def _loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except (AttributeError, OSError):
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def print_cpu(res: dict) -> None:
    load = res.get("load_before")
    print(f"device: cpu ({res['cpu']}, {res['cores']} cores), {res['threads']} threads; model {res['model']}; "
          f"loaded in {res['load_s']:.1f} s" + (f"; load average {load[0]:.1f} before" if load else ""))
    lc = {r["test"]: r for r in res.get("llamacpp", [])}
    print(f"{'test':8s} {'HiveJet tok/s (median, best)':>30s} {'llama.cpp tok/s':>16s} {'ratio':>6s}")
    for r in res["hivejet"]:
        o = lc.get(r["test"])
        ratio = f"{r['tok_s'] / o['tok_s']:6.2f}" if o else "     -"
        both = f"{r['tok_s']:.1f}, {r['tok_s_max']:.1f}"
        print(f"{r['test']:8s} {both:>30s} {(o['tok_s'] if o else float('nan')):16.1f} {ratio}")
    cpu = {r["test"]: r for r in res["hivejet"]}
    for r in res.get("runner", []):
        print(f"{r['test'] + ' runner':15s} {r['tok_s']:.1f}, {r['tok_s_max']:.1f} "
              f"({r['tok_s'] / cpu[r['test']]['tok_s']:.2f}x the CPU path)")
    tg = res["hivejet"][-1]
    print(f"decode step: min {tg['step_ms_min']:.1f} ms, median {tg['step_ms_median']:.1f} ms")
