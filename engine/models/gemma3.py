"""gemma3 architecture, following llama.cpp's src/models/gemma3.cpp: embeddings scaled by
sqrt(n_embd); 5 sliding-window layers then 1 global; local layers use rope base 10000 and no rope
scaling; per-head Q/K RMSNorm; NEOX rope; norms after attention and after the FFN as well as
before; GELU(tanh)-gated FFN; output tied to the embedding. GGUF norm weights already hold the
(1 + w) of the HF model (the converter adds 1)."""
from __future__ import annotations

import torch

from engine.models.common import Batch, DecoderModel, HeadPrep, Rope, rms_norm


class Gemma3Model(DecoderModel):
    def __init__(self, f, spec):
        super().__init__(f, spec)
        s, w = spec, self.w
        self.tok_embd = w.get("token_embd.weight", (s.vocab_size, s.n_embd))
        self.output_norm = w.get("output_norm.weight", (s.n_embd,))
        self.output = w.opt("output.weight", (s.vocab_size, s.n_embd)) or self.tok_embd
        self.rope_global = Rope(s.rope_dim, s.rope_base, s.rope_freq_scale, neox=True)
        self.rope_local = Rope(s.rope_dim, s.rope_base_swa or s.rope_base, 1.0, neox=True)
        q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
        self.layers = []
        for il in range(s.n_layer):
            p = f"blk.{il}."
            self.layers.append(dict(
                attn_norm=w.get(p + "attn_norm.weight", (s.n_embd,)),
                wq=w.get(p + "attn_q.weight", (q_dim, s.n_embd)),
                wk=w.get(p + "attn_k.weight", (kv_dim, s.n_embd)),
                wv=w.get(p + "attn_v.weight", (s.n_head_kv * s.head_dim_v, s.n_embd)),
                q_norm=w.get(p + "attn_q_norm.weight", (s.head_dim,)),
                k_norm=w.get(p + "attn_k_norm.weight", (s.head_dim,)),
                wo=w.get(p + "attn_output.weight", (s.n_embd, s.n_head * s.head_dim_v)),
                post_attn_norm=w.get(p + "post_attention_norm.weight", (s.n_embd,)),
                ffn_norm=w.get(p + "ffn_norm.weight", (s.n_embd,)),
                gate=w.get(p + "ffn_gate.weight", (s.n_ff, s.n_embd)),
                up=w.get(p + "ffn_up.weight", (s.n_ff, s.n_embd)),
                down=w.get(p + "ffn_down.weight", (s.n_embd, s.n_ff)),
                post_ffn_norm=w.get(p + "post_ffw_norm.weight", (s.n_embd,)),
            ))
            L = self.layers[-1]
            L["attn_in"] = self.stack(L["wq"], L["wk"], L["wv"])
            L["ffn_in"] = self.stack(L["gate"], L["up"])

    def kv_rope(self, il: int):
        rope = self.rope_local if self.spec.is_swa(il) else self.rope_global
        return rope.dim, True, rope.inv_freq

    def prepare(self, batch: Batch) -> None:
        batch.rope[False] = self.rope_global.cos_sin(batch.positions)
        batch.rope[True] = self.rope_local.cos_sin(batch.positions)

    def layer(self, il: int, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        s, L = self.spec, self.layers[il]
        n = x.shape[0]
        local = s.is_swa(il)
        rope = self.rope_local if local else self.rope_global
        cos, sin = batch.rope[local]
        h = rms_norm(x, L["attn_norm"].dense, s.rms_eps, L["attn_in"].input_dtype)
        q, k, v = L["attn_in"].matmul(h)
        q = q.view(n, s.n_head, s.head_dim)
        k = k.view(n, s.n_head_kv, s.head_dim)
        v = v.view(n, s.n_head_kv, s.head_dim_v)
        prep = HeadPrep(L["q_norm"].dense, L["k_norm"].dense, s.rms_eps, rope, cos, sin)
        a = self.attend_heads(il, q, k, v, batch, prep, s.attn_scale, s.sliding_window if local else 0)
        a = L["wo"].matmul(a.reshape(n, -1))
        x = x + rms_norm(a, L["post_attn_norm"].dense, s.rms_eps)
        h = rms_norm(x, L["ffn_norm"].dense, s.rms_eps, L["ffn_in"].input_dtype)
        f = L["ffn_in"].gated(h, "gelu_tanh", L["down"].input_dtype)
        f = L["down"].matmul(f)
        return x + rms_norm(f, L["post_ffn_norm"].dense, s.rms_eps)
