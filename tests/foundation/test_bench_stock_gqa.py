"""The layer bench's generic kinds and its stock GQA + latent-MoE composition.

CPU, no Triton needed: the bench-kinds hook (Kimi K3's kinds unchanged, unknown kinds named, the
``--context`` check), roofline bytes of a GQA + latent-MoE layer against a hand count, the kinds table.
Triton stand-ins and the whole stock layer vs ``reference_forward`` (fp32 op references): on the GPU
(``-m gpu``) and on the CPU under the Triton interpreter (``interpreter_case``, run by the driver test
in a ``TRITON_INTERPRET=1`` child process, ``tests/interpret.py``). The decode attention is the kernel
ours runs (``attention.gqa.triton_splitkv``, also interpreter-capable).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from latency_specialized.cli import main
from latency_specialized.errors import UserError
from latency_specialized.plugins import get_registry
from latency_specialized.spec import (ActivationSpec, GQAAttentionSpec, LayerSpec, ModelSpec, MoESpec, NormSpec,
                                      ResidualSpec, RouterSpec)

from tests.interpret import run_interpreted

try:
    import triton  # noqa: F401

    _HAVE_TRITON = True
except Exception:  # noqa: BLE001
    _HAVE_TRITON = False

DEVICES = [
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
    pytest.param("cpu", marks=pytest.mark.interpreter_case, id="interpret"),
]

MUSE_OPTIONS = dict(rope_style="interleaved", attn_output_norm=True, post_attn_norm="weightless",
                    post_ffn_norm="input_scaled", post_norm_eps=1e-8, post_norm_zero_centered=True,
                    gate_temperature=0.3, gate_floor=1e-3, post_expert_norm="input_scaled")
"""Muse Spark's stock options (what its adapter's bench_kinds passes)."""


def _gqa_spec(*, hidden=64, heads=8, kv=4, head_dim=16, window: int | None = 16, theta: float | None = 5e5,
              experts=16, top_k=4, inter=32, latent: int | None = 32, shared=0, residual="gated",
              zero_centered=True, layers=1) -> ModelSpec:
    """A GQA + MoE spec from the generic blocks (Muse Spark's design at ``hidden`` width)."""
    a = GQAAttentionSpec(num_heads=heads, num_kv_heads=kv, head_dim=head_dim, sliding_window=window,
                         rope_theta=theta, qk_norm=True, softmax_scale=5.473 / head_dim ** 0.5, output_gate="sigmoid")
    moe = MoESpec(num_experts=experts, top_k=top_k, num_shared_experts=shared, expert_intermediate=inter,
                  latent_dim=latent, activation=ActivationSpec(kind="swiglu"),
                  router=RouterSpec(score_func="sigmoid", logit_scale=2.0 ** -2.5, renormalize_eps=1e-15))
    return ModelSpec(name="gqa_small", hidden_size=hidden, vocab_size=64, max_context=1 << 20,
                     layers=tuple(LayerSpec(index=i, attention=a, ffn=moe) for i in range(layers)),
                     norm=NormSpec(eps=1e-5, zero_centered=zero_centered), residual=ResidualSpec(kind=residual))


# ------------------------------------------------------------------------------------------ the hook
def test_kimi_bench_kinds_are_the_old_kda_and_mla_cells():
    """kda: context-free, layer 1 (layer 0 is dense); mla: per context, layer 3, block 64 - the layers,
    context axes and block sizes the bench hard-coded before the hook; the default derives the same."""
    from latency_specialized.adapter import ModelAdapter
    from latency_specialized.bench.layer_bench import _layer_index

    adapter = get_registry().adapter("kimi_k3")
    kinds = adapter.bench_kinds()
    full = adapter.spec("full")
    assert list(kinds) == ["kda", "mla"]
    assert (kinds["kda"].layer, kinds["kda"].context, kinds["kda"].stock) == \
        (_layer_index(full, "kda"), False, "kda_moe")
    assert (kinds["mla"].layer, kinds["mla"].context, kinds["mla"].stock, kinds["mla"].kv_block_size) == \
        (_layer_index(full, "mla"), True, "mla_moe", 64)
    assert kinds["kda"].router_weight_bytes == kinds["mla"].router_weight_bytes == 2
    default = ModelAdapter.bench_kinds(adapter)
    for k in kinds:
        assert (default[k].layer, default[k].context, default[k].stock, default[k].kv_block_size) == \
            (kinds[k].layer, kinds[k].context, kinds[k].stock, kinds[k].kv_block_size)


KIMI_NOTES_BEFORE_THE_HOOK = [
    "One GPU, rank 0 of the TP shard: communication (all-reduces) is excluded from both variants.",
    "Routed experts are bf16 in both variants (the published checkpoint stores MXFP4); the roofline counts bf16.",
    "KDA layers keep a fixed-size recurrent state: their work does not depend on the context length, so KDA cells "
    "are measured once per batch (context 'any').",
    "Roofline bytes: weights once per TP group split evenly (router and latent projections / TP even where a "
    "variant replicates them), distinct routed experts of the measured step, KDA state read + written. "
    "Each variant's % roofline counts the experts its own routing touched (the two route with different random "
    "router weights); 'speed-up per byte' = ours % / stock % (the speed-up at equal bytes).",
]
"""The notes ``run_bench`` wrote for Kimi K3 (before "ours" adds its own) when the kinds were hard-coded."""


@pytest.mark.parametrize("kinds", [("kda",), ("kda", "mla")])
def test_kimi_notes_are_unchanged(kinds, monkeypatch):
    from latency_specialized.bench.layer_bench import bench_kinds, bench_notes
    from latency_specialized.bench.stock.flashmla import SOURCE_ENV, mla_note

    monkeypatch.delenv(SOURCE_ENV, raising=False)
    adapter = get_registry().adapter("kimi_k3")
    notes = bench_notes(adapter.spec("full"), bench_kinds(adapter, kinds), 8)
    assert notes == KIMI_NOTES_BEFORE_THE_HOOK + ([mla_note()] if "mla" in kinds else [])
    assert mla_note().startswith("MLA layers: both variants run the same MLA decode attention")


def test_kimi_cells_roofline_is_unchanged():
    """The Kimi path of layer_bytes (no router_weight_bytes: the cells pass none for Kimi's kinds)."""
    from latency_specialized.bench.layer_bench import _bytes_kw, layer_bytes

    adapter = get_registry().adapter("kimi_k3")
    full, kinds = adapter.spec("full"), adapter.bench_kinds()
    assert _bytes_kw(kinds["kda"]) == _bytes_kw(kinds["mla"]) == {}
    b = layer_bytes(full, kinds["mla"].layer, 8, batch=2, context=4096, distinct_experts=30)
    assert set(b) == {"attnres", "attn_weights", "kv_cache", "router", "latent_proj", "routed_experts",
                      "shared_experts", "total"}
    assert b["kv_cache"] == 2 * 4097 * 576 * 2


def test_unknown_kind_names_the_models_kinds(capsys):
    from latency_specialized.bench.layer_bench import bench_kinds

    adapter = get_registry().adapter("kimi_k3")
    with pytest.raises(UserError, match=r"\['swa'\] not benchable for kimi_k3: use --kinds with kda, mla"):
        bench_kinds(adapter, ["kda", "swa"])
    assert main(["bench", "--kinds", "kda,swa"]) == 2
    assert "not benchable for kimi_k3: use --kinds with kda, mla" in capsys.readouterr().err


def test_ours_bench_refuses_an_unknown_kind_and_a_context_kind_without_contexts():
    adapter = get_registry().adapter("kimi_k3")
    harness = adapter.layer_bench()
    with pytest.raises(UserError, match="kimi_k3 has kda, mla"):
        harness.build_ours(adapter.spec("full"), 8, "gqa", 2, (1,), torch.device("cpu"))
    with pytest.raises(UserError, match="the mla bench needs --context"):
        harness.build_ours(adapter.spec("full"), 8, "mla", 2, (1,), torch.device("cpu"))


def muse_bench_kinds(full) -> dict:
    """The body of the ``bench_kinds`` hook the Muse Spark adapter adds (``models/muse_spark/adapter.py``;
    the report of this change gives it to paste): ``swa`` and ``full``, both per context."""
    from latency_specialized.adapter import BenchKind

    moe_layers = [l for l in full.layers if isinstance(l.ffn, MoESpec)]
    first = {"swa": next(l.index for l in moe_layers if l.attention.sliding_window is not None),
             "full": next(l.index for l in moe_layers if l.attention.sliding_window is None)}
    # what stock vLLM 0.33 runs beyond the generic spec (vllm/models/muse_spark/nvidia/model.py): interleaved
    # RoPE (is_neox_style=False), the per-head o_norm before the sigmoid gate, the sandwich post-norms, the
    # norm-preserving residual gate on an fp32 stream, the pre-expert norm, the per-route post-expert norm
    options = {"rope_style": "interleaved", "attn_output_norm": full.attn_output_norm,
               "post_attn_norm": full.post_attn_norm, "post_ffn_norm": full.post_ffn_norm,
               "post_norm_eps": full.post_norm.eps, "post_norm_zero_centered": full.post_norm.zero_centered,
               "gate_temperature": full.residual_gate.temperature, "gate_floor": full.residual_gate.floor,
               "residual_dtype": "float32", "pre_expert_norm": full.latent_pre_norm,
               "post_expert_norm": "input_scaled" if full.latent_post_norm else "none"}
    # router weight fp32 in stock (GateLinear params_dtype=float32): the roofline counts it so
    return {kind: BenchKind(layer=layer, context=True, stock="gqa_moe", kv_block_size=16, router_weight_bytes=4,
                            stock_options=options)
            for kind, layer in first.items()}


def _muse_like_kinds(monkeypatch):
    """The Muse Spark adapter with the swa/full kinds of :func:`muse_bench_kinds`."""
    adapter = get_registry().adapter("muse_spark")
    full = adapter.spec("full")
    kinds = muse_bench_kinds(full)
    monkeypatch.setattr(type(adapter), "bench_kinds", lambda self: kinds)
    return adapter, full, kinds


def test_muse_bench_kinds_hook():
    """The hook's kinds: layer 0 (S) and layer 1 (F) of the S F S S pattern, Muse's stock options; where the
    adapter defines the hook already, it is this one."""
    from latency_specialized.adapter import ModelAdapter

    adapter = get_registry().adapter("muse_spark")
    full = adapter.spec("full")
    kinds = muse_bench_kinds(full)
    assert (kinds["swa"].layer, kinds["full"].layer) == (0, 1)
    assert full.layers[0].attention.sliding_window == 2048 and full.layers[1].attention.sliding_window is None
    assert dict(kinds["swa"].stock_options) == MUSE_OPTIONS | {"residual_dtype": "float32", "pre_expert_norm": True}
    if type(adapter).bench_kinds is not ModelAdapter.bench_kinds:
        assert adapter.bench_kinds() == kinds


@pytest.mark.parametrize("kind", ["swa", "full"])
def test_ours_bench_builds_muse_kinds_through_the_generic_harness(kind, monkeypatch):
    """``runtime/layer_harness.py`` for a Muse Spark kind (a context kind: a paged KV cache of the adapter's
    block size, positions at ``context``): K-layer and 1-layer programs of a small bench spec on the CPU,
    routing recorded, experts handed to stock."""
    from latency_specialized import hardware as hw

    from latency_specialized_models.muse_spark.spec import build_spec

    adapter, full, _ = _muse_like_kinds(monkeypatch)

    def small(self, full, tp, kind, num_layers, *, vocab=512):
        return build_spec(variant=f"bench-{kind}x{num_layers}", hidden=64, vocab=vocab, num_layers=num_layers,
                          heads=16, kv_heads=8, head_dim=16, window=16, experts=16, top_k=4, latent=32,
                          expert_inter=32, max_context=4096, full_layers=() if kind == "swa" else range(num_layers))

    monkeypatch.setattr(type(adapter), "bench_spec", small)
    monkeypatch.setattr(hw, "probe", lambda: hw.for_arch("cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)
    ours = adapter.layer_bench().build_ours(full, 1, kind, 2, (1, 3), torch.device("cpu"), say=lambda s: None,
                                            contexts=(20,), steps=4)
    k, one = ours.variants(3, 20)
    assert (k.layers, one.layers, k.bucket, k.context) == (2, 1, 4, 20)
    k.eager()
    ids = k.routing()
    assert len(ids) == 2 and all(t.shape == (3, 4) for t in ids)
    assert ours.expert_weights(3)[2][0].shape == (16, 64, 32)
    assert not any("moe.shared" in n for n in ours.notes)  # no shared experts: no shared-gemm note
    ours.close()


def test_context_needs_some_kind_with_a_context_axis(capsys, monkeypatch):
    _muse_like_kinds(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # a context kind in --kinds: the check passes (and the no-GPU error follows)
    assert main(["bench", "--model", "muse_spark", "--kinds", "swa,full", "--context", "4096,32768"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert main(["bench", "--model", "muse_spark", "--kinds", "kda", "--context", "4096"]) == 2
    assert "not benchable for muse_spark: use --kinds with swa, full" in capsys.readouterr().err
    # Kimi's message is unchanged
    assert main(["bench", "--kinds", "kda", "--context", "4096"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --context 4096 sets the MLA cells' context but --kinds kda has no mla: add it (--kinds kda,mla) "
        "or drop --context")


def test_muse_like_kinds_summary_and_notes(monkeypatch):
    """The result's per-kind record and notes say what each kind measures: window, KV bytes, stand-ins."""
    from latency_specialized.bench.layer_bench import kind_summary
    from latency_specialized.bench.report import kinds_table
    from latency_specialized.bench.stock.compositions import composition

    _, full, kinds = _muse_like_kinds(monkeypatch)
    s = {n: kind_summary(full, 8, n, bk) for n, bk in kinds.items()}
    assert s["swa"]["window"] == 2048 and s["full"]["window"] is None
    assert s["swa"]["kv_bytes_per_token"] == 2 * 64 * 2 * 2 and s["swa"]["kv_heads_rank"] == 2
    assert s["swa"]["rope_theta"] == 5e5 and s["full"]["rope_theta"] is None
    table = kinds_table({"kinds": s})
    assert "| swa | " in table and "| 2048 | 512 |" in table and "none (full)" in table
    notes = composition("gqa_moe").notes(full, "swa", kinds["swa"], 8)
    assert "min(context + 1, 2048) tokens" in notes[0] and "512 B of k + v per token" in notes[0]
    assert "attention.gqa.triton_splitkv" in notes[1] and "stand-in" in notes[1]
    notes_full = composition("gqa_moe").notes(full, "full", kinds["full"], 8)
    assert "context + 1 tokens (full attention)" in notes_full[0] and "NoPE" in notes_full[0]


# ------------------------------------------------------------------------------------------ roofline
def test_gqa_latent_moe_layer_bytes_match_hand_count_at_tp8():
    """Muse Spark's widths from the generic blocks: weights / TP, router fp32, KV read per window."""
    from latency_specialized.bench.layer_bench import layer_bytes

    full = _gqa_spec(hidden=8192, heads=128, kv=16, head_dim=64, window=2048, experts=256, top_k=8, inter=4096,
                     latent=4096, layers=2)
    N, L, I = 8192, 4096, 4096
    b = layer_bytes(full, 0, 8, batch=1, context=4096, distinct_experts=8, router_weight_bytes=4)
    assert b["attn_weights"] == pytest.approx(((128 * 64 * 2 + 2 * 16 * 64) * N + N * 128 * 64) * 2 / 8)
    assert b["router"] == pytest.approx((256 * N * 4 + 256 * 4) / 8)                 # fp32 weight, fp32 bias
    assert b["latent_proj"] == pytest.approx((2 * L * N + L) * 2 / 8)
    assert b["routed_experts"] == pytest.approx(8 * (2 * I * L + L * I) * 2 / 8)
    assert b["shared_experts"] == 0
    assert b["norms"] == pytest.approx((4 * N * 2 + 2 * 2 * N * 4 + L * 2) / 8)
    kv_rank = 16 // 8
    assert b["kv_cache"] == 1 * 2048 * kv_rank * 64 * 2 * 2                        # the window, not the context
    assert b["kv_write"] == kv_rank * 64 * 2 * 2
    assert b["total"] == pytest.approx(sum(v for k, v in b.items() if k != "total"))
    assert 150e6 < b["total"] < 200e6                                               # ~173 MB: ~40 us at 4.3 TB/s
    short = layer_bytes(full, 0, 8, batch=4, context=100, distinct_experts=8, router_weight_bytes=4)
    assert short["kv_cache"] == 4 * 101 * kv_rank * 64 * 4                          # min(context + 1, window)
    nope = _gqa_spec(hidden=8192, heads=128, kv=16, head_dim=64, window=None, theta=None, experts=256, top_k=8,
                     inter=4096, latent=4096)
    f = layer_bytes(nope, 0, 8, batch=64, context=32768, distinct_experts=200)
    assert f["kv_cache"] == 64 * 32769 * kv_rank * 64 * 4                           # full attention: context + 1
    assert f["router"] == pytest.approx((256 * N * 2 + 256 * 4) / 8)                # default: bf16 weight
    # KV heads replicate past TP = num_kv_heads: each rank reads its one head's cache
    assert layer_bytes(nope, 0, 32, batch=1, context=99, distinct_experts=1)["kv_cache"] == 100 * 1 * 64 * 4


# ------------------------------------------------------------------------------------------ stand-in kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rope", ["interleaved", "neox", None])
def test_qk_norm_rope_kv_matches_reference(device, rope):
    from latency_specialized.bench.stock.gqa_kernels import qk_norm_rope_kv
    from latency_specialized.ops.rope import apply_rope, rope_inv_freq

    torch.manual_seed(1)
    M, Hq, KV, D, bs = 3, 4, 2, 16, 8
    qkv = torch.randn(M, (2 * Hq + 2 * KV) * D, device=device).to(torch.bfloat16)
    pos = torch.tensor([5, 17, 40], device=device)
    inv = rope_inv_freq(5e5, D, device=device) if rope else None
    kc = torch.full((8, bs, KV, D), float("nan"), device=device, dtype=torch.bfloat16)
    vc = kc.clone()
    slots = torch.tensor([3, 12, -1], device=device)
    q = torch.full((M, Hq, D), float("nan"), device=device, dtype=torch.bfloat16)
    qk_norm_rope_kv(qkv, pos, inv, slots, kc, vc, num_heads=Hq, num_kv_heads=KV, qk_norm=True, eps=1e-5,
                    rope_style=rope or "neox", q_out=q)
    qf, kf = qkv[:, :Hq * D].float().view(M, Hq, D), qkv[:, Hq * D:(Hq + KV) * D].float().view(M, KV, D)
    qf = qf * torch.rsqrt(qf.pow(2).mean(-1, keepdim=True) + 1e-5)
    kf = kf * torch.rsqrt(kf.pow(2).mean(-1, keepdim=True) + 1e-5)
    if rope:
        qf, kf = apply_rope(qf, pos, inv, rope), apply_rope(kf, pos, inv, rope)
    torch.testing.assert_close(q.float(), qf, rtol=1e-2, atol=1e-2)
    flat_k, flat_v = kc.view(-1, KV, D), vc.view(-1, KV, D)
    for m, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        torch.testing.assert_close(flat_k[s].float(), kf[m], rtol=1e-2, atol=1e-2)
        assert torch.equal(flat_v[s], qkv[m, (Hq + KV) * D:(Hq + 2 * KV) * D].view(KV, D))
    written = torch.zeros(flat_k.shape[0], dtype=torch.bool)
    written[[3, 12]] = True
    assert torch.isnan(flat_k[~written.to(device)].float()).all()   # the padding row wrote nothing


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("post", ["none", "weightless", "weighted", "input_scaled"])
@pytest.mark.parametrize("gated", [True, False])
def test_norm_residual_norm_matches_gated_join_reference(device, post, gated):
    from latency_specialized.bench.stock.gqa_kernels import norm_residual_norm
    from latency_specialized.ops.residual_gated import gated_join_reference, norm_preserving_coefficients

    torch.manual_seed(2)
    M, N = 3, 96
    wide = torch.randn(M, 2 * N, device=device).to(torch.bfloat16)
    branch = wide[:, :N]  # strided rows
    stream = torch.randn(M, N, device=device)
    pre_w = (0.1 * torch.randn(N, device=device)).to(torch.bfloat16)
    post_w = (0.1 * torch.randn(N, device=device)).to(torch.bfloat16)
    gate = torch.randn(N, device=device) if gated else None
    alpha, beta = norm_preserving_coefficients(gate, 0.3, 1e-3) if gated else (None, None)
    ref_stream = stream.clone()
    want, _ = gated_join_reference(branch, ref_stream, pre_w, 1e-5, zero_centered=True, post=post, post_weight=post_w,
                                   post_eps=1e-8, post_zero_centered=True, gate=gate, gate_temperature=0.3,
                                   gate_eps=1e-3)
    out = torch.full((M, N), float("nan"), device=device, dtype=torch.bfloat16)
    norm_residual_norm(branch, stream, pre_w, 1e-5, pre_zero_centered=True, post=post, post_weight=post_w,
                       post_eps=1e-8, post_zero_centered=True, alpha=alpha, beta=beta, out=out)
    torch.testing.assert_close(stream, ref_stream, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gain", ["input_scaled", "weighted", None])
def test_post_expert_finalize_and_silu_match_references(device, gain):
    from latency_specialized.bench.stock.gqa_kernels import post_expert_finalize, silu_and_mul
    from latency_specialized.ops.activation import gated_activation
    from latency_specialized.ops.moe import finalize_reference

    torch.manual_seed(3)
    M, k, L = 3, 4, 48
    rows = torch.randn(M * k, L, device=device).to(torch.bfloat16)
    w = torch.rand(M, k, device=device)
    g = (0.1 * torch.randn(L, device=device)).to(torch.bfloat16) if gain else None
    out = torch.full((M, L), float("nan"), device=device, dtype=torch.bfloat16)
    post_expert_finalize(rows, w, g, 1e-8, gain_before_norm=gain == "input_scaled", zero_centered=True, out=out)
    want = finalize_reference(rows.view(M, k, L), w, g, 1e-8, gain_before_norm=gain == "input_scaled",
                              zero_centered=True)
    torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2)
    x = (3 * torch.randn(5, 2 * 40, device=device)).to(torch.bfloat16)
    for clamp in (None, 2.0):
        y = torch.full((5, 40), float("nan"), device=device, dtype=torch.bfloat16)
        silu_and_mul(x, clamp=clamp, out=y)
        act = ActivationSpec(kind="swiglu", clamp=clamp)
        torch.testing.assert_close(y.float(), gated_activation(x[:, :40], x[:, 40:], act).to(torch.bfloat16).float(),
                                   rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------------------------------ the layer
def _pair(layer):
    """A copy of ``layer`` for the reference (own caches and routing buffer; weights shared)."""
    ref = copy.copy(layer)
    ref.k_cache, ref.v_cache = layer.k_cache.clone(), layer.v_cache.clone()
    ref.moe = copy.copy(layer.moe)
    ref.moe.topk_ids = layer.moe.topk_ids.clone()
    return ref


CASES = {
    # Muse Spark's two kinds at test widths: a sliding-window RoPE layer (context below and beyond the
    # window) and a NoPE full-attention layer; then a generic GQA + MoE without a latent width, with shared
    # experts, a plain pre-norm residual and NeoX RoPE
    "swa": (dict(), MUSE_OPTIONS),
    "full": (dict(window=None, theta=None), MUSE_OPTIONS),
    "plain": (dict(latent=None, shared=1, residual="pre_norm", zero_centered=False),
              dict(rope_style="neox", post_expert_norm="none")),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case,batch,context", [("swa", 1, 5), ("swa", 3, 40), ("full", 3, 40), ("plain", 2, 9)])
def test_stock_gqa_layer_matches_reference_composition(device, case, batch, context):
    """Stock composition (Triton stand-ins, the shared attention kernel) == the layer from op references."""
    from latency_specialized.bench.stock.common import StockLayers
    from latency_specialized.bench.stock.gqa_moe import GatedStream, StockGQAMoELayer, StockGQAOptions

    spec_kw, opts = CASES[case]
    full = _gqa_spec(**spec_kw)
    torch.manual_seed(batch + context)
    options = StockGQAOptions.from_mapping(opts)
    layer = StockGQAMoELayer(full, 0, 2, batch, context, device, options=options, block_size=8,
                             router_weight_bytes=4 if case != "plain" else 2)
    ref = _pair(layer)
    st = GatedStream.random(batch, full.hidden_size, layer.res_dtype, device)
    st_ref = st.clone()
    layer.forward(st)
    ref.reference_forward(st_ref)
    # the same experts (the order of near-equal scores may differ after different roundings of h2)
    assert torch.equal(layer.routed_ids().long().sort(-1).values, ref.routed_ids().long().sort(-1).values)
    out, want = st.branch.float(), st_ref.branch.float()
    assert not torch.isnan(out).any()
    # a whole layer of bf16 roundings, rounded at different points on each side: each stage is ~0.4% off
    # (one bf16 ulp), about eight stages in series, and the RMSNorms pass relative errors on unshrunk:
    # h2 ~1.4%, the layer ~2-3.5% (the MoE sublayer alone, from one input, ~0.7%: the next test)
    torch.testing.assert_close(out, want, rtol=5e-2, atol=5e-2 * float(want.abs().max()))
    assert float((out - want).norm() / want.norm()) < 5e-2
    s_out, s_want = st.stream.float(), st_ref.stream.float()  # joined twice: gated adds of normed branches
    torch.testing.assert_close(s_out, s_want, rtol=5e-2, atol=5e-2 * float(s_want.abs().max()))
    assert float((s_out - s_want).norm() / s_want.norm()) < 2e-2
    # the new token's k and v written (each side from its own projection: bf16 GEMM vs fp32 matmul)
    torch.testing.assert_close(layer.k_cache.float(), ref.k_cache.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(layer.v_cache.float(), ref.v_cache.float(), rtol=2e-2, atol=2e-2)
    # the bench's K-copy wrapper runs them back to back and reports routing of every copy
    layers = StockLayers([layer, layer], st)
    layers.step()
    assert len(layers.routed_ids()) == 2 and layers.weight_bytes() == 2 * layer.weight_bytes()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["swa", "plain"])
def test_stock_moe_sublayer_matches_reference_from_one_input(device, case):
    from latency_specialized.bench.stock.gqa_moe import StockGQAMoELayer, StockGQAOptions

    spec_kw, opts = CASES[case]
    full = _gqa_spec(**spec_kw)
    torch.manual_seed(7)
    moe = StockGQAMoELayer(full, 0, 2, 3, 8, device, options=StockGQAOptions.from_mapping(opts), block_size=8,
                           router_weight_bytes=4 if case != "plain" else 2).moe
    ref = copy.copy(moe)
    ref.topk_ids = moe.topk_ids.clone()
    h2 = torch.randn(3, full.hidden_size, device=device).to(torch.bfloat16)
    out = torch.full_like(h2, float("nan"))
    want = torch.empty_like(h2)
    moe.forward(h2, out)
    ref.reference_forward(h2, want)
    assert torch.equal(moe.topk_ids.long().sort(-1).values, ref.topk_ids.long().sort(-1).values)
    assert float((out.float() - want.float()).norm() / want.float().norm()) < 1.5e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["swa", "full"])
def test_muse_tiny_kinds_build_and_step_through_the_bench_composition(device, kind, monkeypatch):
    """What the bench calls for a Muse Spark kind (``compositions.composition('gqa_moe').build``) on the Muse
    tiny spec at TP 2: two copies step back to back, every output written, the routing of both reported."""
    from latency_specialized.bench.stock.compositions import composition

    adapter, _, kinds = _muse_like_kinds(monkeypatch)
    tiny = adapter.spec("tiny")
    bk = kinds[kind]
    li = next(l.index for l in tiny.layers if (l.attention.sliding_window is None) == (kind == "full"))
    bk = dataclasses.replace(bk, layer=li)
    torch.manual_seed(0)
    stock = composition(bk.stock).build(tiny, bk, 2, 2, 40, 2, device)
    before = stock.st.stream.clone()
    stock.step()
    assert not torch.isnan(stock.st.branch).any() and not torch.equal(stock.st.stream, before)
    ids = stock.routed_ids()
    assert len(ids) == 2 and all(t.shape == (2, tiny.layers[li].ffn.top_k) for t in ids)
    assert stock.layers[0].moe.w_router.dtype == torch.float32  # router_weight_bytes 4
    assert (stock.layers[0].a.sliding_window is None) == (kind == "full")


def test_stock_gqa_options_refuse_unknown_keys_and_attention_resolves():
    from latency_specialized.bench.stock.gqa_moe import GQA_ATTENTION, StockGQAOptions, resolve_attention

    with pytest.raises(UserError, match="rope_stlye"):
        StockGQAOptions.from_mapping({"rope_stlye": "neox"})
    fn = resolve_attention()
    from latency_specialized.kernels import gqa_decode_triton

    assert fn is next(i.fn for i in gqa_decode_triton.IMPLEMENTATIONS if i.name == GQA_ATTENTION)


@pytest.mark.interpreter_driver
@pytest.mark.skipif(not _HAVE_TRITON, reason="needs triton (its interpreter runs the kernels on the CPU)")
def test_cpu_cases_under_the_interpreter():
    """The stand-in kernels and the stock GQA + MoE layer on the CPU (Triton interpreter, child process)."""
    run_interpreted("tests/foundation/test_bench_stock_gqa.py", min_passed=22)
