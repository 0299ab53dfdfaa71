"""Plain-torch Muse Spark over whole sequences, the program's oracle: transformers 5.24's ``modeling_muse_spark``
text math (not the pieces, not the op references) in fp32 (fp64 with fp64 weights), tensors by canonical name
(``names.py``), causal attention over the paged KV cache the GQA piece reads (``states.layer(i)['k' | 'v']``
[num_blocks, block_size, KV, D]: k after the QK-norm and RoPE, v as projected), which ``prefill`` fills."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

from latency_specialized.runtime.states import ModelStates, SeqSlot
from latency_specialized.spec import MoESpec

from latency_specialized_models.muse_spark.composed import composed_model
from latency_specialized_models.muse_spark.names import PREFIX
from latency_specialized_models.muse_spark.spec import MuseSparkSpec


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX (rotate-half) RoPE of ``x [T, heads, D]`` at ``pos [T]``, angles in fp32 as transformers computes them."""
    D = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32, device=x.device) / D))
    ang = pos.float()[:, None] * inv
    cos, sin = (torch.cat([f, f], -1).to(x.dtype)[:, None] for f in (ang.cos(), ang.sin()))
    return x * cos + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * sin


class MuseSparkReference:
    """One Muse Spark's reference (what ``generate`` / ``testing.verify`` use: new_cache, prefill, decode)."""

    def __init__(self, spec: MuseSparkSpec, named: dict[str, torch.Tensor], tokenizer: Any = None):
        self.spec, self.named, self.tokenizer, emb = spec, named, tokenizer, named[PREFIX + "embed_tokens.weight"]
        self.dtype, self.device = emb.dtype, emb.device
        self.cdtype = torch.float64 if self.dtype == torch.float64 else torch.float32   # compute dtype

    def W(self, name: str) -> torch.Tensor:
        return self.named[name].to(self.cdtype)

    def new_cache(self, num_seqs: int, max_len: int, *, block_size: int = 16,
                  shuffle_seed: int | None = None) -> ModelStates:
        """Zero states of the composed model for ``num_seqs`` sequences of up to ``max_len`` tokens."""
        return ModelStates.allocate(composed_model(self.spec), num_seqs, max_len, block_size=block_size,
                                    dtype=self.dtype, device=self.device, shuffle_seed=shuffle_seed)

    def centred(self, x: torch.Tensor, name: str, eps: float) -> torch.Tensor:
        """Zero-centred RMSNorm: rms(x) * (1 + w)."""
        return rms(x, eps) * (1 + self.W(name))

    def input_scaled(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Input-scaled RMSNorm: rms(round_to_act(x * (1 + w))), eps post_norm_eps."""
        return rms((x * (1 + self.W(name))).to(self.dtype).to(self.cdtype), self.spec.post_norm.eps)

    def gate(self, residual: torch.Tensor, branch: torch.Tensor, name: str) -> torch.Tensor:
        """Norm-preserving residual gate: alpha * residual + beta * branch (fp32 parameter ``name``)."""
        rg = self.spec.residual_gate
        w = self.W(name) / rg.temperature
        beta = torch.sigmoid(w)
        return torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1 + beta), min=rg.floor)) * residual + beta * branch

    def mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        """Dense SwiGLU MLP ``x [T, H]`` -> [T, H]."""
        return (F.silu(x @ self.W(p + "gate_proj.weight").T) * (x @ self.W(p + "up_proj.weight").T)) \
            @ self.W(p + "down_proj.weight").T

    def moe(self, p: str, x: torch.Tensor, f: MoESpec) -> torch.Tensor:
        """Latent MoE ``x [T, H]`` -> [T, H]: fp32 sigmoid router with selection bias, pre-expert projection and
        zero-centred norm, SwiGLU experts each followed by the shared input-scaled post-expert norm, then the
        routing weight, then the post-expert projection."""
        r = f.router
        s = torch.sigmoid((x.float() @ self.named[p + "gate.weight"].float().T * r.logit_scale).to(self.cdtype))
        ids = torch.topk(s + self.W(p + "gate.e_score_correction_bias"), f.top_k, dim=-1).indices
        w = s.gather(1, ids)
        w = w / (w.sum(-1, keepdim=True) + r.renormalize_eps) * r.routed_scaling   # unbiased, renormalised
        xl = self.centred(x @ self.W(p + "pre_expert_proj.weight").T, p + "pre_expert_norm.weight", self.spec.norm.eps)
        up, down, y = self.named[p + "experts.gate_up_proj"], self.named[p + "experts.down_proj"], torch.zeros_like(xl)
        for e in ids.unique().tolist():
            rows, k = (ids == e).nonzero(as_tuple=True)
            g, u = (xl[rows] @ up[e].to(self.cdtype).T).chunk(2, dim=-1)   # gate = the first I rows
            o = self.input_scaled((F.silu(g) * u) @ down[e].to(self.cdtype).T, p + "experts.post_expert_norm.weight")
            y.index_add_(0, rows, o * w[rows, k, None])
        return y @ self.W(p + "post_expert_proj.weight").T

    @torch.no_grad()
    def prefill(self, cache: ModelStates, slot: SeqSlot, start: int, ids: Sequence[int] | torch.Tensor
                ) -> torch.Tensor:
        """Logits ``[T, vocab]`` of ``ids`` at positions ``start..start+T-1`` of ``slot``; keys/values of earlier
        positions are read from ``cache``, those of ``ids`` written into it."""
        s, eps = self.spec, self.spec.norm.eps
        ids = torch.as_tensor(ids, device=self.device).flatten()
        T, n, bs = ids.numel(), start + ids.numel(), cache.block_size
        at = torch.arange(n, device=self.device)
        flat = torch.tensor(slot.blocks, device=self.device)[at // bs] * bs + at % bs   # cache row of each position
        pos, dist = at[start:], at[start:, None] - at[None, :]                         # new positions, q - k distance
        h = rms(self.W(PREFIX + "embed_tokens.weight")[ids], eps)
        for L in s.layers:
            a, p = L.attention, f"{PREFIX}layers.{L.index}."
            Hq, KV, D = a.num_heads, a.num_kv_heads, a.head_dim  # type: ignore[union-attr]
            x = self.centred(h, p + "input_layernorm.weight", eps)
            q, k, v = ((x @ self.W(f"{p}self_attn.{w}_proj.weight").T).view(T, heads, D)
                       for w, heads in (("q", Hq), ("k", KV), ("v", KV)))
            q, k = rms(q, eps) * s.qk_scale_factor, rms(k, eps)
            if a.rope_theta is not None:  # type: ignore[union-attr]
                q, k = rope(q, pos, a.rope_theta), rope(k, pos, a.rope_theta)  # type: ignore[union-attr]
            kc, vc = (cache.layer(L.index)[c].flatten(0, 1) for c in ("k", "v"))
            kc[flat[start:]], vc[flat[start:]] = k.to(kc.dtype), v.to(vc.dtype)
            K, V = (c[flat].to(self.cdtype).repeat_interleave(Hq // KV, dim=1) for c in (kc, vc))   # [n, Hq, D]
            mask = (dist >= 0) & (dist < (a.sliding_window or n))   # the window includes the current position
            att = (torch.einsum("thd,shd->hts", q, K) * D ** -0.5).masked_fill(~mask, float("-inf")).softmax(-1)
            o = rms(torch.einsum("hts,shd->thd", att, V), eps).reshape(T, Hq * D)   # o_norm per head
            o = o * torch.sigmoid(x @ self.W(p + "self_attn.gate_proj.weight").T)   # gate from the attention input
            o = o @ self.W(p + "self_attn.o_proj.weight").T
            h = self.gate(h, rms(o, s.post_norm.eps), p + "post_attention_residual_gate.gate")
            x = self.centred(h, p + "pre_feedforward_layernorm.weight", eps)
            y = self.moe(p + "mlp.", x, L.ffn) if isinstance(L.ffn, MoESpec) else self.mlp(p + "mlp.", x)
            h = self.gate(h, self.input_scaled(y, p + "post_feedforward_layernorm.weight"),
                          p + "post_feedforward_residual_gate.gate")
        z = rms(h, s.final_norm.eps) * self.W(PREFIX + "norm.weight") @ self.W("lm_head.weight").T
        return s.logits.softcap * torch.tanh(z * s.logits.scale / s.logits.softcap)

    def decode(self, cache: ModelStates, slots: Sequence[SeqSlot], positions: Sequence[int],
               tokens: Any) -> torch.Tensor:
        """``[B, vocab]`` logits of ``tokens[b]`` at ``positions[b]`` of ``slots[b]`` (sequence by sequence)."""
        return torch.stack([self.prefill(cache, s, int(p), tokens[b:b + 1])[-1]
                            for b, (s, p) in enumerate(zip(slots, positions))])
