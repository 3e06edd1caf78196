"""Benchmarks (`hivejet bench SCENARIO`). Speed is measured here, on a GPU, never in unit tests.

Scenarios:
  matmul  the first 4-bit Triton matmul (kernels/quant/q4_gemm.py, not the GPU path's packed kernel, which
          .ci/gpu/matmul_shapes.py and `decode --profile` time) on the 27B model's Q4_K shapes, rows M =
          1..64: time per call, weight bytes streamed per second, against the card's copy bandwidth.
  decode  a model on the GPU through engine/runner/runner.py (CUDA graphs): pp512 and tg128 at each depth
          (0 and 23000 by default, like `llama-bench -p 512 -n 128 -d 0,23000`), and the row-scaling
          table: one decode step with 1, 2, 4, .., 64 rows (sequences). With --llamacpp DIR, llama-bench
          from DIR runs on the same GGUF in the same run and both are printed side by side.
  agents  coding agents against `hivejet serve` and llama-server (same client, same run):
          engine/tools/bench_agents.py.
  spec    speculative decoding on a code-edit workload (any device), and the speedup modelled from a
          decode result's row table (engine/tools/bench_spec.py); with --accept RATES, the speed for 1, 4, 8
          and 16 agents at a controlled acceptance (engine/tools/bench_spec_accept.py).
  plot    a PNG of a decode result's row-scaling table (`hivejet bench plot RESULT.json OUT.png`), or of
          agents results, the servers of all given files in one chart
          (`hivejet bench plot A.json B.json OUT.png`).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys

# (name, N, K): the Q4_K matrices of a Qwen3.5-27B Q4_K_M (engine/tools/synth.py's 27b-q4_k_m preset)
SHAPES_27B = [
    ("ffn_gate/up", 17408, 5120),
    ("ffn_down", 5120, 17408),
    ("gdn attn_qkv", 10240, 5120),
    ("gdn attn_gate", 6144, 5120),
    ("gdn ssm_out", 5120, 6144),
    ("attn_q+gate", 12288, 5120),
]
ROWS = [1, 2, 4, 8, 16, 32, 64]


def bench_matmul(rows=ROWS, shapes=SHAPES_27B) -> dict:
    import torch
    from gguf import GGMLQuantizationType as QT
    from triton.testing import do_bench

    from kernels.quant.q4_gemm import pack_q4, q4_matmul
    if not torch.cuda.is_available():
        raise RuntimeError("the matmul benchmark needs a CUDA GPU")
    dev = torch.cuda.get_device_name()
    from engine.tools.bench_decode import copy_bandwidth
    copy_bw = copy_bandwidth(torch, 1 << 30)
    results = []
    for name, n, k in shapes:
        raw = torch.randint(0, 256, (n * k // 256 * 144,), dtype=torch.uint8, device="cuda")
        raw.view(-1, 144).view(torch.int16)[:, :2] = torch.tensor(0.001, dtype=torch.float16).view(torch.int16)
        p = pack_q4(raw, QT.Q4_K, n, k)
        gguf_bytes = raw.numel()
        dense = torch.randn(n, k, device="cuda", dtype=torch.float16)
        for m in rows:
            x = torch.randn(m, k, device="cuda")
            ms = do_bench(lambda x=x, p=p: q4_matmul(x, p), warmup=25, rep=100)
            xh = x.half()
            ms_fp16 = do_bench(lambda xh=xh, dense=dense: xh @ dense.T, warmup=25, rep=100)
            results.append(dict(shape=name, n=n, k=k, m=m, ms=ms, packed_tbps=p.nbytes / (ms * 1e-3) / 1e12,
                                gguf_tbps=gguf_bytes / (ms * 1e-3) / 1e12, fp16_cublas_ms=ms_fp16,
                                fp16_tbps=2 * n * k / (ms_fp16 * 1e-3) / 1e12))
        del raw, p, dense
    return dict(device=dev, copy_tbps=copy_bw / 1e12, results=results)


def _print_matmul(res: dict) -> None:
    print(f"device: {res['device']}; copy bandwidth {res['copy_tbps']:.2f} TB/s (read+write)")
    print(f"{'shape':14s} {'N':>6s} {'K':>6s} {'M':>3s} {'ms':>8s} {'TB/s packed':>11s} {'TB/s gguf':>9s} "
          f"{'fp16 cuBLAS ms':>14s} {'(TB/s)':>7s}")
    for r in res["results"]:
        print(f"{r['shape']:14s} {r['n']:6d} {r['k']:6d} {r['m']:3d} {r['ms']:8.4f} {r['packed_tbps']:11.2f} "
              f"{r['gguf_tbps']:9.2f} {r['fp16_cublas_ms']:14.4f} {r['fp16_tbps']:7.2f}")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", choices=["matmul", "decode", "spec", "agents", "plot"])
    p.add_argument("paths", nargs="*", help="plot: RESULT.json OUT.png")
    p.add_argument("-m", "--model", default=None, help="decode, spec, agents: the GGUF model")
    p.add_argument("--llamacpp", default=None,
                   help="decode: a directory with llama-bench (same run, same model); with --device cpu also \"build\": "
                        "llama.cpp b11434's CPU build, made once in the cache folder (engine/tools/llamacpp_cpu.py)")
    p.add_argument("--depths", type=int, nargs="+", default=[0, 23000])
    p.add_argument("--rows", type=int, nargs="+", default=ROWS)
    p.add_argument("-p", "--n-prompt", type=int, default=512)
    p.add_argument("-n", "--n-gen", type=int, default=128)
    p.add_argument("--profile", action="store_true", help="decode: print the CUDA time per kernel of one step")
    p.add_argument("--card", default=None, metavar="NAME",
                   help="decode: print the decode ceiling on this card (engine/cards.py; default: the GPU in use)")
    p.add_argument("--device", default="auto",
                   help="decode, spec, agents: the engine's device (default auto: the GPU when torch sees one; cpu, "
                        "cuda); decode --device cpu: the CPU path's prompt and decode tok/s (engine/tools/bench_cpu.py)")
    p.add_argument("-t", "--threads", type=int, default=None, help="decode --device cpu: threads (default: the engine's)")
    p.add_argument("--reps", type=int, default=3, help="decode --device cpu: repeats of each figure")
    p.add_argument("--runner", action="store_true",
                   help="decode --device cpu: the same figures through the runner too (engine/runner, one slot)")
    p.add_argument("--rows-json", default=None, help="spec: a decode result whose row table models the speedup")
    p.add_argument("--verify-rows", action="store_true",
                   help="spec: time steps verifying 0/3/4/8/15 drafts for 1, 4 and 16 sequences, up to 64 rows "
                        "(the GPU path's rows)")
    p.add_argument("--spec-drafter", default=None, metavar="PATH",
                   help="spec: a DFlash drafter (directory or GGUF) for the model: adds the dflash and dflash+ngram runs")
    p.add_argument("--accept", default=None, metavar="RATES",
                   help="spec: per-position acceptance rates, e.g. 0.92,0.80,0.65: the drafter's tokens replaced so "
                        "that they are accepted at these rates, for --agents agents (engine/tools/bench_spec_accept.py)")
    p.add_argument("--no-adaptive", action="store_true",
                   help="spec --accept: draft lengths from acceptance alone (EngineConfig.spec_adaptive=False)")
    p.add_argument("--agents", type=int, nargs="+", default=[1, 4, 8, 16],
                   help="agents, spec --accept: concurrent agents per run")
    p.add_argument("--context", type=int, default=23000, help="agents: tokens of each long conversation")
    p.add_argument("--long-prompt", type=int, default=20000, help="agents: the intruding prompt's tokens")
    p.add_argument("--duration", type=float, default=60.0, help="agents: seconds of the paused-agents run")
    p.add_argument("--servers", nargs="+", default=["hivejet", "llama.cpp"], choices=["hivejet", "llama.cpp"],
                   help="agents: which servers to run (llama.cpp needs --llamacpp)")
    p.add_argument("--scenarios", type=int, nargs="+", default=[1, 2, 3, 4, 5], choices=[1, 2, 3, 4, 5],
                   help="agents: which scenarios to run (default all five)")
    p.add_argument("--serve-args", default="", metavar="ARGS",
                   help="agents: more `hivejet serve` arguments, e.g. \"--prefill-chunk 512\"")
    p.add_argument("--json", default=None, help="also write the results to this file")


def _cpu_device(device: str) -> bool:
    """decode's device: cpu when asked, or auto where torch sees no GPU."""
    if device == "auto":
        import torch
        return not torch.cuda.is_available()
    return device == "cpu"


def _run_plot(args) -> int:
    """`hivejet bench plot RESULT.json [RESULT.json ...] OUT.png`."""
    if len(args.paths) < 2:
        print("usage: hivejet bench plot RESULT.json [RESULT.json ...] OUT.png", file=sys.stderr)
        return 2
    loaded = []
    for path in args.paths[:-1]:
        with open(path) as f:
            loaded.append(json.load(f))
    if all("results" in r for r in loaded):   # agents: the servers of every file in one chart
        from engine.tools.bench_agents import plot_agents
        merged = {name: res for r in loaded for name, res in r["results"].items()}
        try:
            plot_agents(merged, args.paths[-1], f"hivejet bench agents, {loaded[0].get('model', '')}")
        except ValueError as e:
            print(f"bench plot: {e}", file=sys.stderr)
            return 2
        return 0
    if len(loaded) != 1 or "rows" not in loaded[0]:
        print("bench plot: give one decode result, or agents results", file=sys.stderr)
        return 2
    from engine.tools.bench_decode import plot_rows
    plot_rows(loaded[0], args.paths[-1])
    return 0


def run_bench(args) -> int:
    if args.scenario == "plot":
        return _run_plot(args)
    if args.scenario == "agents":
        if not args.model:
            print("hivejet bench agents needs -m MODEL.gguf", file=sys.stderr)
            return 2
        from engine.tools.bench_agents import bench_agents, print_agents
        res = bench_agents(args.model, llamacpp=args.llamacpp, device=args.device, servers=args.servers,
                           json_path=args.json, agents=tuple(args.agents), gen=args.n_gen, context=args.context,
                           long_prompt=args.long_prompt, duration=args.duration,
                           scenarios=tuple(args.scenarios), serve_args=tuple(shlex.split(args.serve_args)))
        print_agents(res)
    elif args.scenario == "spec" and args.accept is not None:
        from engine.spec.controlled import parse_rates
        from engine.tools.bench_spec_accept import bench_accept
        try:
            rates = parse_rates(args.accept)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if not args.model or any(n < 1 for n in args.agents):
            print("hivejet bench spec --accept needs -m MODEL.gguf and --agents of at least 1", file=sys.stderr)
            return 2
        res = bench_accept(args.model, rates, agents=tuple(args.agents), n_gen=args.n_gen, device=args.device,
                           drafter=args.spec_drafter, adaptive=not args.no_adaptive)
    elif args.scenario == "spec":
        from engine.tools.bench_spec import run
        res = run(args)
    elif args.scenario == "decode" and _cpu_device(args.device):
        from engine.tools.bench_cpu import bench_cpu, print_cpu
        model = args.model
        if not model:
            from engine.catalog import ensure_model
            model = str(ensure_model("demo"))
        res = bench_cpu(model, n_prompt=args.n_prompt, n_gen=args.n_gen, threads=args.threads, reps=args.reps,
                        llamacpp=args.llamacpp, json_path=args.json, runner=args.runner)
        print_cpu(res)
    elif args.scenario == "decode":
        if not args.model:
            print("hivejet bench decode needs -m MODEL.gguf", file=sys.stderr)
            return 2
        from engine.cards import card
        from engine.tools.bench_decode import bench_decode, print_decode
        try:
            named = card(args.card) if args.card else None
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        res = bench_decode(args.model, depths=args.depths, rows=args.rows, n_prompt=args.n_prompt,
                           n_gen=args.n_gen, llamacpp=args.llamacpp, profile=args.profile, json_path=args.json,
                           card=named)
        print_decode(res)
    else:
        res = bench_matmul()
        _print_matmul(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    add_bench_args(ap)
    sys.exit(run_bench(ap.parse_args()))
