"""Memory plan: how much GPU memory a model needs at a given context length and KV cache type.

    total = weights + KV cache + recurrent states + workspace (+ vision projector)

Every number comes from the GGUF header (nothing is loaded):

* **weights**: the exact byte size of every tensor in the file's tensor index (`TensorInfo.n_bytes`,
  i.e. n_elements / block_size * type_size of its GGML type). All tensors are counted as resident on
  the GPU, including the token embedding and the MTP block.
* **KV cache** per sequence, per token, per attention layer: K and V, `n_head_kv * head_dim` values
  each, at the cache type's bytes per value. Values are stored in blocks that run along a token's
  concatenated heads, so a token's K (or V) takes ``ceil(values / block) * block_bytes``:

  ========== ====================== =========================================================
  type       block: values -> bytes  format (the KV cache issue's formats)
  ========== ====================== =========================================================
  f16        1 -> 2                  IEEE half
  q8_0       32 -> 34                llama.cpp Q8_0: fp16 scale + 32 int8
  turbo4     128 -> 66               random rotation + 4-bit Lloyd-Max codes + fp16 norm
  turbo3     32 -> 14                random rotation + 3-bit Lloyd-Max codes + fp16 norm
  turbo2     32 -> 10                random rotation + 2-bit Lloyd-Max codes + fp16 norm
  turbo3_tcq 128 -> 52               trellis-coded, 3 bits/value + fp16 norm + state
  turbo2_tcq 128 -> 36               trellis-coded, 2 bits/value + fp16 norm + state
  ========== ====================== =========================================================

  Attention layers are the layers that are not Gated DeltaNet (qwen35: every 4th), plus the MTP
  (NextN) blocks, which have their own attention. Sliding-window layers (gemma3's local layers) keep at
  most `sliding_window` tokens, so they stop growing past the window.
* **recurrent state** per sequence for every Gated DeltaNet layer (qwen35), f32 as llama.cpp keeps it:
  the causal-conv window ``(ssm.conv_kernel - 1) * conv_dim`` with
  ``conv_dim = 2 * ssm.group_count * ssm.state_size + ssm.inner_size``, and the state matrix
  ``ssm.time_step_rank * ssm.state_size * (ssm.inner_size / ssm.time_step_rank)`` (one K-dim x V-dim
  matrix per V head). This does not grow with the context.
* **workspace**: an allowance HiveJet defines (and the runner must stay inside):

  - CUDA context, cuBLAS/Triton handles: 400 MiB (`CUDA_CONTEXT_BYTES`);
  - CUDA graphs' memory pool for the decode shapes: 256 MiB (`CUDA_GRAPH_BYTES`);
  - activations of one step: ``step_tokens * (4 * n_embd + 3 * n_ff + q_dim + 2 * kv_dim) * 4`` bytes
    (f32 residual, norms, QKV, FFN gate/up/down for every row of a 512-row step);
  - logits: ``max_seqs * 4 rows * vocab * 4`` bytes (each sequence's decode token plus up to three
    draft tokens get logits).

* **vision projector** (when a model has a paired mmproj, `engine.vision.find_mmproj`): its tensor bytes
  plus the workspace of encoding the largest image (`engine.vision.mmproj_info`). Projector types the
  engine cannot load are not counted (the model then loads without vision).

"Fits" means total <= the given VRAM (NVML's free memory when a GPU is present, else what the user
asks about). `max_context` finds the largest context (a multiple of 256 tokens, the KV pool's block
size, at most the model's training context) that fits for each cache type.

CLI: ``hivejet plan -m MODEL [--vram 24GiB] [--kv TYPE] [--seqs N]`` prints the table.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from engine.gguf.reader import GGUFError, GGUFFile
from engine.gguf.spec import spec_from_gguf

GiB = 1 << 30
MiB = 1 << 20

# cache type -> (values per block, bytes per block)
KV_TYPES: dict[str, tuple[int, int]] = {
    "f16": (1, 2),
    "q8_0": (32, 34),
    "turbo4": (128, 66),
    "turbo3": (32, 14),
    "turbo2": (32, 10),
    "turbo3_tcq": (128, 52),
    "turbo2_tcq": (128, 36),
}
CONTEXTS = (8192, 16384, 32768, 65536, 131072, 204800, 262144)
KV_BLOCK_TOKENS = 256

CUDA_CONTEXT_BYTES = 400 * MiB
CUDA_GRAPH_BYTES = 256 * MiB
STEP_TOKENS = 512
LOGIT_ROWS_PER_SEQ = 4


def kv_bytes_per_value(kv_type: str) -> float:
    vals, nbytes = _kv_type(kv_type)
    return nbytes / vals


def _kv_type(kv_type: str) -> tuple[int, int]:
    try:
        return KV_TYPES[kv_type]
    except KeyError:
        raise ValueError(f"unknown KV cache type {kv_type!r} (choose from {', '.join(KV_TYPES)})") from None


def _packed(n_values: int, kv_type: str) -> int:
    vals, nbytes = _kv_type(kv_type)
    return math.ceil(n_values / vals) * nbytes


@dataclass
class ModelFacts:
    """What the planner needs to know about a model, read from its GGUF header."""

    path: str
    name: str
    arch: str
    weight_bytes: int
    file_bytes: int
    context_length: int
    n_embd: int
    n_ff: int
    vocab_size: int
    n_head: int
    head_dim: int
    # per attention layer: (K values per token, V values per token, window or 0 for full)
    attn_layers: list[tuple[int, int, int]] = field(default_factory=list)
    n_recurrent_layers: int = 0
    recurrent_bytes_per_layer: int = 0
    quant: str = ""
    mmproj: str | None = None       # the paired vision projector, when there is one the engine can load
    mmproj_projector: str = ""
    mmproj_weight_bytes: int = 0
    mmproj_workspace_bytes: int = 0

    @property
    def vision_bytes(self) -> int:
        """The vision projector's weights plus its image-encoding workspace (0 without one)."""
        return self.mmproj_weight_bytes + self.mmproj_workspace_bytes

    @property
    def recurrent_bytes(self) -> int:
        """Recurrent (Gated DeltaNet) state of one sequence, all layers."""
        return self.n_recurrent_layers * self.recurrent_bytes_per_layer

    @property
    def n_full_attn(self) -> int:
        return sum(1 for *_, w in self.attn_layers if not w)

    @property
    def n_swa(self) -> int:
        return sum(1 for *_, w in self.attn_layers if w)


_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
               11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
               18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S",
               25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M",
               32: "BF16", 36: "TQ1_0", 37: "TQ2_0"}


def file_type_name(md: dict) -> str:
    ft = md.get("general.file_type")
    return _FILE_TYPES.get(ft, f"type {ft}") if ft is not None else ""


def model_facts(path: str | os.PathLike, mmproj: str | os.PathLike | None = "auto") -> ModelFacts:
    """Read a GGUF header (no weights are touched). Raises GGUFError for a broken file. `mmproj`: the
    vision projector to count ("auto": the one beside the model, as EngineConfig(mmproj="auto"); None: none)."""
    facts = _model_facts(path)
    if mmproj == "auto":
        from engine.vision import find_mmproj
        mmproj = find_mmproj(path)
    if mmproj:
        from engine.vision import mmproj_info
        try:
            info = mmproj_info(mmproj)
        except (GGUFError, OSError, ValueError):
            info = None
        if info is not None and info["supported"]:
            facts.mmproj, facts.mmproj_projector = info["path"], info["projector"]
            facts.mmproj_weight_bytes, facts.mmproj_workspace_bytes = info["n_bytes"], info["workspace_bytes"]
    return facts


def _model_facts(path: str | os.PathLike) -> ModelFacts:
    f = GGUFFile(path)
    try:
        spec = spec_from_gguf(f)
        md = f.metadata
        weight_bytes = sum(t.n_bytes for t in f.tensors.values())
        k_vals = spec.n_head_kv * spec.head_dim
        v_vals = spec.n_head_kv * spec.head_dim_v
        attn = []
        for il in range(spec.n_layer):
            if spec.is_recurrent(il):
                continue
            window = spec.sliding_window if spec.is_swa(il) else 0
            attn.append((k_vals, v_vals, window))
        for _ in range(spec.n_layer_nextn):  # MTP blocks attend with their own KV
            attn.append((k_vals, v_vals, 0))
        n_rec = sum(1 for il in range(spec.n_layer) if spec.is_recurrent(il))
        rec_per_layer = 0
        if n_rec:
            conv_dim = 2 * spec.ssm_n_group * spec.ssm_d_state + spec.ssm_d_inner
            head_v = spec.ssm_d_inner // spec.ssm_dt_rank
            conv = (spec.ssm_d_conv - 1) * conv_dim
            state = spec.ssm_dt_rank * spec.ssm_d_state * head_v
            rec_per_layer = 4 * (conv + state)
        return ModelFacts(
            path=str(path), name=str(md.get("general.name") or Path(path).stem), arch=spec.arch,
            weight_bytes=weight_bytes, file_bytes=Path(path).stat().st_size, context_length=spec.context_length,
            n_embd=spec.n_embd, n_ff=spec.n_ff, vocab_size=spec.vocab_size, n_head=spec.n_head,
            head_dim=spec.head_dim, attn_layers=attn, n_recurrent_layers=n_rec,
            recurrent_bytes_per_layer=rec_per_layer, quant=file_type_name(md))
    finally:
        f.close()


def kv_bytes(facts: ModelFacts, ctx: int, kv_type: str) -> int:
    """KV cache bytes of one sequence holding `ctx` tokens."""
    total = 0
    for k_vals, v_vals, window in facts.attn_layers:
        n = min(ctx, window) if window else ctx
        total += n * (_packed(k_vals, kv_type) + _packed(v_vals, kv_type))
    return total


def kv_bytes_per_token(facts: ModelFacts, kv_type: str) -> int:
    """KV bytes each token adds while the context is below every sliding window."""
    return sum(_packed(k, kv_type) + _packed(v, kv_type) for k, v, _ in facts.attn_layers)


def workspace_bytes(facts: ModelFacts, max_seqs: int = 1, step_tokens: int = STEP_TOKENS) -> int:
    q_dim = facts.n_head * facts.head_dim
    kv_dim = facts.attn_layers[0][0] if facts.attn_layers else 0
    act = step_tokens * (4 * facts.n_embd + 3 * facts.n_ff + q_dim + 2 * kv_dim) * 4
    logits = max(1, max_seqs) * LOGIT_ROWS_PER_SEQ * facts.vocab_size * 4
    return CUDA_CONTEXT_BYTES + CUDA_GRAPH_BYTES + act + logits


@dataclass
class Plan:
    ctx: int
    kv_type: str
    n_seqs: int
    weights: int
    kv: int
    recurrent: int
    workspace: int
    vram: int | None = None
    vision: int = 0                 # vision projector weights + image-encoding workspace

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.recurrent + self.workspace + self.vision

    @property
    def fits(self) -> bool | None:
        return None if self.vram is None else self.total <= self.vram

    @property
    def headroom(self) -> int | None:
        return None if self.vram is None else self.vram - self.total


def plan(facts: ModelFacts, ctx: int, kv_type: str = "f16", n_seqs: int = 1, vram: int | None = None) -> Plan:
    """Memory for `n_seqs` sequences of `ctx` tokens each (the KV pool is sized for all of them)."""
    if ctx <= 0:
        raise ValueError("context must be positive")
    return Plan(ctx=ctx, kv_type=kv_type, n_seqs=n_seqs, weights=facts.weight_bytes,
                kv=n_seqs * kv_bytes(facts, ctx, kv_type), recurrent=n_seqs * facts.recurrent_bytes,
                workspace=workspace_bytes(facts, n_seqs), vram=vram, vision=facts.vision_bytes)


def max_context(facts: ModelFacts, kv_type: str, vram: int, n_seqs: int = 1, limit: int | None = None) -> int:
    """Largest context (multiple of KV_BLOCK_TOKENS, at most `limit` = the model's training context)
    whose plan fits in `vram`; 0 when not even one block fits."""
    limit = limit or facts.context_length
    hi_blocks = max(limit // KV_BLOCK_TOKENS, 1)
    if plan(facts, KV_BLOCK_TOKENS, kv_type, n_seqs, vram).total > vram:
        return 0
    top = hi_blocks * KV_BLOCK_TOKENS
    if plan(facts, top, kv_type, n_seqs, vram).total <= vram:
        return min(top, limit)
    lo, hi = 1, hi_blocks  # lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if plan(facts, mid * KV_BLOCK_TOKENS, kv_type, n_seqs, vram).total <= vram:
            lo = mid
        else:
            hi = mid
    return lo * KV_BLOCK_TOKENS


def plan_table(facts: ModelFacts, vram: int | None, contexts=CONTEXTS, kv_types=None, n_seqs: int = 1
               ) -> dict[str, list[Plan]]:
    """{kv type: [Plan for each context]}."""
    kv_types = list(kv_types or KV_TYPES)
    return {kt: [plan(facts, c, kt, n_seqs, vram) for c in contexts] for kt in kv_types}


# ----- formatting -----
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)b?\s*$", re.I)


def parse_size(text: str) -> int:
    """'24GiB', '24 GB', '24g', '8000M', '1234' (bytes) -> bytes. GB means GiB here too (as GPU specs do)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"cannot read a memory size from {text!r} (try 24GiB)")
    num, unit = float(m.group(1)), m.group(2).lower()
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[unit]
    return int(num * mult)


def fmt_bytes(n: int | float) -> str:
    n = float(n)
    for unit, div in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}" if unit == "GiB" else f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def fmt_ctx(n: int) -> str:
    if n >= 1024 and n % 1024 == 0:
        k = n // 1024
        return {200: "200K", 256: "262K"}.get(k, f"{k}K")
    return f"{n / 1000:.0f}K" if n >= 1000 else str(n)


def format_table(facts: ModelFacts, vram: int | None, kv_types=None, n_seqs: int = 1) -> str:
    table = plan_table(facts, vram, kv_types=kv_types, n_seqs=n_seqs)
    lines = [f"{facts.name} ({facts.arch}{', ' + facts.quant if facts.quant else ''}): weights "
             f"{fmt_bytes(facts.weight_bytes)}, {facts.n_full_attn} full-attention + {facts.n_swa} sliding-window "
             f"attention layers, {facts.n_recurrent_layers} recurrent layers "
             f"({fmt_bytes(facts.recurrent_bytes)} state per sequence), training context {facts.context_length}",
             f"workspace allowance {fmt_bytes(workspace_bytes(facts, n_seqs))}; "
             + (f"VRAM {fmt_bytes(vram)}" if vram else "no VRAM given: totals only")
             + (f"; {n_seqs} sequences" if n_seqs > 1 else "")]
    if facts.mmproj:
        lines.append(f"vision projector {Path(facts.mmproj).name} ({facts.mmproj_projector}): "
                     f"{fmt_bytes(facts.vision_bytes)} (weights {fmt_bytes(facts.mmproj_weight_bytes)} + "
                     f"image encoding {fmt_bytes(facts.mmproj_workspace_bytes)}), included in the totals")
    head = f"{'KV type':<11}" + "".join(f"{fmt_ctx(c):>12}" for c in CONTEXTS) + ("   max context" if vram else "")
    lines += ["", head, "-" * len(head)]
    for kt, plans in table.items():
        cells = []
        for p in plans:
            if p.ctx > facts.context_length:
                cells.append(f"{'n/a':>9}   ")
                continue
            mark = "" if p.fits is None else (" ok" if p.fits else " --")
            cells.append(f"{p.total / GiB:>9.2f}{mark:<3}")
        row = f"{kt:<11}" + "".join(cells)
        if vram:
            row += f"   {max_context(facts, kt, vram, n_seqs):>11}"
        lines.append(row)
    lines.append("")
    lines.append("cells: total GiB (weights + KV + recurrent state + workspace"
                 + (" + vision projector" if facts.mmproj else "") + "); ok = fits, -- = does not fit, "
                 "n/a = beyond the model's training context")
    return "\n".join(lines)


def add_plan_args(parser) -> None:
    parser.add_argument("-m", "--model", default="demo", help="GGUF file or catalog name")
    parser.add_argument("--vram", default=None, help="GPU memory to plan for, e.g. 24GiB (default: free memory "
                                                     "of GPU 0 from NVML; none -> totals only)")
    parser.add_argument("--kv", default=None, choices=list(KV_TYPES), help="only this KV cache type")
    parser.add_argument("--seqs", type=int, default=1, help="parallel sequences sharing the KV pool")


def run_plan(args) -> int:
    import sys
    from engine.catalog import CatalogError, ensure_model
    try:
        vram = parse_size(args.vram) if args.vram else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if vram is None:
        try:
            from app.gpu import detect_gpus
            gpus = detect_gpus()
            if gpus:
                vram = gpus[0].free
        except Exception:
            vram = None
    try:
        path = ensure_model(args.model, progress=lambda m: print(m, file=sys.stderr))
        facts = model_facts(path)
    except (GGUFError, CatalogError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_table(facts, vram, kv_types=[args.kv] if args.kv else None, n_seqs=max(1, args.seqs)))
    return 0
