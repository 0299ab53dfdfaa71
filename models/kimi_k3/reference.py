"""Kimi K3 in plain torch: the executable definition of the model, and the oracle of the program.

Written per sequence, straight from the architecture (MODELS.md, vLLM's kimi_k3 sources), and
deliberately *not* from the backend's op families, so that program == reference means something:

* weights are read by their official checkpoint names, unfused (q/k/v/g/f_a/b projections,
  separate conv taps, one tensor per expert);
* AttnRes keeps its sources as a Python list (embedding, completed blocks, partial block);
* KDA runs the gated delta rule token by token with the short conv as an unfold over
  ``[conv tail | new tokens]``;
* MLA: prefill uses the *expanded* form (keys/values up-projected from the latent, causal mask),
  decode the *absorbed* form, both over the paged latent cache;
* MoE routes with an iterative arg-max top-k (ties -> lower expert id), then runs each selected
  expert over the tokens that chose it.

Numerics: math in fp32 (fp64 when the weights are fp64), rounded to the activation dtype after
every projection, norm and mix - the points where a bf16 serving stack rounds. The KDA state is
fp32 (fp64 in fp64 runs). CPU and GPU: everything follows the weights' device.

Decode state: ``runtime.states.ModelStates`` in the pieces' layout (the program's): per KDA layer ``conv``
``[rows, 3*H*D, W-1]`` (last W-1 q|k|v inputs) and ``state`` ``[rows, H, D, D]``; per MLA layer a paged ``kv``
``[blocks, block_size, kv_lora + rope]``. Row 0 is padding scratch; sequences start from zero state.
"""

from __future__ import annotations

from typing import Sequence

import torch

from latency_specialized.errors import UserError
from latency_specialized.runtime.states import ModelStates, SeqSlot
from latency_specialized.spec import ActivationSpec, DenseMLPSpec, KDAAttentionSpec, MLAAttentionSpec, MoESpec

from latency_specialized_models.kimi_k3.spec import KimiK3Spec


class KimiK3Reference:
    """Prefill and decode of Kimi K3 over its decode state (``ModelStates``, see the module docstring).

    Parameters
    ----------
    spec : the (unsharded) architecture.
    weights : official name -> tensor (``composed.tensor_name_for``), activation dtype except the fp32 parameters.
    tokenizer : optional ``tokenizers.Tokenizer`` (used by ``generate``).
    bos_token_id, eos_token_id : special ids of the tokenizer/config (None if unknown).
    """

    def __init__(self, spec: KimiK3Spec, weights: dict[str, torch.Tensor], *, tokenizer=None,
                 bos_token_id: int | None = None, eos_token_id: int | None = None):
        if spec.tp != 1:
            raise UserError(f"the reference runs the whole model: pass the unsharded spec (got TP={spec.tp})")
        self.spec = spec
        self.w = weights
        emb = weights["model.embed_tokens.weight"]
        self.dtype, self.device = emb.dtype, emb.device
        self.acc = torch.float64 if self.dtype == torch.float64 else torch.float32
        self.tokenizer, self.bos_token_id, self.eos_token_id = tokenizer, bos_token_id, eos_token_id

    # ------------------------------------------------------------------ public API
    def new_cache(self, num_seqs: int, max_len: int, *, block_size: int = 16,
                  shuffle_seed: int | None = None) -> ModelStates:
        """Zero decode state for ``num_seqs`` sequences of up to ``max_len`` tokens (``shuffle_seed``: KV
        blocks handed out in a random order, so paging is exercised)."""
        from latency_specialized_models.kimi_k3.composed import composed_model  # the layout only, no math

        return ModelStates.allocate(composed_model(self.spec), num_seqs, max_len, block_size=block_size,
                                    dtype=self.dtype, device=self.device, shuffle_seed=shuffle_seed)

    @torch.no_grad()
    def prefill(self, cache: ModelStates, slot: SeqSlot, start: int, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Run ``tokens`` (positions ``start ..``) of one sequence; fills its caches.

        Returns the logits of every token, ``[T, vocab]`` (fp32; fp64 in fp64 runs). ``start > 0``
        continues a sequence (chunked prefill).
        """
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device).flatten()
        if ids.numel() == 0:
            raise UserError("prefill needs at least one token")
        self._check_capacity(cache, slot, start + ids.numel())
        return self._forward(cache, [slot], [start], ids.view(1, -1), absorbed=False)

    @torch.no_grad()
    def decode(self, cache: ModelStates, slots: Sequence[SeqSlot], positions: Sequence[int],
               tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """One decode step: token ``tokens[b]`` at position ``positions[b]`` of sequence ``slots[b]``.

        Sequences may have different lengths. Returns ``[B, vocab]`` logits.
        """
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device).flatten()
        if not (len(slots) == len(positions) == ids.numel()):
            raise UserError(f"decode: {len(slots)} slots, {len(positions)} positions, {ids.numel()} tokens: "
                            "give one of each per sequence")
        for b, slot in enumerate(slots):
            self._check_capacity(cache, slot, positions[b] + 1)
        if len({s.row for s in slots}) != len(slots):
            raise UserError("decode: a sequence appears twice in one step; give each sequence once")
        # one token per sequence, all sequences at once: the KDA recurrence is per state row, MLA loops
        # over the sequences (their contexts differ), everything else is per token
        return self._forward(cache, list(slots), [int(p) for p in positions], ids.view(-1, 1), absorbed=True)

    # ------------------------------------------------------------------ model
    def _forward(self, cache: ModelStates, slots: list[SeqSlot], starts: list[int], ids: torch.Tensor,
                 absorbed: bool) -> torch.Tensor:
        """ids [B, T]: T consecutive tokens (from ``starts[b]``) of each of B sequences -> logits [B*T, V].

        Prefill is B = 1; decode is T = 1. Tokens are flattened sequence-major for the per-token parts."""
        spec, w = self.spec, self.w
        eps, bs = spec.norm.eps, spec.attnres_block
        B, T = ids.shape
        x = w["model.embed_tokens.weight"][ids.flatten()]            # [B*T, H]
        blocks: list[torch.Tensor] = [x]                             # embedding + completed blocks
        partial: torch.Tensor | None = None                          # running sum of the current block
        for layer in spec.layers:
            i, p = layer.index, f"model.layers.{layer.index}."
            if i % bs == 0 and partial is not None:                  # a block boundary: partial is complete
                blocks.append(partial)
                partial = None
            sources = blocks + ([partial] if partial is not None else [])
            h = self._attnres(sources, p + "self_attention_res_norm.weight", p + "self_attention_res_proj.weight",
                              p + "input_layernorm.weight")
            if isinstance(layer.attention, KDAAttentionSpec):
                a = self._kda(cache, i, layer.attention, [s.row for s in slots], h.view(B, T, -1)).flatten(0, 1)
            else:
                hb = h.view(B, T, -1)
                a = torch.cat([self._mla(cache, i, layer.attention, slots[b], starts[b], hb[b], absorbed)
                               for b in range(B)])
            partial = a if partial is None else self._round(partial.to(self.acc) + a.to(self.acc))
            h = self._attnres(blocks + [partial], p + "mlp_res_norm.weight", p + "mlp_res_proj.weight",
                              p + "post_attention_layernorm.weight")
            f = layer.ffn
            if isinstance(f, DenseMLPSpec):
                m = self._glu(h, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight",
                              f.activation)
            else:
                m = self._moe(h, p + "block_sparse_moe.", f)
            partial = self._round(partial.to(self.acc) + m.to(self.acc))
        assert partial is not None
        h = self._attnres(blocks + [partial], "model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight",
                          None)
        h = self._rms(h, "model.norm.weight", eps)
        head = w["model.embed_tokens.weight"] if spec.tie_word_embeddings else w["lm_head.weight"]
        return self._round(h.to(self.acc) @ head.to(self.acc).t()).to(self.acc)

    # ------------------------------------------------------------------ pieces
    def _round(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x @ W^T with one rounding (W by official name)."""
        return self._round(x.to(self.acc) @ self.w[name].to(self.acc).t())

    def _rms(self, x: torch.Tensor, name: str | None, eps: float) -> torch.Tensor:
        xf = x.to(self.acc)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if name is not None:
            y = y * self.w[name].to(self.acc)
        return self._round(y)

    def _act(self, gate: torch.Tensor, up: torch.Tensor, act: ActivationSpec) -> torch.Tensor:
        g, u = gate.to(self.acc), up.to(self.acc)
        if act.kind == "situ_glu":
            b, bl = float(act.beta), float(act.beta_lin)  # type: ignore[arg-type]
            return self._round(b * torch.tanh(g / b) * torch.sigmoid(g) * bl * torch.tanh(u / bl))
        if act.kind == "swiglu" and act.clamp is None:
            return self._round(g * torch.sigmoid(g) * u)
        raise UserError(f"kimi_k3 reference: activation {act.kind} (clamp {act.clamp}) not implemented")

    def _glu(self, x: torch.Tensor, gate: str, up: str, down: str, act: ActivationSpec) -> torch.Tensor:
        return self._lin(self._act(self._lin(x, gate), self._lin(x, up), act), down)

    def _attnres(self, sources: list[torch.Tensor], norm: str, query: str, out_norm: str | None) -> torch.Tensor:
        """Softmax mix over the source list (per token), then the sublayer's input RMSNorm."""
        eps = self.spec.norm.eps
        v = torch.stack([s.to(self.acc) for s in sources], dim=0)    # [S, T, H]
        normed = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * self.w[norm].to(self.acc)
        logits = normed @ self.w[query].to(self.acc)[0]              # [S, T]
        p = torch.softmax(logits, dim=0)
        mixed = (p.unsqueeze(-1) * v).sum(0)                         # [T, H]
        if out_norm is None:
            return self._round(mixed)
        return self._rms(mixed, out_norm, eps)

    def _kda(self, cache: ModelStates, i: int, a: KDAAttentionSpec, rows: SeqSlot | list[int],
             x: torch.Tensor) -> torch.Tensor:
        """KDA over x [B, T, H]: T consecutive tokens of the sequences in state rows ``rows`` ([B]).
        A single SeqSlot with x [T, H] is one sequence (returns [T, H])."""
        if isinstance(rows, SeqSlot):
            return self._kda(cache, i, a, [rows.row], x.unsqueeze(0))[0]
        p = f"model.layers.{i}.self_attn."
        B, T, Hh, D, W = x.shape[0], x.shape[1], a.num_heads, a.head_dim, a.conv_kernel
        acc = self.acc
        idx = torch.as_tensor(rows, dtype=torch.long, device=x.device)
        # Short causal conv over [tail | new tokens] per q/k/v channel, then SiLU.
        raw = [self._lin(x, p + f"{n}_proj.weight") for n in ("q", "k", "v")]   # 3 x [B, T, HD]
        st = cache.layer(i)
        tail = st["conv"][idx]                                                   # [B, 3HD, W-1]
        seq = torch.cat([tail, torch.cat(raw, dim=-1).transpose(1, 2)], dim=-1)  # [B, 3HD, W-1+T]
        st["conv"][idx] = seq[..., -(W - 1):]
        taps = torch.cat([self.w[p + f"{n}_conv1d.weight"].to(acc)[:, 0] for n in ("q", "k", "v")])  # [3HD, W]
        windows = seq.to(acc).unfold(-1, W, 1)                                   # [B, 3HD, T, W]
        conv = self._round(torch.nn.functional.silu((windows * taps.unsqueeze(1)).sum(-1))).transpose(1, 2)
        q, k, v = conv.to(acc).view(B, T, 3, Hh, D).unbind(2)                   # [B, T, Hh, D] each
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * D ** -0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        # Per-channel decay g in [lower_bound, 0] and per-head write strength beta.
        f = self._lin(self._lin(x, p + "f_a_proj.weight"), p + "f_b_proj.weight").to(acc).view(B, T, Hh, D)
        A = torch.exp(self.w[p + "A_log"].to(acc)).view(Hh, 1)
        g = a.gate_lower_bound * torch.sigmoid(A * (f + self.w[p + "dt_bias"].to(acc).view(Hh, D)))
        beta = torch.sigmoid(self._lin(x, p + "b_proj.weight").to(acc))          # [B, T, Hh]
        S = st["state"][idx].to(acc)                                             # [B, Hh, Dv, Dk]
        outs = []
        for t in range(T):
            S = S * torch.exp(g[:, t]).unsqueeze(2)                              # decay along keys
            v_new = beta[:, t].unsqueeze(-1) * (v[:, t] - torch.einsum("bhvk,bhk->bhv", S, k[:, t]))
            S = S + v_new.unsqueeze(-1) * k[:, t].unsqueeze(2)
            outs.append(torch.einsum("bhvk,bhk->bhv", S, q[:, t]))
        st["state"][idx] = S.to(st["state"].dtype)
        o = torch.stack(outs, dim=1)                                             # [B, T, Hh, D]
        # Gated RMSNorm per head with the full-rank output gate.
        gate = torch.sigmoid(self._lin(x, p + "g_proj.weight").to(acc).view(B, T, Hh, D))
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.spec.kda_norm_eps)
        o = self._round(o * self.w[p + "o_norm.weight"].to(acc) * gate).reshape(B, T, Hh * D)
        return self._lin(o, p + "o_proj.weight")

    def _mla(self, cache: ModelStates, i: int, a: MLAAttentionSpec, slot: SeqSlot, start: int, x: torch.Tensor,
             absorbed: bool) -> torch.Tensor:
        p = f"model.layers.{i}.self_attn."
        eps, acc = self.spec.norm.eps, self.acc
        T, Hh, nope, R, L, vd = x.shape[0], a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank, a.v_head_dim
        if a.q_lora_rank:
            qc = self._rms(self._lin(x, p + "q_a_proj.weight"), p + "q_a_layernorm.weight", eps)
            q = self._lin(qc, p + "q_b_proj.weight")
        else:
            q = self._lin(x, p + "q_proj.weight")
        q = q.to(acc).view(T, Hh, nope + R)
        kv = self._lin(x, p + "kv_a_proj_with_mqa.weight")
        c = self._rms(kv[:, :L], p + "kv_a_layernorm.weight", eps)
        kpe = kv[:, L:]
        # Write the new tokens' latents into the paged cache, then read the whole context back.
        bsz = cache.block_size
        cache_i = cache.layer(i)["kv"]
        for t in range(T):
            pos = start + t
            cache_i[slot.blocks[pos // bsz], pos % bsz] = torch.cat([c[t], kpe[t]]).to(cache_i.dtype)
        n = start + T
        pos = torch.arange(n, device=x.device)
        pages = torch.tensor(slot.blocks, device=x.device)[pos // bsz]
        ctx = cache_i[pages, pos % bsz].to(acc)                                   # [n, L+R] through the pages
        C, KPE = ctx[:, :L], ctx[:, L:]
        wkv = self.w[p + "kv_b_proj.weight"].to(acc).view(Hh, nope + vd, L)
        w_uk, w_uv = wkv[:, :nope], wkv[:, nope:]
        scale = (nope + R) ** -0.5
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        if absorbed:   # decode: score and read in latent space
            q_lat = torch.einsum("thn,hnl->thl", q_nope, w_uk)
            s = (torch.einsum("thl,jl->thj", q_lat, C) + torch.einsum("thr,jr->thj", q_pe, KPE)) * scale
            o_lat = torch.einsum("thj,jl->thl", torch.softmax(s, dim=-1), C)
            o = torch.einsum("thl,hvl->thv", o_lat, w_uv)
        else:          # prefill: expanded keys/values, causal over cached + new tokens
            k_nope = torch.einsum("jl,hnl->jhn", C, w_uk)
            vals = torch.einsum("jl,hvl->jhv", C, w_uv)
            s = (torch.einsum("thn,jhn->thj", q_nope, k_nope) + torch.einsum("thr,jr->thj", q_pe, KPE)) * scale
            future = torch.arange(n, device=x.device).view(1, 1, n) > (start + torch.arange(T, device=x.device)).view(T, 1, 1)
            s = s.masked_fill(future, float("-inf"))
            o = torch.einsum("thj,jhv->thv", torch.softmax(s, dim=-1), vals)
        o = o.reshape(T, Hh * vd)
        if a.output_gate == "sigmoid":
            o = o * torch.sigmoid(self._lin(x, p + "g_proj.weight").to(acc))
        return self._lin(self._round(o), p + "o_proj.weight")

    def _route(self, logits: torch.Tensor, bias: torch.Tensor, f: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k per token: selection on sigmoid + bias, weights from the unbiased sigmoid.

        logits [T, E] -> (ids [T, k], weights [T, k]). Iterative arg-max: the first maximum is the
        lowest id, so ties go to the lower expert.
        """
        r = f.router
        if r.score_func != "sigmoid":
            raise UserError(f"kimi_k3 reference: router {r.score_func} not implemented (Kimi K3 uses sigmoid)")
        scores = torch.sigmoid(logits * r.logit_scale)
        sel = (scores + bias) if r.bias_corrected else scores.clone()
        ids = []
        for _ in range(f.top_k):
            e = sel.argmax(-1, keepdim=True)
            ids.append(e)
            sel = sel.scatter(-1, e, float("-inf"))
        idx = torch.cat(ids, dim=-1)
        wts = scores.gather(-1, idx)
        if r.renormalize:
            wts = wts / (wts.sum(-1, keepdim=True) + r.renormalize_eps)
        return idx, wts * r.routed_scaling

    def _moe(self, x: torch.Tensor, p: str, f: MoESpec) -> torch.Tensor:
        acc, eps = self.acc, self.spec.norm.eps
        logits = x.to(acc) @ self.w[p + "gate.weight"].to(acc).t()                 # fp32 router logits
        ids, wts = self._route(logits, self.w[p + "gate.e_score_correction_bias"].to(acc), f)
        xl = self._lin(x, p + "routed_expert_down_proj.weight") if f.latent_dim else x
        y = torch.zeros(x.shape[0], xl.shape[-1], dtype=acc, device=x.device)
        # each selected expert (ascending id: a fixed summation order) over the tokens that chose it;
        # one host sync for the set instead of one per expert of the model
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            q = f"{p}experts.{e}."
            out = self._glu(xl[rows], q + "w1.weight", q + "w3.weight", q + "w2.weight", f.activation)
            y[rows] += wts[rows, slot].unsqueeze(-1) * out.to(acc)
        out = self._round(y)
        if f.latent_dim:
            if self.spec.latent_moe_norm:
                out = self._rms(out, p + "routed_expert_norm.weight", eps)
            out = out.to(acc) @ self.w[p + "routed_expert_up_proj.weight"].to(acc).t()
        else:
            out = out.to(acc)
        if f.num_shared_experts:
            s = p + "shared_experts."
            out = out + self._glu(x, s + "gate_proj.weight", s + "up_proj.weight", s + "down_proj.weight",
                                  f.activation).to(acc)
        return self._round(out)

    def _check_capacity(self, cache: ModelStates, slot: SeqSlot, length: int) -> None:
        cap = len(slot.blocks) * cache.block_size
        if length > cap:
            raise UserError(f"sequence of {length} tokens exceeds its cache capacity {cap}: allocate a longer cache")
