"""The memory a runner takes per slot and per token of KV, by cache type: what the planner and the engine's
memory fit count (engine/planner.py) and the runner allocates."""
from __future__ import annotations

from engine.kv.sequence import SequenceKV
from engine.models.common import DecoderModel
from kernels.kvcodec import cache_type_name, get_codec

def attn_layers(spec) -> list[int]:
    return [il for il in range(spec.n_layer) if not spec.is_recurrent(il)]


def _types(cache_type_k: str, cache_type_v: str | None) -> tuple[str, str]:
    kt = cache_type_name(cache_type_k)
    return kt, cache_type_name(cache_type_v or kt)


def preconditions_keys(cache_type_k: str) -> bool:
    """Whether a K cache type gets the per-slot key preconditioning (rotated types)."""
    return get_codec(cache_type_k).rotated and SequenceKV.PRECONDITION_KEYS


def slot_bytes_per_token(model: DecoderModel, cache_type_k: str = "f16", cache_type_v: str | None = None) -> int:
    """KV bytes one token of one slot takes (all attention layers, K and V; rotated types pad each head
    to a multiple of 128 values). The per-slot state that does not grow per token is `slot_fixed_bytes`."""
    kt, vt = _types(cache_type_k, cache_type_v)
    s, ck, cv = model.spec, get_codec(kt), get_codec(vt)
    return len(attn_layers(s)) * s.n_head_kv * (ck.row_bytes(s.head_dim) + cv.row_bytes(s.head_dim_v))


def slot_prep_bytes(model: DecoderModel, cache_type_k: str = "f16", max_ctx: int = 0) -> int:
    """Key preconditioning bytes of one slot (rotated K types; the scratch slot has them too): per
    attention layer float32 weights [Hkv, D], centers [ceil(max_ctx / SEGMENT), Hkv, D], a segment count."""
    if not preconditions_keys(cache_type_name(cache_type_k)):
        return 0
    s = model.spec
    n_seg = max(1, -(-max_ctx // SequenceKV.SEGMENT))
    return len(attn_layers(s)) * (4 * s.n_head_kv * s.head_dim * (1 + n_seg) + 8)


def state_checkpoint_bytes(model: DecoderModel) -> int:
    """Bytes of one slot's recurrent states (qwen35: float32 conv windows and delta-rule states; 0 for
    models without recurrent layers): what one slot and one state checkpoint (enable_checkpoints) take."""
    s = model.spec
    n = 0
    for il in range(s.n_layer):
        if s.is_recurrent(il):
            n += 4 * ((s.ssm_d_conv - 1) * model.conv_dim + model.n_v_heads * model.d_state * model.d_state)
    return n


def draft_kept_bytes(model: DecoderModel, rows: int) -> int:
    """Bytes of the inputs a recurrent model's drafting steps keep for the commit (engine/runner/recurrent.py:
    float32 conv outputs, qkv, g and beta of up to `rows` rows per recurrent layer; 0 without recurrent layers)."""
    s = model.spec
    n = sum(1 for il in range(s.n_layer) if s.is_recurrent(il))
    return n and n * rows * 4 * (2 * model.conv_dim + 2 * model.n_v_heads)


def slot_fixed_bytes(model: DecoderModel, cache_type_k: str = "f16", cache_type_v: str | None = None,
                     max_ctx: int = 0) -> int:
    """Device bytes of one slot's state besides its KV: qwen35's recurrent states (float32 conv
    windows and delta-rule states) and the key preconditioning (`slot_prep_bytes`)."""
    return state_checkpoint_bytes(model) + slot_prep_bytes(model, cache_type_k, max_ctx)
