"""`hivejet plan`: the memory planner's tables and breakdowns printed for a model (engine/planner.py computes
them; this module only formats and reads the command's arguments, and asks NVML for the free memory)."""
from __future__ import annotations

import sys
from pathlib import Path

from engine.gguf.reader import GGUFError
from engine.planner import (CONTEXTS, GiB, KV_TYPES, KV_EXTRA_TYPES, ModelFacts, Plan, fmt_bytes, fmt_ctx, max_context,
                            model_facts, mtp_cache_type, parse_size, piece_graph_bytes, plan, plan_table,
                            planned_chunk, workspace_bytes)


def format_table(facts: ModelFacts, vram: int | None, kv_types=None, n_seqs: int = 1,
                 kv_type_v: str | None = None, shared_passes: bool = True) -> str:
    table = plan_table(facts, vram, kv_types=kv_types, n_seqs=n_seqs, kv_type_v=kv_type_v,
                       shared_passes=shared_passes)
    chunk = planned_chunk(facts, vram)
    lines = [f"{facts.name} ({facts.arch}{', ' + facts.quant if facts.quant else ''}): weights "
             f"{fmt_bytes(facts.weight_bytes)} ({fmt_bytes(facts.device_weight_bytes)} on the GPU), "
             f"{facts.n_full_attn} full-attention + {facts.n_swa} sliding-window "
             f"attention layers, {facts.n_recurrent_layers} recurrent layers "
             f"({fmt_bytes(facts.recurrent_bytes)} state per sequence), training context {facts.context_length}",
             f"workspace allowance {fmt_bytes(workspace_bytes(facts, n_seqs, chunk, shared_passes=shared_passes))} "
             f"for prompt chunks of {chunk} tokens (+ key centers for rotated K types"
             + (f"; {fmt_bytes(piece_graph_bytes(facts, n_seqs))} of it for reading several slots' arriving "
                "prompts in one pass, which --no-shared-passes leaves to the KV cache"
                if piece_graph_bytes(facts, n_seqs, shared_passes) else "") + "); "
             + (f"VRAM {fmt_bytes(vram)}" if vram else "no VRAM given: totals only")
             + (f"; {n_seqs} sequences" if n_seqs > 1 else "") + (f"; V cache {kv_type_v}" if kv_type_v else "")]
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
            row += f"   {max_context(facts, kt, vram, n_seqs, kv_type_v=kv_type_v, shared_passes=shared_passes):>11}"
        lines.append(row)
    lines.append("")
    lines.append("cells: total GiB (weights + KV + per-slot state + workspace"
                 + (" + vision projector" if facts.mmproj else "") + "); ok = fits, -- = does not fit, "
                 "n/a = beyond the model's training context")
    if n_seqs > 1:
        lines.append(f"context per sequence when all {n_seqs} are equally long: the KV pool ({n_seqs} x the "
                     "context) is shared, so one sequence may use up to all of it (at most the training context)")
    return "\n".join(lines)


def format_plan(p: Plan) -> str:
    """One plan's breakdown (`hivejet plan --ctx N`)."""
    rows = [("weights (on the GPU)", p.weights), (f"KV cache ({p.kv_type} / {p.kv_type_v or p.kv_type})", p.kv),
            ("recurrent states", p.recurrent), ("key preconditioning", p.prep),
            ("state checkpoints", p.checkpoints), ("workspace", p.workspace)]
    if p.vision:
        rows.append(("vision projector", p.vision))
    if p.mtp:
        rows.append((f"MTP block's KV ({mtp_cache_type(p.kv_type, p.kv_type_v or None)})", p.mtp))
    if p.drafter:
        rows.append(("DFlash drafter (weights, context K/V)", p.drafter))
    rows += [("total", p.total), ("allocated by torch (total - CUDA context - graph pool)", p.allocated)]
    out = [f"context {p.ctx} tokens x {p.n_seqs} slot(s): a KV pool of {p.pool_tokens} tokens they share; "
           f"one sequence may use up to {p.seq_ctx}"]
    out += [f"  {name:<56} {n:>15,} B  {fmt_bytes(n):>10}" for name, n in rows]
    if p.vram:
        out.append(f"  {'fits in ' + fmt_bytes(p.vram):<56} {'yes' if p.fits else 'no'}")
    if p.host_checkpoints:
        out.append(f"  state checkpoints in host RAM instead (too few fit in 2 % of the KV cache): up to "
                   f"{fmt_bytes(p.host_checkpoints)}, not in the total")
    return "\n".join(out)


def add_plan_args(parser) -> None:
    parser.add_argument("-m", "--model", default="demo", help="GGUF file or catalog name")
    parser.add_argument("--vram", default=None, help="GPU memory to plan for, e.g. 24GiB (default: free memory "
                                                     "of GPU 0 from NVML; none -> totals only)")
    parser.add_argument("--kv", default=None, choices=list(KV_TYPES) + list(KV_EXTRA_TYPES),
                        help="only this KV cache type (K, and V unless --kv-v)")
    parser.add_argument("--kv-v", default=None, choices=list(KV_TYPES) + list(KV_EXTRA_TYPES),
                        help="V's cache type (default: each row's K type)")
    parser.add_argument("--seqs", type=int, default=1, help="parallel sequences (the GPU path's slots)")
    parser.add_argument("--ctx", type=int, default=None, help="print the breakdown of one plan: this context "
                                                               "per sequence, the --kv type (default f16)")
    parser.add_argument("--no-shared-passes", dest="shared_passes", action="store_false",
                        help="plan for `hivejet serve --no-shared-passes`: several slots' arriving prompts are "
                             "not read in one pass, so those passes' graphs are not in the workspace")
    parser.add_argument("--mtp", action="store_true", help="with --ctx: drafting with the model's MTP block "
                                                           "(--spec mtp): count its own KV")
    parser.add_argument("--drafter", default=None, metavar="DFLASH",
                        help="with --ctx: drafting with this DFlash drafter (--spec dflash --spec-drafter "
                             "DFLASH: a directory or GGUF): count its weights and context")
    parser.add_argument("--card", default=None, metavar="NAME",
                        help="print the decode ceiling on this card (engine/cards.py: rtx3090, rtx4090, rtx5090, "
                             "a100-40gb, a100-80gb, h100, h200, ...; default: GPU 0 when the table knows it)")


def ceiling(facts: ModelFacts, card_name: str | None, gpus) -> str:
    """The decode ceiling line for the named card, else GPU 0's; ValueError for an unknown name."""
    from engine.cards import card, card_for_device, ceiling_line
    c = card(card_name) if card_name else (card_for_device(gpus[0].name, gpus[0].total) if gpus else None)
    if c is None:
        return ("decode ceiling: " + (f"{gpus[0].name} is not in the card table" if gpus else "no GPU here")
                + "; name one with --card (e.g. --card rtx3090)")
    return ceiling_line(facts.decode_read_bytes, c)


def run_plan(args) -> int:
    from engine.catalog import CatalogError, ensure_model
    try:
        vram = parse_size(args.vram) if args.vram else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        from app.gpu import detect_gpus
        gpus = detect_gpus()
    except Exception:
        gpus = []
    if vram is None and gpus:
        vram = gpus[0].free
    try:
        path = ensure_model(args.model, progress=lambda m: print(m, file=sys.stderr))
        facts = model_facts(path)
    except (GGUFError, CatalogError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        top = ceiling(facts, getattr(args, "card", None), gpus)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kv_v = getattr(args, "kv_v", None)
    shared = getattr(args, "shared_passes", True)
    if getattr(args, "ctx", None):
        if getattr(args, "mtp", False) and not facts.n_layer_nextn:
            print(f"error: {facts.name} has no MTP block", file=sys.stderr)
            return 2
        drafter = None
        if getattr(args, "drafter", None):
            from engine.spec.dflash import DFlashError, load_drafter
            try:
                drafter = load_drafter(args.drafter)
                drafter.check_spec(facts)       # the engine's own check (sizes, layer ids, vocabulary)
            except (DFlashError, GGUFError, OSError) as e:
                print(f"error: DFlash drafter: {e}", file=sys.stderr)
                return 2
        print(format_plan(plan(facts, args.ctx, args.kv or "f16", max(1, args.seqs), vram, kv_v,
                               mtp=getattr(args, "mtp", False), drafter=drafter, shared_passes=shared)))
        print(top)
        return 0
    print(format_table(facts, vram, kv_types=[args.kv] if args.kv else None, n_seqs=max(1, args.seqs),
                       kv_type_v=kv_v, shared_passes=shared))
    print(top)
    return 0
