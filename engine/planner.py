"""Memory plan: how much GPU memory a model needs at a given context length and KV cache types,
as the GPU path (engine/runner/runner.py) allocates it.

    total = weights + KV cache + per-slot state + workspace (+ vision projector, the MTP block's KV,
            a DFlash drafter)

Every number comes from the GGUF header (nothing is loaded):

* **weights**: what `DecoderModel.to_device` puts on the GPU, from the file's tensor index: quantized
  matrices repacked into kernels/quant/packing.py's layout (Q4_K 5 bits/value, Q6_K 7, ...; 4.625 and
  6.5625 with the scale codes kept, pack_weight(coded=True): exactly its planes + scales, `packed_bytes`),
  float matrices as they are, vectors as float32
  (qwen35's conv kernels also once more as float32). All tensors count, including the token embedding
  and the MTP block. (`ModelFacts.weight_bytes` stays the file's own byte count.)
* **KV cache**: one pool of `n_seqs x ctx` tokens that all sequences share (engine/runner/runner.py: blocks of
  16 tokens handed out as sequences grow; one sequence may use up to min(training context, the whole
  pool), so `ctx` is the context per sequence when all of them are equally long), in every attention
  layer (sliding-window layers too; the MTP block's KV is not in this pool: `Plan.mtp`), K and V of
  `n_head_kv` heads each, at the cache type's bytes per head (`head_bytes`; the rotated types pad
  each head to a multiple of 128 values), plus one block of 16 tokens for the padding rows' scratch
  slot. K and V may use different types (llama.cpp's -ctk / -ctv):

  ========== ====================== =========================================================
  type       block: values -> bytes  format (the KV cache issue's formats)
  ========== ====================== =========================================================
  f16        1 -> 2                  IEEE half (also f32: 1 -> 4, bf16: 1 -> 2)
  q8_0       32 -> 34                llama.cpp Q8_0: fp16 scale + 32 int8
  turbo4     128 -> 66               random rotation + 4-bit Lloyd-Max codes + fp16 norm
  turbo3     32 -> 14                random rotation + 3-bit Lloyd-Max codes + fp16 norm
  turbo2     32 -> 10                random rotation + 2-bit Lloyd-Max codes + fp16 norm
  turbo3_tcq 128 -> 52               trellis-coded, 3 bits/value + fp16 norm + state
  turbo2_tcq 128 -> 36               trellis-coded, 2 bits/value + fp16 norm + state
  ========== ====================== =========================================================

  (`kv_bytes` / `kv_bytes_per_token` are one sequence's KV as the CPU path's paged pool holds it:
  sliding-window layers capped at their window, the MTP block included.)
* **per-slot state**, for each slot (``Plan.recurrent``): the recurrent state of every Gated DeltaNet
  layer (qwen35), f32 as llama.cpp keeps it: the causal-conv window ``(ssm.conv_kernel - 1) * conv_dim``
  with ``conv_dim = 2 * ssm.group_count * ssm.state_size + ssm.inner_size``, and the state matrix
  ``ssm.time_step_rank * ssm.state_size * (ssm.inner_size / ssm.time_step_rank)``. For rotated K types
  also (``Plan.prep``, every slot and the scratch slot) the key preconditioning of each attention layer:
  float32 smoothing weights [n_head_kv, head_dim] and one center [n_head_kv, head_dim] per 256
  positions of the most one sequence may reach (``Plan.seq_ctx``). Neither grows with the tokens stored.
  Recurrent models also get state checkpoints for prefix sharing (``Plan.checkpoints``): as many
  one-slot recurrent states as fit in 2 % of the KV, at most 64 (the engine's default), when that is at
  least ``MIN_DEVICE_CHECKPOINTS`` (8); else the engine keeps them in host memory and the plan counts none
  (a 24 GiB card with the 27B, whose 150 MB states would not fit once).
* **workspace**: an allowance HiveJet defines (and the runner must stay inside):

  - CUDA context, cuBLAS/Triton handles: 400 MiB (`CUDA_CONTEXT_BYTES`; outside torch's allocator);
  - CUDA graphs' memory pool for the decode shapes and a small prompt chunk's graph: 384 MiB
    (`CUDA_GRAPH_BYTES`; reserved, mostly not allocated between steps; the 64-row chunk's graph reserved
    124 MiB more on the 27B, H200); the prompt chunk's graphs
    (engine/runner/prefill.py) share that pool and keep the chunk's activations below in it;
  - with several slots, the prompt pieces' pass graphs (several agents' short prompts in one pass of up to
    256 rows, engine/runner/runner.py: prefill_pieces): five 256-row passes' activations
    (``piece_graph_bytes``; 395 MiB on the 27B, where they reserve 390 on the H200;
    counted whenever a plan has several slots, as the engine's default has them; `serve --no-shared-passes`
    leaves that memory to the KV cache, and `plan --no-shared-passes` plans for it);
  - activations of one prefill chunk: ``step_tokens * (4 * n_embd + 3 * n_ff + q_dim + 2 * kv_dim) * 4``
    bytes (f32 residual, norms, QKV, FFN gate/up/down for every row of a 512-row chunk; a chunk of more
    rows adds four times that per row beyond 512, what its graph measured on the 27B), the fp16 copy
    of the largest matrix that a prompt chunk's matmul dequantizes (kernels/quant/packed.py:
    prefill_matmul; not the output matrix: the runner computes the last row's logits with the decode
    kernel), and for rotated K types the chunk's score-correction table ``step_tokens * n_head *
    ctx / 256 * 4`` bytes;
  - logits: ``max_seqs * 4 rows * vocab * 4`` bytes (each sequence's decode token plus up to three
    draft tokens get logits);
  - a prompt chunk's attention (`prompt_attention_bytes`): f16/bf16 caches gather one layer's K and V
    of the whole context (``ctx * (k + v values) * 2`` bytes), compressed ones decode pieces of 8192
    keys (``min(ctx, 8192) * (k + v values) * 14`` bytes).

  ``Plan.allocated`` is the total without the CUDA context and the graph pool: what
  `torch.cuda.max_memory_allocated` should show after a long prefill and decode (.ci/gpu/ctx200k.py
  checks it on the H200).

* **vision projector** (when a model has a paired mmproj, `engine.vision.find_mmproj`): its tensor bytes
  plus the workspace of encoding the largest image (`engine.vision.mmproj_info`). Projector types the
  engine cannot load are not counted (the model then loads without vision).

"Fits" means total <= the given VRAM (NVML's free memory when a GPU is present, else what the user
asks about). `max_context` finds the largest context (a multiple of 256 tokens, the KV pool's block
size, at most the model's training context) that fits for each cache type.

CLI: ``hivejet plan -m MODEL [--vram 24GiB] [--kv TYPE] [--kv-v TYPE] [--seqs N] [--ctx N]`` prints the
table (with --ctx: the breakdown of one plan).
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from engine.gguf.reader import GGUFError, GGUFFile
from engine.gguf.spec import spec_from_gguf
from kernels.packed_layout import packed_bytes

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
# accepted but not in the planner's table
KV_EXTRA_TYPES: dict[str, tuple[int, int]] = {"f32": (1, 4), "bf16": (1, 2)}
ROTATED_TYPES = ("turbo4", "turbo3", "turbo2", "turbo3_tcq", "turbo2_tcq")   # heads padded to 128 values
ROTATION_GROUP = 128
KEY_SEGMENT = 256            # positions per key center (engine/kv/sequence.py: SequenceKV.SEGMENT)
SLOT_BLOCK_TOKENS = 16       # the runner's block size (its scratch slot holds one block)
DECODED_PIECE_TOKENS = 8192     # engine/runner/attention.py DECODED_PIECE (tests check they agree)
CONTEXTS = (8192, 16384, 32768, 65536, 131072, 204800, 262144)
KV_BLOCK_TOKENS = 256

CUDA_CONTEXT_BYTES = 400 * MiB
CUDA_GRAPH_BYTES = 384 * MiB   # (256 for the decode graphs, 128 for the 64-row prompt chunk's)
PIECE_PASS_ROWS = 256          # engine/runner/runner.py PIECE_PASS_ROWS (tests check they agree)
# recurrent-state checkpoints (EngineConfig.checkpoint_memory): "auto" keeps the default ones on the device
# when 2 % of the KV cache holds at least MIN_DEVICE_CHECKPOINTS, else in pinned host memory, up to
# HOST_CHECKPOINTS in an eighth of the RAM and at most HOST_CHECKPOINT_BYTES (engine/runner_fit.py)
DEVICE_CHECKPOINT_SHARE = 0.02   # of the KV cache, for the default device checkpoints
MAX_DEVICE_CHECKPOINTS = 64
MIN_DEVICE_CHECKPOINTS = 8
HOST_CHECKPOINTS = 32
HOST_CHECKPOINT_BYTES = 4 << 30
# the prompt pieces' pass graphs (several slots' short prompts in one pass, up to PIECE_PASS_ROWS rows) in
# 256-row passes' activations: 984 against 594 MiB of prompt graphs on the 27B, H200 (docs/PERFORMANCE.md)
PIECE_GRAPH_PASSES = 5
STEP_TOKENS = 512
LOGIT_ROWS_PER_SEQ = 4


# The prompt chunk `prefill_chunk=0` picks (H200, synthetic 27B, a 20K prompt beside three decoding agents,
# docs/PERFORMANCE.md: its first token after 12.0 s at 256, 9.05 s at 512, 7.94 s at
# 1024; llama-server 8.88 s). The larger chunk only where it costs little: on a 24 GiB card 1024 takes a
# third of the 27B's KV pool (activation_bytes), 512 takes 3.7 % more than 256 did.
PREFILL_CHUNK = 512
PREFILL_CHUNK_LARGE = 1024
LARGE_CHUNK_FREE = 16 * GiB     # bytes free after the weights for PREFILL_CHUNK_LARGE


def device_checkpoint_count(kv_bytes: int, one_ckpt: int) -> int:
    """Default number of device state checkpoints of `one_ckpt` bytes beside a KV cache of `kv_bytes`."""
    return min(MAX_DEVICE_CHECKPOINTS, int(DEVICE_CHECKPOINT_SHARE * kv_bytes) // one_ckpt) if one_ckpt else 0


def host_checkpoint_count(one_ckpt: int) -> int:
    """Default number of host-memory state checkpoints of `one_ckpt` bytes each on this machine."""
    from engine.hostmem import physical_memory
    return min(HOST_CHECKPOINTS, min(HOST_CHECKPOINT_BYTES, physical_memory() // 8) // one_ckpt)


def auto_prefill_chunk(free_after_weights: int | None) -> int:
    """The prompt chunk for prefill_chunk=0: PREFILL_CHUNK_LARGE on a GPU with at least LARGE_CHUNK_FREE
    bytes free once the weights are loaded (None: the CPU, or a pool size given), else PREFILL_CHUNK."""
    if free_after_weights is not None and free_after_weights >= LARGE_CHUNK_FREE:
        return PREFILL_CHUNK_LARGE
    return PREFILL_CHUNK


def planned_chunk(facts: "ModelFacts", vram: int | None) -> int:
    """The prompt chunk the engine would take for this model on a card of `vram` bytes (None: unknown)."""
    weights = facts.device_weight_bytes or facts.weight_bytes
    return auto_prefill_chunk(vram - CUDA_CONTEXT_BYTES - weights if vram else None)


def kv_bytes_per_value(kv_type: str) -> float:
    vals, nbytes = _kv_type(kv_type)
    return nbytes / vals


def _kv_type(kv_type: str) -> tuple[int, int]:
    t = KV_TYPES.get(kv_type) or KV_EXTRA_TYPES.get(kv_type)
    if t is None:
        raise ValueError(f"unknown KV cache type {kv_type!r} (choose from {', '.join(KV_TYPES)})")
    return t


def head_bytes(head_dim: int, kv_type: str) -> int:
    """Bytes of one head's K (or V) row in a cache type (kernels/kvcodec: codec.row_bytes): rotated
    types pad the head to a multiple of 128 values."""
    vals, nbytes = _kv_type(kv_type)
    d = -(-head_dim // ROTATION_GROUP) * ROTATION_GROUP if kv_type in ROTATED_TYPES else head_dim
    return math.ceil(d / vals) * nbytes


def device_weight_bytes(tensors) -> tuple[int, int]:
    """(bytes the weights take on the GPU, the largest fp16 copy a prompt chunk's matmul makes of one
    matrix other than the output matrix) for GGUF TensorInfos (see the module docstring)."""
    from gguf import GGMLQuantizationType as QT
    total = biggest = 0
    for t in tensors:
        name = QT(t.qtype).name
        n_el = math.prod(t.shape)
        if len(t.shape) == 1:
            total += 4 * n_el                      # vectors: float32
            continue
        n, k = t.shape[0], n_el // t.shape[0]
        pb = packed_bytes(name, n, k)
        total += t.n_bytes if pb is None else pb
        if t.name.endswith("ssm_conv1d.weight"):
            total += 4 * n_el                      # qwen35 keeps its conv kernel as float32 as well
        if pb is not None and t.name not in ("output.weight", "token_embd.weight"):
            biggest = max(biggest, 2 * n * k)
    return total, biggest


def decode_read_bytes(tensors, n_layer: int) -> int:
    """Bytes of weights one decode step reads on the GPU (their packed layout, as device_weight_bytes counts
    them): every tensor of blocks 0 .. n_layer - 1 and the output, the token embedding table only for its
    rows (nothing counted) unless it is also the output matrix (no output.weight), the MTP blocks not at all.
    Bandwidth / this is the decode ceiling (engine/cards.py)."""
    import re

    from gguf import GGMLQuantizationType as QT
    tensors = list(tensors)
    tied = not any(t.name == "output.weight" for t in tensors)
    total = 0
    for t in tensors:
        blk = re.match(r"blk\.(\d+)\.", t.name)
        if (blk and int(blk.group(1)) >= n_layer) or (t.name == "token_embd.weight" and not tied):
            continue
        n_el = math.prod(t.shape)
        pb = packed_bytes(QT(t.qtype).name, t.shape[0], n_el // t.shape[0]) if len(t.shape) > 1 else None
        total += 4 * n_el if len(t.shape) == 1 else (t.n_bytes if pb is None else pb)
    return total


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
    # per attention layer: (K values per token, V values per token, window or 0 for full); MTP blocks last
    attn_layers: list[tuple[int, int, int]] = field(default_factory=list)
    n_recurrent_layers: int = 0
    recurrent_bytes_per_layer: int = 0
    n_head_kv: int = 0
    head_dim_v: int = 0
    n_layer: int = 0                # blocks, MTP blocks not counted
    n_layer_nextn: int = 0          # MTP blocks (the last entries of attn_layers)
    device_weight_bytes: int = 0    # the weights as the GPU path holds them (packed layout)
    prefill_dequant_bytes: int = 0  # the largest fp16 copy of a matrix a prompt chunk's matmul makes
    decode_read_bytes: int = 0      # weights a decode step reads (decode_read_bytes: the decode ceiling)
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
    def gpu_attn_layers(self) -> int:
        """Attention layers with KV in the main pool (the MTP block's has its own: Plan.mtp)."""
        return len(self.attn_layers) - self.n_layer_nextn

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
        return facts_from_file(f)
    finally:
        f.close()


def facts_from_file(f: GGUFFile) -> ModelFacts:
    """ModelFacts of an open GGUF file (an engine's model has its header read already)."""
    path = f.path
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
    dev_bytes, dequant = device_weight_bytes(f.tensors.values())
    return ModelFacts(
        path=str(path), name=str(md.get("general.name") or Path(path).stem), arch=spec.arch,
        weight_bytes=weight_bytes, file_bytes=Path(path).stat().st_size, context_length=spec.context_length,
        n_embd=spec.n_embd, n_ff=spec.n_ff, vocab_size=spec.vocab_size, n_head=spec.n_head,
        head_dim=spec.head_dim, attn_layers=attn, n_recurrent_layers=n_rec,
        recurrent_bytes_per_layer=rec_per_layer, quant=file_type_name(md), n_head_kv=spec.n_head_kv,
        head_dim_v=spec.head_dim_v, n_layer=spec.n_layer, n_layer_nextn=spec.n_layer_nextn,
        device_weight_bytes=dev_bytes,
        prefill_dequant_bytes=dequant, decode_read_bytes=decode_read_bytes(f.tensors.values(), spec.n_layer))


def _token_bytes(facts: ModelFacts, kv_type: str, kv_type_v: str | None) -> int:
    """K + V bytes of one token in one attention layer."""
    if not facts.n_head_kv:   # (facts made by hand: values per token, blocks along the concatenated heads)
        k_vals, v_vals, _ = facts.attn_layers[0]
        vals, nb = _kv_type(kv_type)
        vals_v, nb_v = _kv_type(kv_type_v or kv_type)
        return math.ceil(k_vals / vals) * nb + math.ceil(v_vals / vals_v) * nb_v
    return facts.n_head_kv * (head_bytes(facts.head_dim, kv_type) + head_bytes(facts.head_dim_v, kv_type_v or kv_type))


def kv_bytes(facts: ModelFacts, ctx: int, kv_type: str, kv_type_v: str | None = None) -> int:
    """KV cache bytes of one sequence holding `ctx` tokens in the CPU path's pool (sliding-window
    layers capped at their window; the MTP block included)."""
    per = _token_bytes(facts, kv_type, kv_type_v) if facts.attn_layers else 0
    return sum((min(ctx, window) if window else ctx) * per for *_, window in facts.attn_layers)


def kv_bytes_per_token(facts: ModelFacts, kv_type: str, kv_type_v: str | None = None) -> int:
    """KV bytes each token adds while the context is below every sliding window."""
    return len(facts.attn_layers) * _token_bytes(facts, kv_type, kv_type_v) if facts.attn_layers else 0


def runner_kv_bytes(facts: ModelFacts, ctx: int, kv_type: str, kv_type_v: str | None = None, n_slots: int = 1) -> int:
    """The GPU path's KV: `n_slots` slots of `ctx` tokens (rounded up to its 16-token blocks) in every
    attention layer of the main model, plus the scratch slot's one block (engine/runner/runner.py)."""
    if not facts.attn_layers:
        return 0
    per = facts.gpu_attn_layers * _token_bytes(facts, kv_type, kv_type_v)
    ctx = -(-ctx // SLOT_BLOCK_TOKENS) * SLOT_BLOCK_TOKENS
    return per * (n_slots * ctx + SLOT_BLOCK_TOKENS)


def prep_bytes(facts: ModelFacts, ctx: int, kv_type: str) -> int:
    """One slot's key preconditioning (rotated K types): per attention layer, float32 weights and one
    center per 256 positions, [n_head_kv, head_dim] each, and a segment count (engine/runner/runner.py:
    slot_prep_bytes)."""
    if kv_type not in ROTATED_TYPES or not facts.attn_layers:
        return 0
    n_seg = max(1, -(-ctx // KEY_SEGMENT))
    return facts.gpu_attn_layers * (4 * facts.n_head_kv * facts.head_dim * (1 + n_seg) + 8)


def activation_bytes(facts: ModelFacts, ctx: int = 0, kv_type: str = "f16", max_seqs: int = 1,
                     step_tokens: int = STEP_TOKENS, kv_type_v: str | None = None) -> int:
    """What a prompt chunk (and the logits) allocate at most on top of weights and states: see the
    module docstring."""
    row = _row_bytes(facts)
    act = step_tokens * row
    # prompt chunks over STEP_TOKENS rows: their graphs' pool grows by about four more such rows per row
    # (27B on a 24 GiB card, 1024 against 512 rows: 0.62 GiB less left free than planned; the 512 rows
    # themselves sit in CUDA_GRAPH_BYTES and the 10 % margin)
    act += 4 * max(0, step_tokens - STEP_TOKENS) * row
    if kv_type in ROTATED_TYPES and facts.attn_layers:
        act += step_tokens * facts.n_head * max(1, -(-ctx // KEY_SEGMENT)) * 4   # score corrections
    logits = max(1, max_seqs) * LOGIT_ROWS_PER_SEQ * facts.vocab_size * 4
    return act + facts.prefill_dequant_bytes + logits + prompt_attention_bytes(facts, ctx, kv_type, kv_type_v)


def _row_bytes(facts: ModelFacts) -> int:
    """One prompt row's activations: f32 residual, norms, QKV, FFN gate/up/down."""
    q_dim = facts.n_head * facts.head_dim
    kv_dim = facts.attn_layers[0][0] if facts.attn_layers else 0
    return (4 * facts.n_embd + 3 * facts.n_ff + q_dim + 2 * kv_dim) * 4


def piece_graph_bytes(facts: ModelFacts, max_seqs: int, shared_passes: bool = True) -> int:
    """The graph pool the prompt pieces' passes add (engine/runner/runner.py: prefill_pieces); none with one slot,
    where every prompt runs alone, or with the shared passes off (`serve --no-shared-passes`)."""
    if max_seqs <= 1 or not shared_passes:
        return 0
    return PIECE_GRAPH_PASSES * PIECE_PASS_ROWS * _row_bytes(facts)


def prompt_attention_bytes(facts: ModelFacts, ctx: int, kv_type: str, kv_type_v: str | None = None) -> int:
    """What a prompt chunk's attention over `ctx` positions holds at once on the GPU path
    (engine/runner/attention.py): f16/bf16 K and V gathered into one contiguous copy of one layer's
    context; the compressed types decoded a piece of DECODED_PIECE_TOKENS keys at a time (float32
    decode, its rotation back, the un-preconditioned keys, and their fp16 copy: 14 bytes a value);
    f32 caches are read in place."""
    if not facts.attn_layers or not ctx:
        return 0
    k_vals, v_vals, _ = facts.attn_layers[0]
    types = {kv_type, kv_type_v or kv_type}
    if types <= {"f16", "bf16"}:
        return ctx * (k_vals + v_vals) * 2
    if "f32" in types:
        return 0
    return min(ctx, DECODED_PIECE_TOKENS) * (k_vals + v_vals) * 14


def workspace_bytes(facts: ModelFacts, max_seqs: int = 1, step_tokens: int = STEP_TOKENS, ctx: int = 0,
                    kv_type: str = "f16", shared_passes: bool = True) -> int:
    return (CUDA_CONTEXT_BYTES + CUDA_GRAPH_BYTES + piece_graph_bytes(facts, max_seqs, shared_passes)
            + activation_bytes(facts, ctx, kv_type, max_seqs, step_tokens))


@dataclass
class Plan:
    ctx: int
    kv_type: str
    n_seqs: int
    weights: int
    kv: int
    recurrent: int                  # recurrent states of all slots
    workspace: int
    vram: int | None = None
    vision: int = 0                 # vision projector weights + image-encoding workspace
    kv_type_v: str = ""             # V's cache type ("" = kv_type)
    prep: int = 0                   # key preconditioning of all slots (rotated K types)
    seq_ctx: int = 0                # the most tokens one sequence may hold: min(training context, pool)
    checkpoints: int = 0            # recurrent-state checkpoints for prefix sharing (qwen35): the engine's
                                    # default, as many one-slot states as fit in 2 % of the KV, at most 64
                                    # (when at least MIN_DEVICE_CHECKPOINTS do)
    host_checkpoints: int = 0       # else the most they take in this machine's host RAM (not in `total`)
    mtp: int = 0                    # the MTP block's own KV when drafting with it (--spec mtp)
    drafter: int = 0                # a DFlash drafter's weights and context K/V (--spec dflash)

    @property
    def pool_tokens(self) -> int:
        """The KV pool all sequences share: n_seqs x ctx tokens."""
        return self.n_seqs * self.ctx

    @property
    def total(self) -> int:
        return (self.weights + self.kv + self.recurrent + self.prep + self.checkpoints + self.workspace
                + self.vision + self.mtp + self.drafter)

    @property
    def allocated(self) -> int:
        """What torch's allocator holds at the peak (the total without the CUDA context and the graph pool)."""
        return self.total - CUDA_CONTEXT_BYTES - CUDA_GRAPH_BYTES

    @property
    def fits(self) -> bool | None:
        return None if self.vram is None else self.total <= self.vram

    @property
    def headroom(self) -> int | None:
        return None if self.vram is None else self.vram - self.total

    def breakdown(self) -> dict:
        return {"ctx": self.ctx, "kv_type_k": self.kv_type, "kv_type_v": self.kv_type_v or self.kv_type,
                "slots": self.n_seqs, "pool_tokens": self.pool_tokens, "seq_ctx": self.seq_ctx,
                "weights": self.weights, "kv": self.kv, "recurrent": self.recurrent,
                "prep": self.prep, "checkpoints": self.checkpoints, "host_checkpoints": self.host_checkpoints,
                "workspace": self.workspace,
                "vision": self.vision, "mtp": self.mtp, "drafter": self.drafter, "total": self.total,
                "allocated": self.allocated}


def mtp_cache_type(kv_type: str, kv_type_v: str | None = None) -> str:
    """The GPU path's cache type for the MTP block's own KV (K and V): f16 beside float caches, q8_0 beside
    compressed ones (its one layer goes through the torch codecs: q8_0 keeps them cheap, near lossless)."""
    return "f16" if {kv_type, kv_type_v or kv_type} <= {"f16", "bf16", "f32"} else "q8_0"


def mtp_token_bytes(n_head_kv: int, head_dim: int, head_dim_v: int, kv_type: str, kv_type_v: str | None = None) -> int:
    """K + V bytes of one position in one MTP block's cache on the GPU path (mtp_cache_type)."""
    t = mtp_cache_type(kv_type, kv_type_v)
    return n_head_kv * (head_bytes(head_dim, t) + head_bytes(head_dim_v, t))


def mtp_kv_bytes(facts: ModelFacts, pool_tokens: int, kv_type: str, kv_type_v: str | None = None) -> int:
    """The MTP block's KV on the GPU path (engine/runner/mtp.py: MtpSlots): one more layer in the pool's block
    layout (its rows in the slots' blocks), the pool's 16-token blocks and the scratch block."""
    if not facts.n_layer_nextn:
        return 0
    blocks = -(-pool_tokens // SLOT_BLOCK_TOKENS) + 1
    per_token = mtp_token_bytes(facts.n_head_kv, facts.head_dim, facts.head_dim_v, kv_type, kv_type_v)
    return facts.n_layer_nextn * per_token * blocks * SLOT_BLOCK_TOKENS


def drafter_bytes(drafter, pool_tokens: int) -> int:
    """A DFlash drafter (engine/spec/dflash.py: DFlashDrafter) on the GPU path: its weights as the engine
    holds them (bfloat16 matrices) and its context K/V (bfloat16) for every pool token, as the engine's
    memory fit reserves it (engine/spec/speculator.py: drafter_bytes_per_token)."""
    return drafter.device_weight_bytes() + drafter.context_bytes_per_token() * pool_tokens


def plan(facts: ModelFacts, ctx: int, kv_type: str = "f16", n_seqs: int = 1, vram: int | None = None,
         kv_type_v: str | None = None, step_tokens: int = 0, mtp: bool = False,
         drafter=None, shared_passes: bool = True) -> Plan:
    """GPU memory of the runner with `n_seqs` slots sharing a KV pool of `n_seqs x ctx` tokens (K in
    kv_type, V in kv_type_v, default the same), prompt chunks of `step_tokens` (0: the engine's automatic
    choice for a card of `vram` bytes, auto_prefill_chunk). One sequence may hold
    up to min(training context, the pool) tokens: the key preconditioning is sized for that. mtp: drafting
    with the model's MTP block (its own KV counted); drafter: a loaded DFlash drafter (drafter_bytes);
    shared_passes: the engine reads several slots' arriving prompts in one pass (EngineConfig.shared_prompt_passes,
    on by default), whose graphs are counted in the workspace."""
    if ctx <= 0:
        raise ValueError("context must be positive")
    kv_type_v = kv_type_v or kv_type
    _kv_type(kv_type_v)
    seq_ctx = seq_context(facts, ctx, n_seqs)
    step_tokens = step_tokens or planned_chunk(facts, vram)
    kv = runner_kv_bytes(facts, ctx, kv_type, kv_type_v, n_seqs)
    one = facts.recurrent_bytes
    n_ckpt = device_checkpoint_count(kv, one)
    checkpoints = n_ckpt * one if n_ckpt >= MIN_DEVICE_CHECKPOINTS else 0   # (fewer: in host memory)
    host_ckpt = host_checkpoint_count(one) * one if one and not checkpoints else 0
    return Plan(ctx=ctx, kv_type=kv_type, n_seqs=n_seqs, weights=facts.device_weight_bytes or facts.weight_bytes,
                kv=kv, recurrent=n_seqs * facts.recurrent_bytes, checkpoints=checkpoints,
                host_checkpoints=host_ckpt,
                workspace=workspace_bytes(facts, n_seqs, step_tokens, seq_ctx, kv_type, shared_passes), vram=vram,
                vision=facts.vision_bytes, kv_type_v=kv_type_v if kv_type_v != kv_type else "",
                prep=(n_seqs + 1) * prep_bytes(facts, seq_ctx, kv_type), seq_ctx=seq_ctx,
                mtp=mtp_kv_bytes(facts, n_seqs * ctx, kv_type, kv_type_v) if mtp else 0,
                drafter=drafter_bytes(drafter, n_seqs * ctx) if drafter is not None else 0)


def seq_context(facts: ModelFacts, ctx: int, n_seqs: int = 1) -> int:
    """The most tokens one sequence may hold with a pool of n_seqs x ctx tokens (in the runner's blocks):
    the whole pool, up to the training context (what engine.Engine gives each sequence)."""
    pool = n_seqs * (-(-ctx // SLOT_BLOCK_TOKENS) * SLOT_BLOCK_TOKENS)
    limit = facts.context_length or pool
    return min(-(-limit // SLOT_BLOCK_TOKENS) * SLOT_BLOCK_TOKENS, pool)


def max_context(facts: ModelFacts, kv_type: str, vram: int, n_seqs: int = 1, limit: int | None = None,
                kv_type_v: str | None = None, shared_passes: bool = True) -> int:
    """Largest context (multiple of KV_BLOCK_TOKENS, at most `limit` = the model's training context)
    whose plan fits in `vram`; 0 when not even one block fits."""
    limit = limit or facts.context_length
    hi_blocks = max(limit // KV_BLOCK_TOKENS, 1)

    def fits(c):
        return plan(facts, c, kv_type, n_seqs, vram, kv_type_v, shared_passes=shared_passes).total <= vram
    if not fits(KV_BLOCK_TOKENS):
        return 0
    top = hi_blocks * KV_BLOCK_TOKENS
    if fits(top):
        return min(top, limit)
    lo, hi = 1, hi_blocks  # lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * KV_BLOCK_TOKENS):
            lo = mid
        else:
            hi = mid
    return lo * KV_BLOCK_TOKENS


def plan_table(facts: ModelFacts, vram: int | None, contexts=CONTEXTS, kv_types=None, n_seqs: int = 1,
               kv_type_v: str | None = None, shared_passes: bool = True) -> dict[str, list[Plan]]:
    """{kv type: [Plan for each context]} (V in kv_type_v, or each row's K type)."""
    kv_types = list(kv_types or KV_TYPES)
    return {kt: [plan(facts, c, kt, n_seqs, vram, kv_type_v, shared_passes=shared_passes) for c in contexts]
            for kt in kv_types}


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
