"""The stock MLA decode on the GPU: the Triton ``concat_and_cache_mla`` against its torch reference (always), and
the real FlashMLA call (``StockFlashMLA``) against ``mla_decode_reference`` at Kimi K3 TP8 rank shapes, eager and
replayed from a CUDA graph - these need ``LS_FLASHMLA_SRC`` (a FlashMLA checkout; the first build takes ~1.5 min)
and are skipped, reported as such, without it."""

from __future__ import annotations

import os

import pytest
import torch

from latency_specialized.bench.stock import flashmla as fm

pytestmark = pytest.mark.gpu
needs_flashmla = pytest.mark.skipif(not os.environ.get(fm.SOURCE_ENV),
                                    reason=f"{fm.SOURCE_ENV} unset: no FlashMLA checkout to build")


@pytest.mark.parametrize("L,R,M", [(512, 64, 1), (512, 64, 5), (96, 24, 3)])
def test_concat_and_cache_kernel_equals_the_reference(L, R, M):
    g = torch.Generator(device="cuda").manual_seed(M)
    cache = torch.randn(7, 16, L + R, device="cuda", generator=g).to(torch.bfloat16)
    y = torch.randn(M, 2 * (L + R), device="cuda", generator=g).to(torch.bfloat16)
    kv_c, k_pe = y[:, :L], y[:, L + 3:L + 3 + R]                                # row-strided views, as a layer has
    slots = torch.randperm(7 * 16, device="cuda", generator=g)[:M]
    slots[M // 2] = -1                                                         # a padding row writes nothing
    want, got = cache.clone(), cache.clone()
    fm.concat_and_cache_reference(kv_c, k_pe, want, slots)
    fm.concat_and_cache_mla(kv_c, k_pe, got, slots)
    assert torch.equal(got, want)


def _case(B, lens, H=12, nope=128, v=128, R=64):
    g = torch.Generator(device="cuda").manual_seed(B)
    L, bs = fm.LATENT, fm.BLOCK_SIZE
    per = max(-(-n // bs) for n in lens)
    cache = torch.randn(B * per, bs, L + R, device="cuda", generator=g).to(torch.bfloat16)
    table = torch.randperm(B * per, device="cuda", generator=g).view(B, per).to(torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    slots = torch.stack([table[b, (n - 1) // bs].long() * bs + (n - 1) % bs for b, n in enumerate(lens)])
    q = torch.randn(B, H, nope + R, device="cuda", generator=g).to(torch.bfloat16)
    kv = torch.randn(B, L + R, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(H * (nope + v), L, device="cuda", generator=g) * L ** -0.5).to(torch.bfloat16)
    gate = torch.randn(B, H * v, device="cuda", generator=g).to(torch.bfloat16)
    return (q, kv[:, :L], kv[:, L:], cache, slots, table, seq, w), gate, dict(qk_nope_head_dim=nope, v_head_dim=v)


@needs_flashmla
@pytest.mark.parametrize("lens", [[100], [1, 1000, 4097]])
def test_flashmla_call_equals_the_reference_eager_and_replayed(lens):
    from latency_specialized.ops.attention.mla import mla_decode_reference

    (q, kv_c, k_pe, cache, slots, table, seq, w), gate, kw = _case(len(lens), lens)
    call = fm.stock_flashmla(w, q.shape[1], kw["qk_nope_head_dim"], kw["v_head_dim"])
    ref_cache, eager_cache, graph_cache = cache.clone(), cache.clone(), cache.clone()
    want = mla_decode_reference(q, kv_c, k_pe, ref_cache, slots, table, seq, w, gate=gate, **kw).float()
    eager = call(q, kv_c, k_pe, eager_cache, slots, table, seq, w, gate=gate, **kw)   # computes the metadata
    scale = want.abs().max()
    assert float((eager.float() - want).abs().max() / scale) < 2e-2
    assert torch.equal(eager_cache, ref_cache)
    out = torch.full_like(eager, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(q, kv_c, k_pe, graph_cache, slots, table, seq, w, gate=gate, out=out, **kw)
    graph_cache.copy_(cache)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(graph_cache, ref_cache)
