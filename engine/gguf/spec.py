"""ModelSpec: an architecture's hyper-parameters, read from GGUF metadata with llama.cpp's defaults."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.gguf.reader import GGUFError, GGUFFile


@dataclass
class ModelSpec:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int          # K (and Q) head size
    head_dim_v: int
    n_ff: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_base: float
    rope_dim: int          # dims rotated per head (partial rope when < head_dim)
    rope_freq_scale: float = 1.0
    rope_base_swa: float | None = None       # gemma3's local layers use their own base
    sliding_window: int = 0                  # 0 = no sliding-window layers
    swa_layers: tuple[bool, ...] = ()        # per layer: True where attention is sliding-window
    attn_scale: float | None = None          # q scaling; None -> 1/sqrt(head_dim)
    embd_scale: float = 1.0                  # gemma multiplies embeddings by sqrt(n_embd)
    extra: dict[str, Any] = field(default_factory=dict)
    # qwen35 (hybrid Gated DeltaNet + gated attention); n_layer counts the main layers only
    n_layer_nextn: int = 0                   # MTP (NextN) blocks stored after the main layers
    recurrent_layers: tuple[bool, ...] = ()  # per main layer: True where the layer is Gated DeltaNet
    rope_sections: tuple[int, ...] = ()      # M-RoPE sections (t, h, w, e) in rotated-dim pairs
    ssm_d_conv: int = 0                      # depthwise causal conv kernel
    ssm_d_state: int = 0                     # linear-attention K (and V) head dim
    ssm_n_group: int = 0                     # linear-attention K heads
    ssm_dt_rank: int = 0                     # linear-attention V heads
    ssm_d_inner: int = 0                     # V heads x V head dim

    def is_swa(self, layer: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[layer]

    def is_recurrent(self, layer: int) -> bool:
        return bool(self.recurrent_layers) and layer < len(self.recurrent_layers) and self.recurrent_layers[layer]


def _get(md: dict, path, key: str, default=None, required: bool = False):
    if key in md:
        return md[key]
    if required:
        raise GGUFError(path, f"missing metadata key {key!r}")
    return default


def _per_layer(value, n_layer: int, what: str, path) -> int:
    """Some keys are scalars or per-layer arrays; we need one value (engine limitation)."""
    if isinstance(value, list):
        vals = set(value)
        if len(vals) != 1:
            raise GGUFError(path, f"per-layer {what} values {sorted(vals)} are not supported")
        return int(value[0])
    return int(value)


def spec_from_gguf(f: GGUFFile) -> ModelSpec:
    md = f.metadata
    arch = f.architecture
    a = arch + "."
    p = f.path
    n_layer = int(_get(md, p, a + "block_count", required=True))
    n_embd = int(_get(md, p, a + "embedding_length", required=True))
    n_head = _per_layer(_get(md, p, a + "attention.head_count", required=True), n_layer, "head_count", p)
    n_head_kv = _per_layer(_get(md, p, a + "attention.head_count_kv", n_head), n_layer, "head_count_kv", p)
    if n_head <= 0 or n_head_kv <= 0 or n_head % n_head_kv:
        raise GGUFError(p, f"bad head counts: {n_head} heads, {n_head_kv} KV heads")
    head_dim = int(_get(md, p, a + "attention.key_length", n_embd // n_head))
    head_dim_v = int(_get(md, p, a + "attention.value_length", head_dim))
    n_ff = _per_layer(_get(md, p, a + "feed_forward_length", 0), n_layer, "feed_forward_length", p)
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = int(_get(md, p, a + "vocab_size", len(tokens) if tokens else 0))
    if vocab <= 0:
        raise GGUFError(p, "no vocabulary (neither vocab_size nor tokenizer.ggml.tokens)")
    scaling_type = _get(md, p, a + "rope.scaling.type", "none")
    factor = float(_get(md, p, a + "rope.scaling.factor", 0.0) or 0.0)
    freq_scale = 1.0 / factor if (factor and scaling_type in ("linear", "none", "yarn")) else 1.0
    if scaling_type not in ("none", "linear"):
        raise GGUFError(p, f"rope scaling type {scaling_type!r} is not supported yet")
    spec = ModelSpec(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, head_dim_v=head_dim_v, n_ff=n_ff, vocab_size=vocab,
        context_length=int(_get(md, p, a + "context_length", 4096)),
        rms_eps=float(_get(md, p, a + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_base=float(_get(md, p, a + "rope.freq_base", 10000.0)),
        rope_dim=int(_get(md, p, a + "rope.dimension_count", head_dim)),
        rope_freq_scale=freq_scale,
    )
    if arch == "gemma3":
        # llama.cpp: 5 sliding-window layers then 1 global (set_swa_pattern(6)); local rope base 10000;
        # q scaled by 1/sqrt(head_dim) (27B: 1/sqrt(n_embd/n_head)); embeddings scaled by sqrt(n_embd).
        spec.sliding_window = int(_get(md, p, a + "attention.sliding_window", 0))
        spec.swa_layers = tuple(il % 6 < 5 for il in range(n_layer)) if spec.sliding_window else ()
        spec.rope_base_swa = float(_get(md, p, a + "rope.freq_base_swa", 10000.0))
        spec.embd_scale = float(n_embd) ** 0.5
        is_27b = n_layer == 62
        spec.attn_scale = (n_embd / n_head) ** -0.5 if is_27b else head_dim ** -0.5
    if arch == "qwen35":
        _qwen35_hparams(spec, md, a, p, n_layer)
    return spec


def _qwen35_hparams(spec: ModelSpec, md: dict, a: str, p, n_layer_all: int) -> None:
    """llama.cpp src/models/qwen35.cpp load_arch_hparams. block_count includes the MTP blocks
    (nextn_predict_layers of them, stored after the main layers); spec.n_layer is the main layers."""
    n_nextn = int(_get(md, p, a + "nextn_predict_layers", 0))
    if not 0 <= n_nextn < n_layer_all:
        raise GGUFError(p, f"bad nextn_predict_layers {n_nextn} for {n_layer_all} blocks")
    n_main = n_layer_all - n_nextn
    spec.n_layer = n_main
    spec.n_layer_nextn = n_nextn
    spec.ssm_d_conv = int(_get(md, p, a + "ssm.conv_kernel", required=True))
    spec.ssm_d_inner = int(_get(md, p, a + "ssm.inner_size", required=True))
    spec.ssm_d_state = int(_get(md, p, a + "ssm.state_size", required=True))
    spec.ssm_dt_rank = int(_get(md, p, a + "ssm.time_step_rank", required=True))
    spec.ssm_n_group = int(_get(md, p, a + "ssm.group_count", required=True))
    if (spec.ssm_n_group <= 0 or spec.ssm_dt_rank % spec.ssm_n_group
            or spec.ssm_d_inner != spec.ssm_d_state * spec.ssm_dt_rank):
        raise GGUFError(p, f"bad linear-attention shape: {spec.ssm_n_group} K heads, {spec.ssm_dt_rank} V heads, "
                           f"state {spec.ssm_d_state}, inner {spec.ssm_d_inner} (V head dim must equal K head dim)")
    rec = md.get(a + "attention.recurrent_layers")
    if rec is not None:
        if len(rec) < n_main:
            raise GGUFError(p, f"attention.recurrent_layers has {len(rec)} entries for {n_main} layers")
        spec.recurrent_layers = tuple(bool(r) for r in rec[:n_main])
    else:
        interval = int(_get(md, p, a + "full_attention_interval", 4))
        spec.recurrent_layers = tuple((il + 1) % interval != 0 for il in range(n_main))
    sections = _get(md, p, a + "rope.dimension_sections", required=True)
    sections = [int(x) for x in (sections if isinstance(sections, list) else [sections])]
    spec.rope_sections = tuple((sections + [0, 0, 0, 0])[:4])
    if sum(spec.rope_sections) <= 0:
        raise GGUFError(p, f"bad rope.dimension_sections {sections}")
