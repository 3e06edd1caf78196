"""llama architecture (SmolLM2, Llama 2/3, Mistral), following llama.cpp's src/models/llama.cpp:
pre-norm blocks, RoPE over adjacent pairs (the converter permutes Q/K for that), optional
rope_freqs factors (Llama 3.1 scaling), SwiGLU FFN, output tied to the embedding when absent."""
from __future__ import annotations

import torch

from engine.models.common import Batch, DecoderModel, HeadPrep, Rope, default_attn_scale, rms_norm


class LlamaModel(DecoderModel):
    rope_neox = False

    def __init__(self, f, spec):
        super().__init__(f, spec)
        s, w = spec, self.w
        self.tok_embd = w.get("token_embd.weight", (s.vocab_size, s.n_embd))
        self.output_norm = w.get("output_norm.weight", (s.n_embd,))
        self.output = w.opt("output.weight", (s.vocab_size, s.n_embd)) or self.tok_embd
        factors = w.opt("rope_freqs.weight")
        self.rope = Rope(s.rope_dim, s.rope_base, s.rope_freq_scale,
                         factors.dense if factors is not None else None, neox=self.rope_neox)
        q_dim, kv_dim, v_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim, s.n_head_kv * s.head_dim_v
        self.layers = []
        for il in range(s.n_layer):
            p = f"blk.{il}."
            self.layers.append(dict(
                attn_norm=w.get(p + "attn_norm.weight", (s.n_embd,)),
                wq=w.get(p + "attn_q.weight", (q_dim, s.n_embd)),
                wk=w.get(p + "attn_k.weight", (kv_dim, s.n_embd)),
                wv=w.get(p + "attn_v.weight", (v_dim, s.n_embd)),
                bq=w.opt(p + "attn_q.bias", (q_dim,)),
                bk=w.opt(p + "attn_k.bias", (kv_dim,)),
                bv=w.opt(p + "attn_v.bias", (v_dim,)),
                q_norm=w.opt(p + "attn_q_norm.weight", (s.head_dim,)),
                k_norm=w.opt(p + "attn_k_norm.weight", (s.head_dim,)),
                wo=w.get(p + "attn_output.weight", (s.n_embd, s.n_head * s.head_dim_v)),
                bo=w.opt(p + "attn_output.bias", (s.n_embd,)),
                ffn_norm=w.get(p + "ffn_norm.weight", (s.n_embd,)),
                gate=w.get(p + "ffn_gate.weight", (s.n_ff, s.n_embd)),
                up=w.get(p + "ffn_up.weight", (s.n_ff, s.n_embd)),
                down=w.get(p + "ffn_down.weight", (s.n_embd, s.n_ff)),
            ))
            L = self.layers[-1]
            L["attn_in"] = self.stack(L["wq"], L["wk"], L["wv"])
            L["ffn_in"] = self.stack(L["gate"], L["up"])
        self.attn_scale = default_attn_scale(s)

    @staticmethod
    def _bias(y, b):
        return y + b.dense if b is not None else y

    def prepare(self, batch: Batch) -> None:
        batch.rope["main"] = self.rope.cos_sin(batch.positions)

    def layer(self, il: int, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        s, L = self.spec, self.layers[il]
        n = x.shape[0]
        h = rms_norm(x, L["attn_norm"].dense, s.rms_eps, L["attn_in"].input_dtype)
        q, k, v = L["attn_in"].matmul(h)
        q = self._bias(q, L["bq"]).view(n, s.n_head, s.head_dim)
        k = self._bias(k, L["bk"]).view(n, s.n_head_kv, s.head_dim)
        v = self._bias(v, L["bv"]).view(n, s.n_head_kv, s.head_dim_v)
        norms = (L["q_norm"].dense, L["k_norm"].dense) if L["q_norm"] is not None else (None, None)
        prep = HeadPrep(*norms, s.rms_eps, self.rope, *batch.rope["main"])
        a = self.attend_heads(il, q, k, v, batch, prep, self.attn_scale).reshape(n, -1)
        x = L["wo"].matmul(a, add=x) if L["bo"] is None else x + (L["wo"].matmul(a) + L["bo"].dense)
        h = rms_norm(x, L["ffn_norm"].dense, s.rms_eps, L["ffn_in"].input_dtype)
        return L["down"].matmul(L["ffn_in"].gated(h, "silu", L["down"].input_dtype), add=x)


class Qwen2Model(LlamaModel):
    """qwen2 (llama.cpp src/models/qwen2.cpp): the llama block with Q/K/V biases and NEOX rope."""

    rope_neox = True


class Qwen3Model(LlamaModel):
    """qwen3 (llama.cpp src/models/qwen3.cpp): per-head Q/K RMSNorm before rope, no biases, NEOX rope."""

    rope_neox = True
