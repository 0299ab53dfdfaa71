"""Absorbed MLA piece: its forward on the op references equals MLA in the *expanded* form, written in torch.

Fresh random weights and a paged cache with random earlier tokens (shuffled blocks) per case. The
formula up-projects keys and values from the cached latents (not the absorbed form the op uses),
applies RoPE by complex multiplication (interleaved) or rotate-half (NeoX) - written here, not
taken from the piece - and checks the cache row the new token wrote. Variants: query LoRA with the
q_a norm as its own site or absorbed into the q_b gemm's prologue, direct q, with / without the
sigmoid output gate, NoPE and both RoPE layouts; TP=2 shards sum to the whole.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.registry import Implementation, ImplementationRegistry, always
from latency_specialized.pieces.attention.mla import MLAAttention
from latency_specialized.plugins import get_registry
from latency_specialized.spec import DenseMLPSpec, IndexerSpec, LayerSpec, MLAAttentionSpec, ModelSpec

from tests.pieces.piece_harness import TOL, ThreadWorld, bind, random_weights, rel, shard, step_context

HIDDEN, BLOCK, EPS = 48, 4, 1e-5


def _attn(q_lora=16, gate=True, rope=False, interleaved=False) -> MLAAttentionSpec:
    return MLAAttentionSpec(num_heads=4, q_lora_rank=q_lora, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                            v_head_dim=8, use_rope=rope, rope_theta=1e4 if rope else None,
                            rope_interleaved=interleaved, output_gate="sigmoid" if gate else "none")


def _spec(a: MLAAttentionSpec) -> ModelSpec:
    return ModelSpec(name="piece-test", variant="tiny", hidden_size=HIDDEN, vocab_size=64, max_context=64,
                     layers=(LayerSpec(index=0, attention=a, ffn=DenseMLPSpec(intermediate=32)),))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float, interleaved: bool) -> torch.Tensor:
    """x [B, ..., R] rotated by pos [B] (fp32 -> x.dtype)."""
    R = x.shape[-1]
    freq = theta ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
    ang = pos.double().view(-1, *([1] * (x.dim() - 1))) * freq                      # [B, ..., R/2]
    if interleaved:   # pairs (2i, 2i+1) as complex numbers
        z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], R // 2, 2).contiguous())
        return torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)).flatten(-2).to(x.dtype)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    xd = x.double()
    rot = torch.cat([-xd[..., R // 2:], xd[..., :R // 2]], dim=-1)                  # rotate_half
    return (xd * cos + rot * sin).to(x.dtype)


def _rms(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def _formula(h, w, a: MLAAttentionSpec, cache, block_table, positions, scale=None):
    """Expanded-form MLA for one new token per sequence; returns (out, new cache rows [B, L + R])."""
    dt = h.dtype
    lin = lambda x, name: (x.float() @ w[name].float().t()).to(dt)   # noqa: E731
    H, nope, R, L, V = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank, a.v_head_dim
    q = lin(_rms(lin(h, "q_a_proj"), w["q_a_norm"]), "q_b_proj") if a.q_lora_rank else lin(h, "q_proj")
    q = q.view(-1, H, nope + R)
    kv = lin(h, "kv_a_proj")
    c, k_pe = _rms(kv[:, :L], w["kv_a_norm"]), kv[:, L:]
    if a.use_rope:
        q = torch.cat([q[..., :nope], _rope(q[..., nope:], positions, a.rope_theta, a.rope_interleaved)], -1)
        k_pe = _rope(k_pe, positions, a.rope_theta, a.rope_interleaved)
    new = torch.cat([c, k_pe], -1)
    wkv = w["kv_b_proj"].float().view(H, nope + V, L)
    outs = []
    for b in range(h.shape[0]):
        n = int(positions[b]) + 1
        pos = torch.arange(n)
        ctx = cache[block_table[b, pos // BLOCK].long(), pos % BLOCK].float()     # earlier tokens
        ctx[-1] = new[b].float()                                                   # the new one
        keys = torch.einsum("tl,hnl->thn", ctx[:, :L], wkv[:, :nope])              # [n, H, nope]
        vals = torch.einsum("tl,hvl->thv", ctx[:, :L], wkv[:, nope:])              # [n, H, V]
        s = (torch.einsum("hn,thn->ht", q[b, :, :nope].float(), keys)
             + torch.einsum("hr,tr->ht", q[b, :, nope:].float(), ctx[:, L:])) * (scale or (nope + R) ** -0.5)
        outs.append(torch.einsum("ht,thv->hv", torch.softmax(s, -1), vals).reshape(H * V))
    o = torch.stack(outs)
    if a.output_gate == "sigmoid":
        o = o * torch.sigmoid(lin(h, "g_proj").float())
    return lin(o.to(dt), "o_proj"), new


def _case(a, dtype, seed, B=3, **piece_kw):
    g = torch.Generator().manual_seed(seed)
    piece, spec = MLAAttention(a, norm_eps=EPS, **piece_kw), _spec(a)
    w = random_weights(piece.weights(spec, 1), dtype, g)
    per_seq = 4
    order = torch.randperm(B * per_seq, generator=g)
    block_table = order.view(B, per_seq).to(torch.int32)
    positions = torch.tensor([5, 0, 13][:B])
    cache = (0.5 * torch.randn(B * per_seq, BLOCK, a.latent_width, generator=g)).to(dtype)
    h = torch.randn(B, HIDDEN, generator=g).to(dtype)
    slots = block_table.gather(1, (positions // BLOCK).view(-1, 1).int()).view(-1).long() * BLOCK + positions % BLOCK
    meta = {"positions": positions, "slots": slots, "seq_lens": (positions + 1).to(torch.int32),
            "block_table": block_table}
    return piece, spec, w, cache, meta, h


def _run(piece, spec, w_rank, cache, meta, h, *, tp=1, rank=0, comm=None, registry=None):
    ops = bind(lambda b: piece.sites(b, spec.shard(tp) if tp > 1 else spec), dtype=h.dtype, rows=h.shape[0], tp=tp,
               registry=registry)
    step = step_context(ops, spec, rows=h.shape[0], meta=meta, tp=tp, rank=rank, comm=comm)
    return piece.forward(step, piece.arrange(w_rank, step.rank_spec), {"kv": cache}, h), ops


def _plain_gemm_registry() -> ImplementationRegistry:
    """The registry plus a top-priority gemm without ``norm_prologue`` (the q_a norm site then runs)."""
    base = get_registry().implementations
    ref = base.reference("gemm").fn
    reg = ImplementationRegistry()
    for impl in base:
        reg.register(impl)
    reg.register(Implementation("gemm", "gemm.test_plain", lambda *a, **kw: ref(*a, **kw), always, priority=1000,
                                provider="test", strided_rows=True))
    return reg


VARIANTS = {
    "lora-gate-nope": _attn(),
    "direct-q-nogate-nope": _attn(q_lora=None, gate=False),
    "direct-q-gate-nope": _attn(q_lora=None, gate=True),
    "lora-gate-rope-neox": _attn(rope=True),
    "lora-nogate-rope-interleaved": _attn(gate=False, rope=True, interleaved=True),
}


CASES = [(v, n) for v, a in VARIANTS.items() for n in (("prologue", "site") if a.q_lora_rank else ("none",))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant,q_a_norm", CASES, ids=[f"{v}-qa_norm_{n}" for v, n in CASES])
def test_mla_piece_equals_expanded_mla(variant, dtype, q_a_norm):
    a = VARIANTS[variant]
    piece, spec, w, cache, meta, h = _case(a, dtype, seed=len(variant) + (dtype == torch.bfloat16))
    want, want_row = _formula(h, w, a, cache, meta["block_table"], meta["positions"])
    before = cache.clone()
    got, ops = _run(piece, spec, w, cache, meta, h, registry=_plain_gemm_registry() if q_a_norm == "site" else None)
    assert rel(got, want) <= TOL[dtype]
    written = cache.view(-1, a.latent_width)[meta["slots"]]
    assert rel(written.float(), want_row.float()) <= TOL[dtype]
    touched = torch.zeros(cache.view(-1, a.latent_width).shape[0], dtype=torch.bool)
    touched[meta["slots"]] = True
    assert torch.equal(cache.view(-1, a.latent_width)[~touched], before.view(-1, a.latent_width)[~touched])
    if a.q_lora_rank:   # the plan's rule decides whether the q_a norm runs as a site of its own
        assert ops.calls["kind/attn.q_a_norm"] == (1 if q_a_norm == "site" else 0)
        assert ("kind/attn.q_a_norm" in ops.skipped) == (q_a_norm == "prologue")


def test_mla_piece_softmax_scale_option():
    a, dtype = _attn(), torch.float32
    piece, spec, w, cache, meta, h = _case(a, dtype, seed=17, softmax_scale=0.11)
    want, _ = _formula(h, w, a, cache, meta["block_table"], meta["positions"], scale=0.11)
    default, _ = _formula(h, w, a, cache, meta["block_table"], meta["positions"])
    got, _ = _run(piece, spec, w, cache, meta, h)
    assert rel(got, want) <= TOL[dtype] < rel(default, want)


def test_mla_piece_tp2_ranks_sum_to_the_whole():
    """Each rank's heads (by the declarations) give a partial sum; every rank writes the same latent row."""
    a, dtype, tp = _attn(), torch.float32, 2
    piece, spec, w, cache, meta, h = _case(a, dtype, seed=3)
    full = cache.clone()
    want, _ = _run(piece, spec, w, full, meta, h)
    decls = piece.weights(spec, tp)

    def rank_body(r, comm):
        c = cache.clone()
        out, _ = _run(piece, spec, {d.name: shard(d, w[d.name], r, tp) for d in decls}, c, meta, h, tp=tp, rank=r,
                      comm=comm)
        return out, c

    (o0, c0), (o1, c1) = ThreadWorld(tp).run(rank_body)
    assert rel(o0 + o1, want) <= TOL[dtype]
    assert torch.equal(c0, c1) and torch.equal(c0, full)


def test_mla_piece_declarations_and_refusals():
    a = _attn()
    piece, spec = MLAAttention(a), _spec(a)
    decls = {d.name: d for d in piece.weights(spec, 2)}
    assert {n for n, d in decls.items() if d.split == 0} == {"q_b_proj", "kv_b_proj", "g_proj"}
    assert decls["o_proj"].split == 1 and decls["q_a_proj"].split is None and decls["kv_a_proj"].split is None
    (kv,) = piece.states(spec, 2)
    assert kv.kind == "paged" and kv.shape == (a.kv_lora_rank + a.qk_rope_head_dim,)   # the whole latent per rank
    with pytest.raises(UserError, match="rope_theta"):
        MLAAttention(a.model_copy(update={"use_rope": True}))
    with pytest.raises(UserError, match="sparse MLA"):
        MLAAttention(a.model_copy(update={"indexer": IndexerSpec(num_heads=2, head_dim=8, topk=4)}))
