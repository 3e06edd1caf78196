"""qwen35 architecture (Qwen3.5 / Qwen3.6 dense), following llama.cpp's src/models/qwen35.cpp and
delta-net-base.cpp (b11434) and the conversion in conversion/qwen.py.

A hybrid of two layer kinds (`spec.recurrent_layers`: by default 3 of every 4 layers are recurrent):
- Gated DeltaNet (linear attention with a per-sequence recurrent state): fused projection
  `attn_qkv` -> depthwise causal conv (`ssm_conv1d`, kernel 4, window kept per sequence) + SiLU ->
  q, k (K heads), v (V heads); q, k L2-normalized, q scaled by 1/sqrt(head_dim); V heads are in
  GGUF's tiled order, so V head j reads K head j % n_k_heads; beta = sigmoid(ssm_beta x), decay
  g = softplus(ssm_alpha x + ssm_dt.bias) * ssm_a (ssm_a = -exp(A_log)); the delta rule
  S <- exp(g) S + k (beta (v - (exp(g) S)^T k))^T, o = S^T q; then RMSNorm(o) * ssm_norm * silu(z)
  (z = attn_gate x) and `ssm_out`. A chunk of several tokens uses the chunkwise-parallel (WY / UT
  transform) form with chunks of 64, one token the recurrent form.
- gated full attention: `attn_q` holds [q, gate] per head; per-head Q/K RMSNorm; interleaved M-RoPE
  (IMROPE) over the first rope.dimension_count dims; output * sigmoid(gate) -> `attn_output`.
Every layer: attn_norm -> mixer -> residual; post_attention_norm -> SwiGLU FFN -> residual. GGUF norm
weights already hold the (1 + w) of the HF model, except ssm_norm.

The MTP (NextN) block stored after the main layers (`blk.{n_layer}.nextn.*`) is loaded when present;
`mtp_forward` runs it (eh_proj over [enorm(embedding of token p), hnorm(h_{p-1})], one gated-attention
block with its own KV, shared_head_norm, the shared LM head), as llama.cpp's graph_mtp does.
"""
from __future__ import annotations

import torch

from engine.gguf.reader import GGUFError
from engine.models.common import (Batch, DecoderModel, HeadPrep, Rope, SeqChunk, SequenceKV, default_attn_scale,
                                  head_rms_norm_silu, rms_norm)
from kernels.gdn.block import GdnShape
from kernels.quant import dequantize_rows

class MRope(Rope):
    """Interleaved multi-axis RoPE (llama.cpp GGML_ROPE_TYPE_IMROPE; HF Qwen3_5TextRotaryEmbedding)
    over the first `dim` dims of each head, NEOX rotation (x_i, x_{i+dim/2}). Frequency pair i uses
    one position axis, chosen as in ggml's ggml_mrope_cache_init: with sector = i % sum(sections),
    h if sector % 3 == 1 and sector < 3 * sections[1], w if sector % 3 == 2 and sector < 3 * sections[2],
    t if sector % 3 == 0 and sector < 3 * sections[0], else the 4th axis (e; t when not given).
    Text tokens have the same position on every axis, which reduces to ordinary NEOX rope."""

    def __init__(self, dim: int, base: float, sections: tuple[int, ...], freq_scale: float = 1.0):
        super().__init__(dim, base, freq_scale, neox=True)
        s = tuple(sections) + (0,) * (4 - len(sections))
        n_sect = sum(s)
        axis = []
        for i in range(dim // 2):
            sector = i % n_sect
            if sector % 3 == 1 and sector < 3 * s[1]:
                axis.append(1)
            elif sector % 3 == 2 and sector < 3 * s[2]:
                axis.append(2)
            elif sector % 3 == 0 and sector < 3 * s[0]:
                axis.append(0)
            else:
                axis.append(3)
        self.axis = torch.tensor(axis, dtype=torch.long)

    def to_device(self, device: torch.device) -> None:
        super().to_device(device)
        self.axis = self.axis.to(device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] (text: one position for all axes) or [N, 3] (t, h, w) or [N, 4]."""
        p = positions.to(torch.float64)
        if p.ndim == 1:
            theta = p[:, None] * self.inv_freq[None, :]
        else:
            if p.shape[1] == 3:
                p = torch.cat([p, p[:, :1]], dim=1)
            if p.shape[1] != 4:
                raise ValueError(f"M-RoPE positions must be [N], [N, 3] or [N, 4], got {tuple(positions.shape)}")
            theta = p[:, self.axis] * self.inv_freq[None, :]
        return theta.cos().float(), theta.sin().float()


def _dense(wt) -> torch.Tensor:
    """A whole small 2-D tensor as float32 (the conv kernel)."""
    return dequantize_rows(wt.raw.view(wt.n_out, -1), wt.qtype, wt.n_in)


class Qwen35Model(DecoderModel):
    def __init__(self, f, spec):
        super().__init__(f, spec)
        s, w = spec, self.w
        if s.head_dim != s.head_dim_v:
            raise GGUFError(f.path, f"qwen35 needs equal K and V head sizes, got {s.head_dim} and {s.head_dim_v}")
        if not s.rope_sections:
            raise GGUFError(f.path, "qwen35 needs rope.dimension_sections")
        self.tok_embd = w.get("token_embd.weight", (s.vocab_size, s.n_embd))
        self.output_norm = w.get("output_norm.weight", (s.n_embd,))
        self.output = w.opt("output.weight", (s.vocab_size, s.n_embd)) or self.tok_embd
        self.rope = MRope(s.rope_dim, s.rope_base, s.rope_sections, s.rope_freq_scale)
        self.attn_scale = default_attn_scale(s)
        E = s.n_embd
        self.n_k_heads, self.n_v_heads, self.d_state = s.ssm_n_group, s.ssm_dt_rank, s.ssm_d_state
        self.key_dim = self.n_k_heads * self.d_state
        self.conv_dim = 2 * self.key_dim + s.ssm_d_inner
        self.gdn = GdnShape(self.n_k_heads, self.n_v_heads, self.d_state, s.ssm_d_conv, s.rms_eps)
        self.layers = []
        for il in range(s.n_layer):
            p = f"blk.{il}."
            L = dict(
                recurrent=s.is_recurrent(il),
                attn_norm=w.get(p + "attn_norm.weight", (E,)),
                post_norm=w.get(p + "post_attention_norm.weight", (E,)),
                gate=w.get(p + "ffn_gate.weight", (s.n_ff, E)),
                up=w.get(p + "ffn_up.weight", (s.n_ff, E)),
                down=w.get(p + "ffn_down.weight", (E, s.n_ff)),
            )
            if L["recurrent"]:
                conv = w.get(p + "ssm_conv1d.weight", (self.conv_dim, s.ssm_d_conv))
                L.update(
                    wqkv=w.get(p + "attn_qkv.weight", (self.conv_dim, E)),
                    wz=w.get(p + "attn_gate.weight", (s.ssm_d_inner, E)),
                    conv=_dense(conv),
                    dt=w.get(p + "ssm_dt.bias", (self.n_v_heads,)),
                    a=w.get(p + "ssm_a", (self.n_v_heads,)),
                    beta=w.get(p + "ssm_beta.weight", (self.n_v_heads, E)),
                    alpha=w.get(p + "ssm_alpha.weight", (self.n_v_heads, E)),
                    ssm_norm=w.get(p + "ssm_norm.weight", (self.d_state,)),
                    ssm_out=w.get(p + "ssm_out.weight", (E, s.ssm_d_inner)),
                )
            else:
                L.update(self._attn_weights(p))
            self._stack_inputs(L)
            self.layers.append(L)
        self.mtp = None
        if s.n_layer_nextn > 0 and w.has(f"blk.{s.n_layer}.nextn.eh_proj.weight"):
            p = f"blk.{s.n_layer}."
            M = dict(
                attn_norm=w.get(p + "attn_norm.weight", (E,)),
                post_norm=w.get(p + "post_attention_norm.weight", (E,)),
                gate=w.get(p + "ffn_gate.weight", (s.n_ff, E)),
                up=w.get(p + "ffn_up.weight", (s.n_ff, E)),
                down=w.get(p + "ffn_down.weight", (E, s.n_ff)),
                eh_proj=w.get(p + "nextn.eh_proj.weight", (E, 2 * E)),
                enorm=w.get(p + "nextn.enorm.weight", (E,)),
                hnorm=w.get(p + "nextn.hnorm.weight", (E,)),
                head_norm=w.opt(p + "nextn.shared_head_norm.weight", (E,)) or self.output_norm,
                embed=w.opt(p + "nextn.embed_tokens.weight", (s.vocab_size, E)) or self.tok_embd,
                head=w.opt(p + "nextn.shared_head_head.weight", (s.vocab_size, E)) or self.output,
            )
            M.update(self._attn_weights(p))
            self._stack_inputs(M)
            self.mtp = M

    def _stack_inputs(self, L: dict) -> None:
        """The matrices of a block that read the same input, multiplied together on the GPU (StackedWeights)."""
        L["ffn_in"] = self.stack(L["gate"], L["up"])
        if L.get("recurrent"):
            L["ssm_in"] = self.stack(L["wqkv"], L["wz"], L["beta"], L["alpha"])
        else:
            L["attn_in"] = self.stack(L["wq"], L["wk"], L["wv"])

    def _attn_weights(self, p: str) -> dict:
        s, w = self.spec, self.w
        hd, E = s.head_dim, s.n_embd
        return dict(
            wq=w.get(p + "attn_q.weight", (2 * s.n_head * hd, E)),
            wk=w.get(p + "attn_k.weight", (s.n_head_kv * hd, E)),
            wv=w.get(p + "attn_v.weight", (s.n_head_kv * hd, E)),
            wo=w.get(p + "attn_output.weight", (E, s.n_head * hd)),
            q_norm=w.get(p + "attn_q_norm.weight", (hd,)),
            k_norm=w.get(p + "attn_k_norm.weight", (hd,)),
        )

    # ------------------------------------------------------------------------------------------
    # main model

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk]) -> list[torch.Tensor]:
        return self.forward_with_hidden(chunks)[0]

    @torch.inference_mode()
    def forward_with_hidden(self, chunks: list[SeqChunk]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One step over all chunks. Returns each chunk's logits (rows as `SeqChunk.logits` asks) and
        each chunk's final hidden rows after output_norm, for every token ([n, n_embd]: llama.cpp's
        h_nextn, the input of the MTP block)."""
        for c in chunks:
            if c.start == 0:
                c.kv.recurrent = {}
                c.kv.recurrent_length = 0
            elif c.kv.recurrent_length != c.start:
                raise ValueError(f"chunk starts at {c.start} but the sequence's recurrent state is at "
                                 f"{c.kv.recurrent_length} (restore a snapshot to go back)")
        batch = Batch(chunks)
        x = self.embed_batch(batch)
        self.prepare(batch)
        taken = {}
        for il in range(self.spec.n_layer):
            x = self.layer(il, x, batch)
            if il in self.capture_layers:   # a DFlash drafter reads these (engine/spec/dflash.py)
                taken[il] = x
        if taken:
            self.keep_features(batch, taken)
        for c in chunks:
            c.kv.length = c.kv.recurrent_length = c.start + len(c.tokens)
        h = rms_norm(x, self.output_norm.dense, self.spec.rms_eps)
        hidden = [h[lo:hi] for lo, hi in zip(batch.offsets[:-1], batch.offsets[1:])]
        rows, slices = batch.logit_rows()
        if len(rows) == 0:
            return [x.new_zeros((0, self.spec.vocab_size)) for _ in chunks], hidden
        logits = self.output.matmul(h[rows])
        return [logits[sl] for sl in slices], hidden

    def prepare(self, batch: Batch) -> None:
        if any(c.positions is not None for c in batch.chunks):
            pos = []
            for c in batch.chunks:
                p = c.positions if c.positions is not None else torch.arange(c.start, c.start + len(c.tokens))
                if p.shape[0] != len(c.tokens):
                    raise ValueError(f"chunk has {len(c.tokens)} tokens but {p.shape[0]} positions")
                pos.append(p.long())
            if any(p.ndim == 2 for p in pos):
                width = max(p.shape[1] for p in pos if p.ndim == 2)
                pos = [p[:, None].expand(-1, width) if p.ndim == 1 else p for p in pos]
            positions = torch.cat(pos)
        else:
            positions = batch.positions if batch.rope_positions is None else batch.rope_positions
        batch.rope["main"] = self.rope.cos_sin(positions)

    def layer(self, il: int, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        L = self.layers[il]
        h = rms_norm(x, L["attn_norm"].dense, self.spec.rms_eps,
                     L["ssm_in" if L["recurrent"] else "attn_in"].input_dtype)
        if L["recurrent"]:
            x = self._gated_delta_net(il, L, h, batch, residual=x)
        else:
            x = self._gated_attention(il, L, h, batch, residual=x)
        return self._ffn(L, x)

    def _ffn(self, L: dict, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, L["post_norm"].dense, self.spec.rms_eps, L["ffn_in"].input_dtype)
        return L["down"].matmul(L["ffn_in"].gated(h, "silu", L["down"].input_dtype), add=x)

    def _gated_attention(self, il: int, L: dict, h: torch.Tensor, batch: Batch,
                         residual: torch.Tensor | None = None) -> torch.Tensor:
        """The attention block's output (plus `residual` when given)."""
        s = self.spec
        n, hd = h.shape[0], s.head_dim
        qg, k, v = L["attn_in"].matmul(h)
        qg = qg.view(n, s.n_head, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:]
        k = k.view(n, s.n_head_kv, hd)
        v = v.view(n, s.n_head_kv, hd)
        prep = HeadPrep(L["q_norm"].dense, L["k_norm"].dense, s.rms_eps, self.rope, *batch.rope["main"])
        a = self.attend_heads(il, q, k, v, batch, prep, self.attn_scale, gate=gate, out_dtype=L["wo"].input_dtype)
        return L["wo"].matmul(a.reshape(n, s.n_head * hd), add=residual)

    def _gated_delta_net(self, il: int, L: dict, h: torch.Tensor, batch: Batch,
                         residual: torch.Tensor | None = None) -> torch.Tensor:
        """The Gated DeltaNet block's output (plus `residual` when given)."""
        s = self.spec
        n = h.shape[0]
        Hv, D = self.n_v_heads, self.d_state
        # qkv [n, conv_dim], z [n, Hv * D], beta and alpha's products [n, Hv]
        qkv, z, beta_x, alpha_x = L["ssm_in"].matmul(h)
        o = batch.delta_net(il, self.gdn, L, qkv, alpha_x, beta_x)           # [n, Hv, D]
        o = head_rms_norm_silu(o, L["ssm_norm"].dense, s.rms_eps, z.view(n, Hv, D), L["ssm_out"].input_dtype)
        return L["ssm_out"].matmul(o.reshape(n, Hv * D), add=residual)

    # ------------------------------------------------------------------------------------------
    # MTP (NextN) block

    def new_mtp_kv(self, dtype: torch.dtype | None = None) -> SequenceKV:
        """The MTP block's own KV cache (one layer) for one sequence (the CPU path; the GPU path keeps the rows in
        the runner's blocks: engine/runner/mtp.py): `dtype` for K and V, else the model's cache types."""
        if dtype is not None:
            return SequenceKV(1, dtype)
        return SequenceKV(1, cache_type_k=self.cache_type_k, cache_type_v=self.cache_type_v)

    def mtp_block(self, tokens: torch.Tensor, hidden: torch.Tensor, batch) -> torch.Tensor:
        """The MTP block's rows (llama.cpp graph_mtp up to the head): row r holds token tokens[r] at
        batch.positions[r] and the hidden input hidden[r] (h_{p-1}); its one attention layer (index 0 of the
        batch's caches) writes and reads the rows' KV through `batch` (a Batch of MTP caches, or the runner's
        SlotBatch over the block's own layer). Returns the shared_head_norm'd rows [n, n_embd]: what the head
        reads and the hidden input of a further draft."""
        M, s = self.mtp, self.spec
        # (on the device: the rows live there; copies that need not wait for it)
        batch.positions = batch.positions.to(hidden.device, non_blocking=True)
        e = M["embed"].rows(tokens.to(hidden.device, non_blocking=True))
        e = rms_norm(e, M["enorm"].dense, s.rms_eps)
        hn = rms_norm(hidden.float(), M["hnorm"].dense, s.rms_eps)
        x = M["eh_proj"].matmul(torch.cat([e, hn], dim=-1))
        self.prepare(batch)
        h = rms_norm(x, M["attn_norm"].dense, s.rms_eps)
        x = self._gated_attention(0, M, h, batch, residual=x)
        x = self._ffn(M, x)
        return rms_norm(x, M["head_norm"].dense, s.rms_eps)

    def mtp_head(self, rows: torch.Tensor) -> torch.Tensor:
        """The MTP block's logits for mtp_block's rows."""
        return self.mtp["head"].matmul(rows)

    @torch.inference_mode()
    def mtp_forward(self, chunks: list[SeqChunk], hidden: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Run the MTP block (llama.cpp graph_mtp). Each chunk's row at position p holds token x_p and
        `hidden[i]` row h_{p-1}: the main model's output-normed last hidden state at position p-1
        (from `forward_with_hidden`; llama.cpp uses zeros before the first token). Its logits predict
        x_{p+1}. `chunk.kv` is an MTP cache from `new_mtp_kv()`. Returns each chunk's logits (rows as
        `SeqChunk.logits` asks) and the block's shared_head_norm'd output for all rows (the hidden
        input of a further draft step)."""
        if self.mtp is None:
            raise ValueError("this model has no MTP (nextn) block")
        s = self.spec
        batch = Batch(chunks)
        hid = torch.cat(hidden, dim=0) if hidden else torch.zeros(0, s.n_embd)
        if hid.shape != (len(batch.tokens), s.n_embd):
            raise ValueError(f"hidden rows {tuple(hid.shape)} do not match {len(batch.tokens)} tokens")
        out = self.mtp_block(batch.tokens, hid, batch)
        for c in chunks:
            c.kv.length = c.start + len(c.tokens)
        h_out = [out[lo:hi] for lo, hi in zip(batch.offsets[:-1], batch.offsets[1:])]
        rows, slices = batch.logit_rows()
        if len(rows) == 0:
            return [out.new_zeros((0, s.vocab_size)) for _ in chunks], h_out
        logits = self.mtp_head(out[rows.to(out.device, non_blocking=True)])
        return [logits[sl] for sl in slices], h_out
