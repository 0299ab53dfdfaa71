"""Plain-torch DeepSeek-V4.1-Flash decoder (fp32 weights), from vLLM 0.33's math; the oracle of the decode program.
Its own history per sequence (``SeqCache``: raw rows and compressor inputs, re-pooled on every read) rides beside the
program's ``ModelStates`` (``ReferenceStates``); ``prefill`` / ``decode`` also fill the states the sparse MQA piece
reads (window ring, compressed rows, pending rows, indexer keys rope-leading: ``pieces/attention/sparse_mqa.py``).

Layer: mHC seam (``ops.residual_mhc``, vLLM's delayed pre-mix) -> sparse MQA -> seam -> MoE; the last seam collapses
with the last FFN pre-mix, then ``norm``, ``head``. Attention (one KV head, K = V): ``qr = q_norm(wq_a x)``, ``q =
rms(wq_b qr)`` per head (weightless, as transformers' V4), ``kv = kv_norm(wkv x)``; interleaved RoPE on the last
``rope_dim`` channels (``compress_rope_theta`` where ratio > 0); keys = the last ``window`` raw rows + the top-k
compressed rows; per-head sink logit; inverse RoPE on the output; ``wo_b(bmm_g(wo_a, o_g))``. Compressed rows (KV
source ``L``, from its input): ratio 1 ``norm(wkv_c x_t)``, ratio 2 ``norm(sum_t softmax_t(wgate x_t) wkv_c x_t)`` over
tokens ``2j, 2j+1``, visible once both are in. Indexer: ``sum_h w_h relu(q_h . k_j)``, ``w = weights_proj x /
sqrt(heads D_i)``, ``k_j = rope(k_norm(wk c_j))`` of the latest KV source; later layers reuse the latest selection.
UNCLEAR in vLLM (fused kernels not in the sources), taken as said: a compressed row's rope position (its last token),
window rows kept in the compressed set, the gate's softmax axis (the group's tokens, per channel), the shared expert's
clamp (as V4). Not modelled: candidate blocks (they only narrow indexers past ``candidate_topk_blocks *
candidate_block_size`` rows), Engram, YaRN (refused).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from latency_specialized.errors import UserError
from latency_specialized.ops.residual_mhc import mhc_seam_reference
from latency_specialized.ops.rope import rope_inv_freq
from latency_specialized.runtime.states import ModelStates, SeqSlot

from latency_specialized_models.deepseek_v41_flash.spec import DeepseekV41Spec


def refuse_unmodelled(spec: DeepseekV41Spec, what: str) -> None:
    """UserError naming the fix for what neither the reference nor the program models (Engram, YaRN)."""
    if spec.engram.layers:
        raise UserError(f"{spec.name} {what}: Engram lookups (layers {spec.engram.layers}) are not implemented; "
                        "use a spec without Engram layers")
    if spec.rope.yarn_factor != 1.0:
        raise UserError(f"{spec.name} {what}: YaRN (factor {spec.rope.yarn_factor}) is not implemented; use 1")


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def _rope(x: torch.Tensor, pos: torch.Tensor, dim: int, theta: float, sign: float = 1.0) -> torch.Tensor:
    """Interleaved-pair rotation of the last ``dim`` channels of ``x [T, ..., C]`` at positions ``pos [T]`` (fp32
    angles, as vLLM: fp64 ones differ by ~1e-2 rad near position 131072)."""
    inv = rope_inv_freq(theta, dim, pos.device)
    ang = (pos.to(torch.float32)[:, None] * inv).to(x.dtype)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (dim // 2,)
    cos, sin = ang.cos().view(shape), sign * ang.sin().view(shape)
    r = x[..., -dim:]
    a, b = r[..., 0::2], r[..., 1::2]
    rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat([x[..., :-dim], rot], dim=-1)


@dataclass
class SeqCache:
    """One sequence: ``kv`` layer -> [length, D] raw rows (normed, roped); ``ckv`` / ``cgate`` KV source -> inputs."""

    length: int = 0
    kv: dict[int, torch.Tensor] = field(default_factory=dict)
    ckv: dict[int, torch.Tensor] = field(default_factory=dict)
    cgate: dict[int, torch.Tensor] = field(default_factory=dict)


class ReferenceStates(ModelStates):
    """The program's states plus the reference's history of every row (``seqs``), copied along with a sequence and
    kept by ``clone`` (``ModelStates.copy_history``: the snapshots verification steps roll back to)."""

    seqs: dict[int, SeqCache]

    def copy_sequence(self, dst: SeqSlot, src: ModelStates, src_slot: SeqSlot, tokens: int, *, paged: bool = True):
        super().copy_sequence(dst, src, src_slot, tokens, paged=paged)
        h = src.seqs[src_slot.row]  # type: ignore[attr-defined]
        self.seqs[dst.row] = SeqCache(tokens, *({k: v[:tokens] for k, v in d.items()} for d in (h.kv, h.ckv, h.cgate)))

    def copy_history(self, out: "ReferenceStates") -> None:  # type: ignore[override]
        out.seqs = {r: SeqCache(h.length, dict(h.kv), dict(h.ckv), dict(h.cgate)) for r, h in self.seqs.items()}


class DeepseekV41Reference:
    """``prefill(cache, slot, start, ids) -> logits [T, V]``, ``decode(cache, slots, positions, ids) -> [B, V]``."""

    def __init__(self, spec: DeepseekV41Spec, named: dict[str, torch.Tensor], tokenizer=None):
        self.spec, self.w, self.named, self.tokenizer, self.bos_token_id = spec.full(), named, named, tokenizer, None
        refuse_unmodelled(self.spec, "reference")

    def new_cache(self, num_seqs: int = 4, max_len: int | None = None, *, block_size: int = 16,
                  shuffle_seed: int | None = None) -> ReferenceStates:
        """States of ``num_seqs`` sequences of ``max_len`` tokens (default up to 1024); slots by index or SeqSlot."""
        from latency_specialized_models.deepseek_v41_flash.composed import composed_model
        emb = self.w["embed.weight"]
        max_len = max_len or min(self.spec.max_context, 1024)
        out = ReferenceStates.allocate(composed_model(self.spec), num_seqs, max_len, block_size=block_size,
                                       dtype=emb.dtype, device=emb.device, shuffle_seed=shuffle_seed)
        out.seqs = {}  # type: ignore[attr-defined]
        return out  # type: ignore[return-value]

    # ---------------------------------------------------------------------------------------------- pieces
    def _lin(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w[name].to(x.dtype).t()

    def _compressed(self, seq: SeqCache, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows [R, D] normed + roped, pre-rope latents [R, D], last-token positions [R]) of KV source ``layer``."""
        s, p, a = self.spec, f"layers.{layer}.attn.", self.spec.layers[layer].attention
        ratio, kv = a.compress_ratio, seq.ckv[layer]
        R = kv.shape[0] // ratio
        if ratio == 1 or R == 0:
            pooled = kv[: R * ratio]
        else:
            g = seq.cgate[layer][: R * ratio].view(R, ratio, kv.shape[1])
            pooled = (torch.softmax(g, dim=1) * kv[: R * ratio].view(R, ratio, -1)).sum(1)
        lat = _rms(pooled, self.w[p + "compressor.norm.weight"].to(kv.dtype), s.norm.eps)
        pos = torch.arange(R, device=kv.device) * ratio + ratio - 1
        return _rope(lat, pos, a.rope_dim, s.rope.compress_theta), lat, pos

    def _select(self, seq: SeqCache, layer: int, qr: torch.Tensor, x: torch.Tensor, pos: torch.Tensor,
                lat: torch.Tensor, cpos: torch.Tensor) -> torch.Tensor:
        """[T, R] bool: the compressed rows index-source ``layer``'s top-k picks for each query."""
        s, p = self.spec, f"layers.{layer}.attn.indexer."
        idx, a = s.layers[layer].attention.indexer, s.layers[layer].attention
        q = self._lin(p + "wq_b.weight", qr).view(len(pos), idx.num_heads, idx.head_dim)
        q = _rope(q, pos, a.rope_dim, s.rope.compress_theta)
        k = self._index_keys(s.kv_source_for(layer), lat, cpos)
        wts = self._lin(p + "weights_proj.weight", x) * (idx.num_heads * idx.head_dim) ** -0.5
        score = (torch.relu(torch.einsum("thd,rd->thr", q, k)) * wts[:, :, None]).sum(1)
        score = score.masked_fill(~(visible := cpos[None, :] <= pos[:, None]), float("-inf"))
        k_top, sel = min(s.index_topk, lat.shape[0]), torch.zeros_like(visible)
        if k_top:
            sel.scatter_(1, score.topk(k_top, dim=1).indices, True)
        return sel & visible

    def _index_keys(self, owner: int, lat: torch.Tensor, cpos: torch.Tensor) -> torch.Tensor:
        """[R, D_i] indexer keys of KV source ``owner``'s compressed rows (pre-rope latents ``lat``)."""
        s, p = self.spec, f"layers.{owner}.attn.indexer."
        k = _rms(self._lin(p + "wk.weight", lat), self.w[p + "k_norm.weight"].to(lat.dtype), s.norm.eps)
        return _rope(k, cpos, s.layers[owner].attention.rope_dim, s.rope.compress_theta)

    def _export(self, st: ReferenceStates, slot: SeqSlot, seq: SeqCache, start: int) -> None:
        """Write what the sparse MQA pieces read after ``seq``'s tokens ``start..`` (``SparseMQAAttention.fill``)."""
        from latency_specialized_models.deepseek_v41_flash.composed import composed_model
        for lp in composed_model(self.spec).layers:
            i, crow, inputs, keys = lp.index, None, None, None
            if i in self.spec.kv_source_layers:
                crow, lat, cpos = self._compressed(seq, i)
                inputs = torch.cat([seq.ckv[i], seq.cgate[i]], -1) if i in seq.cgate else None
                keys = self._index_keys(i, lat, cpos) if lp.attention.index_keys else None
            lp.attention.fill(st.layer(i), slot.row, slot.blocks, start, seq.kv[i], crow, inputs, keys)

    def _attention(self, seq: SeqCache, layer: int, x: torch.Tensor, pos: torch.Tensor,
                   picks: dict[int, torch.Tensor]) -> torch.Tensor:
        s, p = self.spec, f"layers.{layer}.attn."
        a, T, eps = s.layers[layer].attention, len(pos), s.norm.eps
        D, Hq, theta = a.head_dim, a.num_heads, s.rope.compress_theta if a.compress_ratio else s.rope.theta
        qr = _rms(self._lin(p + "wq_a.weight", x), self.w[p + "q_norm.weight"].to(x.dtype), eps)
        q = _rope(_rms(self._lin(p + "wq_b.weight", qr).view(T, Hq, D), None, eps), pos, a.rope_dim, theta)
        kv = _rope(_rms(self._lin(p + "wkv.weight", x), self.w[p + "kv_norm.weight"].to(x.dtype), eps),
                   pos, a.rope_dim, theta)
        if layer in s.kv_source_layers:  # compressor inputs (before this layer's own compressed read)
            seq.ckv[layer] = torch.cat([seq.ckv.get(layer, x.new_zeros(0, D)), self._lin(p + "compressor.wkv.weight", x)])
            if a.compress_ratio > 1:
                seq.cgate[layer] = torch.cat([seq.cgate.get(layer, x.new_zeros(0, D)),
                                              self._lin(p + "compressor.wgate.weight", x)])
        rows = keys = seq.kv[layer] = torch.cat([seq.kv.get(layer, x.new_zeros(0, D)), kv])
        rpos = torch.arange(rows.shape[0], device=x.device)
        mask = (rpos[None, :] <= pos[:, None]) & (rpos[None, :] > pos[:, None] - a.sliding_window)
        if a.compress_ratio:
            crow, lat, cpos = self._compressed(seq, s.kv_source_for(layer))
            if layer in s.index_source_layers:
                picks[layer] = self._select(seq, layer, qr, x, pos, lat, cpos)
            keys = torch.cat([rows, crow])
            mask = torch.cat([mask, picks[s.index_source_for(layer)]], dim=1)
        logits = (torch.einsum("thd,kd->thk", q, keys) * D ** -0.5).masked_fill(~mask[:, None, :], float("-inf"))
        sink = self.w[p + "attn_sink"].to(x.dtype)[None, :, None].expand(T, Hq, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        o = _rope(torch.einsum("thk,kd->thd", probs, keys), pos, a.rope_dim, theta, sign=-1.0)
        G = a.o_groups
        wo_a = self.w[p + "wo_a.weight"].to(x.dtype).view(G, a.o_lora_rank, Hq * D // G)
        og = torch.einsum("tgi,goi->tgo", o.reshape(T, G, Hq * D // G), wo_a)
        return self._lin(p + "wo_b.weight", og.reshape(T, G * a.o_lora_rank))

    def _moe(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        f, p = self.spec.layers[layer].ffn, f"layers.{layer}.ffn."
        c, r = f.activation.clamp, f.router
        scores = torch.sqrt(F.softplus(self._lin(p + "gate.weight", x).float()))
        top = (scores + self.w[p + "gate.bias"].float()).topk(f.top_k, dim=-1).indices
        wts = scores.gather(1, top)
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20) * r.routed_scaling

        def mlp(pre: str, h: torch.Tensor) -> torch.Tensor:
            g = self._lin(pre + "w1.weight", h).clamp(max=c)
            u = self._lin(pre + "w3.weight", h).clamp(-c, c)
            return self._lin(pre + "w2.weight", F.silu(g) * u)

        out = mlp(p + "shared_experts.", x) if f.num_shared_experts else torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(f.top_k):
                out[t] += wts[t, k].to(x.dtype) * mlp(f"{p}experts.{int(top[t, k])}.", x[t:t + 1])[0]
        return out

    # ---------------------------------------------------------------------------------------------- model
    def _forward(self, seq: SeqCache, start: int, ids: torch.Tensor) -> torch.Tensor:
        s, w = self.spec, self.w
        if start != seq.length:
            raise UserError(f"{s.name} reference: chunk starts at {start} but the slot holds {seq.length} tokens; "
                            "prefill chunks in order")
        dt = w["embed.weight"].dtype
        pos = torch.arange(start, start + len(ids), device=w["embed.weight"].device)
        ids = ids.to(pos.device)
        n, eps = s.residual.streams, s.norm.eps
        streams = w["embed.weight"][ids].unsqueeze(1).expand(-1, n, -1).contiguous()
        kw = dict(rms_eps=eps, hc_eps=s.hyper.eps, post_mult=s.hyper.post_alpha, sinkhorn_iters=s.residual.sinkhorn_iters)
        pre = y = post = comb = None
        picks: dict[int, torch.Tensor] = {}
        for layer in range(s.num_layers):
            p = f"layers.{layer}."
            for sub in ("attn", "ffn"):
                x, pre, post, comb = mhc_seam_reference(  # (the arguments are read before the names are rebound)
                    streams, w[f"{p}hc_{sub}_fn"], w[f"{p}hc_{sub}_scale"], w[f"{p}hc_{sub}_base"],
                    w[f"{p}{sub}_norm.weight"].to(dt), eps, pre=pre, y=y, post=post, comb=comb, **kw)
                y = self._attention(seq, layer, x, pos, picks) if sub == "attn" else self._moe(layer, x)
        x, *_ = mhc_seam_reference(streams, None, None, None, w["norm.weight"].to(dt), eps, pre=pre, y=y, post=post,
                                   comb=comb, **kw)
        seq.length += len(ids)
        return x @ w["head.weight"].t()

    @torch.no_grad()
    def prefill(self, cache: ReferenceStates, slot: int | SeqSlot, start: int, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[T, V]`` of tokens ``ids [T]`` at positions ``start..``, appended to ``slot`` (its states too)."""
        slot = cache.slots[slot] if isinstance(slot, int) else slot
        seq = cache.seqs.setdefault(slot.row, SeqCache())
        out = self._forward(seq, start, torch.as_tensor(ids).long())
        self._export(cache, slot, seq, start)
        return out

    @torch.no_grad()
    def seed_history(self, cache: ReferenceStates, slot: SeqSlot, length: int, generator: torch.Generator) -> None:
        """A synthetic history of ``length`` tokens in ``slot`` (long-context matrix cells, ``testing/history.py``):
        random unit-scale raw rows and compressor inputs, the sparse MQA states exported from them."""
        e = self.w["embed.weight"]
        seq = cache.seqs[slot.row] = SeqCache(length)
        for layer, L in enumerate(self.spec.layers):
            keep = [seq.kv] + ([seq.ckv] if layer in self.spec.kv_source_layers else [])
            for d in keep + ([seq.cgate] if len(keep) > 1 and L.attention.compress_ratio > 1 else []):
                d[layer] = torch.randn(length, L.attention.head_dim, generator=generator, device=e.device).to(e.dtype)
        self._export(cache, slot, seq, 0)

    @torch.no_grad()
    def decode(self, cache: ReferenceStates, slots: list, positions: list[int], ids: torch.Tensor) -> torch.Tensor:
        """One token per slot (``ids [B]``) at ``positions`` (each its slot's length): logits ``[B, V]``."""
        return torch.stack([self.prefill(cache, sl, int(p), torch.as_tensor(ids)[b:b + 1])[0]
                            for b, (sl, p) in enumerate(zip(slots, positions))])


__all__ = ["DeepseekV41Reference", "ReferenceStates", "SeqCache", "refuse_unmodelled"]
