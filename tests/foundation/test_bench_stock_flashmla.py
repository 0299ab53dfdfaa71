"""The stock MLA decode around FlashMLA (``bench/stock/flashmla.py``) on the CPU: the checkout it needs, the build
it asks torch for, the vLLM composition around the kernel (against ``mla_decode_reference``, with a torch model
of FlashMLA's ``dense_attn_decode_interface``), and the notes naming which kernel ran. The real FlashMLA and the
Triton cache write run in ``tests/runtime/test_stock_flashmla_gpu.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from latency_specialized.bench.stock import flashmla as fm
from latency_specialized.errors import UserError


def _checkout(root: Path, skip: str | None = None) -> Path:
    for f in (*fm.SOURCES, *fm.HEADERS):
        if f != skip:
            (root / f).parent.mkdir(parents=True, exist_ok=True)
            (root / f).write_text("// stand-in\n")
    return root


def test_source_unset_set_missing_and_complete(monkeypatch, tmp_path):
    monkeypatch.delenv(fm.SOURCE_ENV, raising=False)
    assert fm.flashmla_source() is None
    assert fm.stock_flashmla(torch.zeros(4, 512), 1, 2, 2) is None
    monkeypatch.setenv(fm.SOURCE_ENV, str(_checkout(tmp_path / "a", skip=fm.HEADERS[1])))
    with pytest.raises(UserError, match=r"LS_FLASHMLA_SRC=.*missing csrc/cutlass/include/cute/tensor.hpp.*submodule"):
        fm.flashmla_source()
    monkeypatch.setenv(fm.SOURCE_ENV, str(_checkout(tmp_path / "b")))
    assert fm.flashmla_source() == tmp_path / "b"


def test_the_build_is_flashmla_sm90a_dense_decode_behind_one_binding(monkeypatch, tmp_path):
    import torch.utils.cpp_extension as ext

    seen = {}
    monkeypatch.setattr(ext, "load", lambda **kw: seen.update(kw) or "module")
    src = _checkout(tmp_path / "src")
    assert fm.load_flashmla.__wrapped__(src, tmp_path / "build") == "module"
    binding, *units = seen["sources"]
    assert binding.endswith(".cu") and Path(binding).read_text() == fm.BINDING   # nvcc: CUDA 13's CCCL headers
    assert units == [str(src / s) for s in fm.SOURCES]
    flags = seen["extra_cuda_cflags"]
    assert flags[flags.index("-gencode") + 1] == "arch=compute_90a,code=sm_90a"   # wgmma: sm_90a, not sm_90
    assert "-DFLASH_MLA_DISABLE_FP16" in flags and "-std=c++20" in flags
    assert str(src / "csrc/cutlass/include") in seen["extra_include_paths"]
    assert seen["build_directory"] == str(tmp_path / "build")


class TorchFlashMLA:
    """FlashMLA's ``dense_attn_decode_interface`` in torch (fp32): q [B, 1, H, D], kcache [blocks, 64, 1, D],
    values = the first ``dv`` columns of each key row; returns (out [B, 1, H, dv], lse [B, H, 1], sched, splits).
    Records the metadata each call got."""

    def __init__(self):
        self.metas = []

    def dense_decode_fwd(self, q, kcache, dv, seqlens, block_table, scale, causal, sched, splits):
        assert q.shape[1] == 1 and kcache.shape[1] == fm.BLOCK_SIZE and kcache.shape[2] == 1 and not causal
        self.metas.append((sched, splits))
        B, _, H, D = q.shape
        out = torch.empty(B, 1, H, dv, dtype=q.dtype)
        for b in range(B):
            pos = torch.arange(int(seqlens[b]))
            rows = kcache[block_table[b, pos // fm.BLOCK_SIZE].long(), pos % fm.BLOCK_SIZE, 0].float()  # [n, D]
            p = torch.softmax(q[b, 0].float() @ rows.t() * scale, dim=-1)
            out[b, 0] = (p @ rows[:, :dv]).to(q.dtype)
        return out, torch.zeros(B, H, 1), torch.ones(3, dtype=torch.int32), torch.ones(B + 1, dtype=torch.int32)


def _mla_case(B, lens, H=4, nope=32, R=64, v=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    L, bs = fm.LATENT, fm.BLOCK_SIZE
    per = max(-(-n // bs) for n in lens) + 1
    cache = torch.randn(B * per + 2, bs, L + R, generator=g)
    table = torch.randperm(B * per + 2, generator=g)[:B * per].view(B, per).to(torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    slots = torch.stack([table[b, (n - 1) // bs].long() * bs + (n - 1) % bs for b, n in enumerate(lens)])
    q = torch.randn(B, H, nope + R, generator=g)
    kv = torch.randn(B, L + R, generator=g)
    w = torch.randn(H * (nope + v), L, generator=g) * L ** -0.5
    gate = torch.randn(B, H * v, generator=g)
    return (q, kv[:, :L], kv[:, L:], cache, slots, table, seq, w), gate, dict(qk_nope_head_dim=nope, v_head_dim=v)


@pytest.mark.parametrize("with_gate", [False, True])
def test_stock_call_equals_the_reference(with_gate):
    from latency_specialized.ops.attention.mla import mla_decode_reference

    (q, kv_c, k_pe, cache, slots, table, seq, w), gate, kw = _mla_case(3, [1, 70, 130])
    gate = gate if with_gate else None
    module = TorchFlashMLA()
    call = fm.StockFlashMLA(w, q.shape[1], kw["qk_nope_head_dim"], kw["v_head_dim"], module=module,
                            cache_writer=fm.concat_and_cache_reference)
    ref_cache, ours_cache = cache.clone(), cache.clone()
    want = mla_decode_reference(q, kv_c, k_pe, ref_cache, slots, table, seq, w, gate=gate, **kw)
    out = torch.full_like(want, float("nan"))                                   # poisoned: every element written
    got = call(q, kv_c, k_pe, ours_cache, slots, table, seq, w, gate=gate, out=out, **kw)
    assert got is out
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(ours_cache, ref_cache)                                  # the new rows, nothing else
    again = call(q, kv_c, k_pe, ours_cache, slots, table, seq, w, gate=gate, **kw)
    torch.testing.assert_close(again, want, rtol=1e-4, atol=1e-5)
    assert module.metas[0] == (None, None) and module.metas[1][0] is not None  # metadata once, then reused


def test_stock_call_rejects_what_flashmla_cannot_run():
    with pytest.raises(UserError, match="latent of 512 only.*LS_FLASHMLA_SRC"):
        fm.StockFlashMLA(torch.zeros(4 * 64, 256), 4, 32, 32, module=TorchFlashMLA())
    (q, kv_c, k_pe, cache, slots, table, seq, w), _, kw = _mla_case(1, [10])
    call = fm.StockFlashMLA(w, q.shape[1], kw["qk_nope_head_dim"], kw["v_head_dim"], module=TorchFlashMLA(),
                            cache_writer=fm.concat_and_cache_reference)
    with pytest.raises(UserError, match="blocks of 64"):
        call(q, kv_c, k_pe, cache.view(-1, 32, cache.shape[-1]), slots, table, seq, w, **kw)
    with pytest.raises(ValueError, match="another layer"):
        call(q, kv_c, k_pe, cache, slots, table, seq, w.clone(), **kw)


def test_cache_reference_skips_padding_rows():
    cache = torch.zeros(2, fm.BLOCK_SIZE, 6)
    fm.concat_and_cache_reference(torch.ones(2, 4), torch.full((2, 2), 2.0), cache, torch.tensor([5, -1]))
    flat = cache.view(-1, 6)
    assert flat[5].tolist() == [1, 1, 1, 1, 2, 2] and int((flat != 0).sum()) == 6


def test_the_notes_name_the_kernel_that_ran(monkeypatch):
    from latency_specialized.bench.stock.compositions import composition

    monkeypatch.delenv(fm.SOURCE_ENV, raising=False)
    notes = composition("mla_moe").notes(None, "mla", None, 8)
    assert notes == [fm.mla_note()] and "standing in for stock's FlashMLA" in notes[0] and fm.SOURCE_ENV in notes[0]
    monkeypatch.setenv(fm.SOURCE_ENV, "/src/FlashMLA")
    notes = composition("mla_moe").notes(None, "mla", None, 8)
    assert notes[0].startswith("MLA layers: stock runs FlashMLA (built from /src/FlashMLA")
