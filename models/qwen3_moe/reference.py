"""Plain-torch Qwen3-MoE over whole sequences, the program's oracle: transformers' ``modeling_qwen3_moe`` math
(not the pieces, not the op references) in fp32, tensors by Hugging Face name, causal attention over the paged
KV cache the GQA piece reads (``states.layer(i)['k' | 'v']``), which ``prefill`` fills for the program."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

from latency_specialized.runtime.states import ModelStates, SeqSlot
from latency_specialized.spec import MoESpec

from latency_specialized_models.qwen3_moe.composed import composed_model
from latency_specialized_models.qwen3_moe.spec import Qwen3MoESpec


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX (rotate-half) RoPE of ``x [T, heads, D]`` at ``pos [T]``."""
    D = x.shape[-1]
    ang = pos.double()[:, None] * theta ** -(torch.arange(0, D, 2, dtype=torch.float64, device=x.device) / D)
    cos, sin = (torch.cat([f, f], -1).float()[:, None] for f in (ang.cos(), ang.sin()))
    return x * cos + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * sin


class Qwen3MoEReference:
    """The reference of one Qwen3-MoE (the protocol ``generate`` uses: spec, tokenizer, new_cache, prefill)."""

    def __init__(self, spec: Qwen3MoESpec, named: dict[str, torch.Tensor], *, tokenizer: Any = None,
                 bos_token_id: int | None = None):
        self.spec, self.named, self.tokenizer, self.bos_token_id = spec, named, tokenizer, bos_token_id
        self.dtype, self.device = named["model.embed_tokens.weight"].dtype, named["model.embed_tokens.weight"].device

    def W(self, name: str) -> torch.Tensor:
        return self.named[name].float()

    def new_cache(self, num_seqs: int, max_len: int, *, block_size: int = 16, shuffle_seed: int | None = None):
        return ModelStates.allocate(composed_model(self.spec), num_seqs, max_len, block_size=block_size,
                                    dtype=self.dtype, device=self.device, shuffle_seed=shuffle_seed)

    def mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ self.W(p + "gate_proj.weight").T) * (x @ self.W(p + "up_proj.weight").T)) \
            @ self.W(p + "down_proj.weight").T

    def moe(self, p: str, x: torch.Tensor, f: MoESpec) -> torch.Tensor:
        w, ids = (x @ self.W(p + "gate.weight").T).softmax(-1).topk(f.top_k, dim=-1)   # softmax, then top-k
        if f.router.renormalize:   # norm_topk_prob
            w = w / w.sum(-1, keepdim=True)
        y = torch.zeros_like(x)
        for e in ids.unique().tolist():
            rows, k = (ids == e).nonzero(as_tuple=True)
            y.index_add_(0, rows, w[rows, k, None] * self.mlp(f"{p}experts.{e}.", x[rows]))
        return y

    @torch.no_grad()
    def prefill(self, cache: ModelStates, slot: SeqSlot, start: int, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Logits ``[T, vocab]`` of ``ids`` at positions ``start..`` (earlier keys/values read from ``cache``)."""
        s, eps = self.spec, self.spec.norm.eps
        ids = torch.as_tensor(ids, device=self.device).flatten()
        T, n, bs = ids.numel(), start + ids.numel(), cache.block_size
        at = torch.arange(n, device=self.device)
        flat = torch.tensor(slot.blocks, device=self.device)[at // bs] * bs + at % bs   # cache row of each position
        pos, mask = at[start:], at[start:, None] >= at[None, :]   # new positions, causal mask
        h = self.W("model.embed_tokens.weight")[ids]
        for L in s.layers:
            a, p = L.attention, f"model.layers.{L.index}."
            Hq, KV, D = a.num_heads, a.num_kv_heads, a.head_dim
            x = rms(h, self.W(p + "input_layernorm.weight"), eps)
            q, k, v = ((x @ self.W(f"{p}self_attn.{w}_proj.weight").T).view(T, heads, D)
                       for w, heads in (("q", Hq), ("k", KV), ("v", KV)))
            q = rope(rms(q, self.W(p + "self_attn.q_norm.weight"), eps), pos, a.rope_theta)
            k = rope(rms(k, self.W(p + "self_attn.k_norm.weight"), eps), pos, a.rope_theta)
            kc, vc = (cache.layer(L.index)[c].flatten(0, 1) for c in ("k", "v"))
            kc[flat[start:]], vc[flat[start:]] = k.to(kc.dtype), v.to(vc.dtype)
            K, V = (c[flat].float().repeat_interleave(Hq // KV, dim=1) for c in (kc, vc))   # [n, Hq, D]
            att = (torch.einsum("thd,shd->hts", q, K) * D ** -0.5).masked_fill(~mask, float("-inf")).softmax(-1)
            h = h + torch.einsum("hts,shd->thd", att, V).reshape(T, Hq * D) @ self.W(p + "self_attn.o_proj.weight").T
            x = rms(h, self.W(p + "post_attention_layernorm.weight"), eps)
            h = h + (self.moe(p + "mlp.", x, L.ffn) if isinstance(L.ffn, MoESpec) else self.mlp(p + "mlp.", x))
        head = "model.embed_tokens.weight" if s.tie_word_embeddings else "lm_head.weight"
        return rms(h, self.W("model.norm.weight"), eps) @ self.W(head).T

    def decode(self, cache: ModelStates, slots: Sequence[SeqSlot], positions: Sequence[int], tokens: Any):
        """``[B, vocab]`` logits of token ``tokens[b]`` at ``positions[b]`` of ``slots[b]`` (one sequence at a time)."""
        return torch.stack([self.prefill(cache, s, int(p), tokens[b:b + 1])[-1]
                            for b, (s, p) in enumerate(zip(slots, positions))])
