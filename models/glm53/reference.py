"""Plain-torch GLM-5.3 over whole sequences, the program's oracle: transformers' ``modeling_glm_moe_dsa`` math
(not the pieces, not the op references), fp32 (fp64 for fp64 weights), tensors by Hugging Face name, over the
paged caches the sparse MLA piece reads, which ``prefill`` fills for the program:

* ``kv [kv_lora + rope]`` per token: the RMS-normed latent, then the roped key (rope pairs interleaved in place,
  ``(x0, x1), (x2, x3), ...``; transformers returns the rotated pairs de-interleaved ``[evens | odds]`` - the
  same permutation of q and k, so the same scores - vLLM and the piece keep them in place);
* ``indexer_k [index_head_dim]`` per token, full-indexer layers only: the LayerNorm-ed indexer key, its leading
  ``rope`` channels roped the same way.

DSA as transformers: a full layer scores every causal key ``sum_h w_h relu(q_h . k) * d^-0.5 * h^-0.5``
(``w = weights_proj(x)``), keeps the ``min(topk, n)`` best (``torch.topk``: no tie rule; the current token
is not forced in), and attends over selected-and-causal keys; a shared layer reuses the latest full layer's
selection. The MTP layer is loaded but not run (it is the draft model)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

from latency_specialized.runtime.states import ModelStates, SeqSlot
from latency_specialized.spec import MoESpec

from latency_specialized_models.glm53.names import composed
from latency_specialized_models.glm53.spec import Glm53Spec

INDEXER_K_NORM_EPS = 1e-6
"""transformers' ``GlmMoeDsaIndexer.k_norm`` (a LayerNorm) epsilon."""


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_pairs(x: torch.Tensor, pos: torch.Tensor, theta: float, rot: int) -> torch.Tensor:
    """``x [T, heads, D]`` with its first ``rot`` channels rotated in interleaved pairs at ``pos [T]``."""
    inv = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float32, device=x.device) / rot)
    ang = (pos.float()[:, None] * inv)[:, None].to(x.dtype)   # transformers' fp32 angles
    a, b = x[..., 0:rot:2], x[..., 1:rot:2]
    out = torch.stack([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1).flatten(-2)
    return torch.cat([out, x[..., rot:]], -1)


class Glm53Reference:
    """The reference of one GLM-5.3 (the protocol ``generate`` and the matrix use: spec, tokenizer, new_cache,
    prefill, decode)."""

    def __init__(self, spec: Glm53Spec, named: dict[str, torch.Tensor], tokenizer: Any = None, *,
                 bos_token_id: int | None = None):
        self.spec, self.named, self.tokenizer, self.bos_token_id = spec.full(), named, tokenizer, bos_token_id
        emb = named["model.embed_tokens.weight"]
        self.dtype, self.device = emb.dtype, emb.device
        self.cdt = torch.float64 if emb.dtype == torch.float64 else torch.float32

    def W(self, name: str) -> torch.Tensor:
        return self.named[name].to(self.cdt)

    def new_cache(self, num_seqs: int, max_len: int, *, block_size: int = 16, shuffle_seed: int | None = None):
        return ModelStates.allocate(composed(self.spec), num_seqs, max_len, block_size=block_size, dtype=self.dtype,
                                    device=self.device, shuffle_seed=shuffle_seed)

    def mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ self.W(p + "gate_proj.weight").T) * (x @ self.W(p + "up_proj.weight").T)) \
            @ self.W(p + "down_proj.weight").T

    def moe(self, p: str, x: torch.Tensor, f: MoESpec) -> torch.Tensor:
        """Sigmoid router, selection by score + e_score_correction_bias (n_group 1), weights the raw scores,
        renormalised, times routed_scaling; plus the shared experts."""
        r = f.router
        scores = (x.float() @ self.named[p + "gate.weight"].float().T).sigmoid().to(self.cdt)
        ids = (scores + self.W(p + "gate.e_score_correction_bias")).topk(f.top_k, dim=-1).indices
        w = scores.gather(1, ids)
        if r.renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * r.routed_scaling
        y = self.mlp(p + "shared_experts.", x)
        for e in ids.unique().tolist():
            rows, k = (ids == e).nonzero(as_tuple=True)
            y.index_add_(0, rows, w[rows, k, None] * self.mlp(f"{p}experts.{e}.", x[rows]))
        return y

    def indexer(self, p: str, x: torch.Tensor, q_c: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor,
                flat: torch.Tensor, start: int, mask: torch.Tensor) -> torch.Tensor:
        """Bool ``[T, n]``: the keys each new token attends to (its top-k of the causal ones)."""
        a = self.spec.layers[0].attention
        ix, T = a.indexer, x.shape[0]
        q = (q_c @ self.W(p + "wq_b.weight").T).view(T, ix.num_heads, ix.head_dim)
        k = F.layer_norm(x @ self.W(p + "wk.weight").T, (ix.head_dim,), self.W(p + "k_norm.weight"),
                         self.W(p + "k_norm.bias"), INDEXER_K_NORM_EPS)
        q = rope_pairs(q, pos, a.rope_theta, a.qk_rope_head_dim)
        k = rope_pairs(k[:, None], pos, a.rope_theta, a.qk_rope_head_dim)[:, 0]
        cache[flat[start:]] = k.to(cache.dtype)
        K = cache[flat].to(self.cdt)
        s = torch.einsum("thd,nd->thn", q, K).relu() * ix.head_dim ** -0.5
        w = (x @ self.W(p + "weights_proj.weight").T) * ix.num_heads ** -0.5
        s = torch.einsum("th,thn->tn", w, s).masked_fill(~mask, float("-inf"))
        top = s.topk(min(ix.topk, s.shape[1]), dim=-1).indices
        return torch.zeros_like(mask).scatter_(1, top, True) & mask

    @torch.no_grad()
    def prefill(self, cache: ModelStates, slot: SeqSlot, start: int, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Logits ``[T, vocab]`` of ``ids`` at positions ``start..`` (earlier latents / indexer keys read from
        ``cache``, the new ones written there)."""
        s, eps, leps = self.spec, self.spec.norm.eps, self.spec.latent_norm_eps
        ids = torch.as_tensor(ids, device=self.device).flatten()
        T, n, bs = ids.numel(), start + ids.numel(), cache.block_size
        at = torch.arange(n, device=self.device)
        flat = torch.tensor(slot.blocks, device=self.device)[at // bs] * bs + at % bs   # cache row of each position
        pos, causal = at[start:], at[start:, None] >= at[None, :]
        full = set(s.indexer_layers())
        h, keep = self.W("model.embed_tokens.weight")[ids], causal
        for L in s.layers:
            a, p = L.attention, f"model.layers.{L.index}."
            H, nope, R, Lr, V = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank, a.v_head_dim
            x = rms(h, self.W(p + "input_layernorm.weight"), eps)
            q_c = rms(x @ self.W(p + "self_attn.q_a_proj.weight").T, self.W(p + "self_attn.q_a_layernorm.weight"), leps)
            q = (q_c @ self.W(p + "self_attn.q_b_proj.weight").T).view(T, H, nope + R)
            q = torch.cat([q[..., :nope], rope_pairs(q[..., nope:], pos, a.rope_theta, R)], -1)
            ckv = x @ self.W(p + "self_attn.kv_a_proj_with_mqa.weight").T
            c = rms(ckv[:, :Lr], self.W(p + "self_attn.kv_a_layernorm.weight"), leps)
            k_pe = rope_pairs(ckv[:, None, Lr:], pos, a.rope_theta, R)[:, 0]
            st = cache.layer(L.index)
            kvc = st["kv"].flatten(0, 1)
            kvc[flat[start:]] = torch.cat([c, k_pe], -1).to(kvc.dtype)
            lat = kvc[flat].to(self.cdt)
            kv = (lat[:, :Lr] @ self.W(p + "self_attn.kv_b_proj.weight").T).view(n, H, nope + V)
            K = torch.cat([kv[..., :nope], lat[:, None, Lr:].expand(n, H, R)], -1)
            if L.index in full:
                keep = self.indexer(p + "self_attn.indexer.", x, q_c, pos, st["indexer_k"].flatten(0, 1), flat,
                                    start, causal)
            att = (torch.einsum("thd,nhd->htn", q, K) * (nope + R) ** -0.5).masked_fill(~keep, float("-inf"))
            o = torch.einsum("htn,nhv->thv", att.softmax(-1), kv[..., nope:]).reshape(T, H * V)
            h = h + o @ self.W(p + "self_attn.o_proj.weight").T
            x = rms(h, self.W(p + "post_attention_layernorm.weight"), eps)
            h = h + (self.moe(p + "mlp.", x, L.ffn) if isinstance(L.ffn, MoESpec) else self.mlp(p + "mlp.", x))
        return rms(h, self.W("model.norm.weight"), eps) @ self.W("lm_head.weight").T

    def decode(self, cache: ModelStates, slots: Sequence[SeqSlot], positions: Sequence[int], tokens: Any):
        """``[B, vocab]`` logits of token ``tokens[b]`` at ``positions[b]`` of ``slots[b]`` (one sequence at a time)."""
        return torch.stack([self.prefill(cache, s, int(p), tokens[b:b + 1])[-1]
                            for b, (s, p) in enumerate(zip(slots, positions))])


__all__ = ["Glm53Reference", "INDEXER_K_NORM_EPS", "rms", "rope_pairs"]
