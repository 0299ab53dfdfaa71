"""The paired-nibble layout (``quant.codecs.pair_codes``, ``quant.layout.paired_nibbles``): e2m1 codes rearranged
within each 32-bit word for the mma kernels' decode. A bijection on every word; the same values through
``dequantize``; the derived ``<fmt>/pairs`` formats refused by every kernel that reads the checkpoint packing only
and served by the 4-bit experts (mma and Triton); cuts and stacks keep it."""

from __future__ import annotations

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.quant import codecs as qc
from latency_specialized.quant import layout
from latency_specialized.quant.checkpoint_io import quantize_weight


def _word_bytes(word: int) -> torch.Tensor:
    return torch.tensor([[(word >> (8 * i)) & 0xFF for i in range(4)]], dtype=torch.uint8)


def _word(b: torch.Tensor) -> int:
    return sum(int(b[0, i]) << (8 * i) for i in range(4))


def test_every_code_lands_in_its_slot():
    """Value j of each half (nibble j, low nibble first) -> its ``PAIRED_SLOTS`` bits (sign, e1, e0, m), by hand:
    a word holding one code at one position at a time."""
    for h in (0, 1):
        for j, slots in enumerate(qc.PAIRED_SLOTS):
            for code in range(16):
                got = _word(qc.pair_codes(_word_bytes(code << (16 * h + 4 * j))))
                want = sum(((code >> bit) & 1) << (16 * h + pos) for bit, pos in zip((3, 2, 1, 0), slots))
                assert got == want, (h, j, code)
    assert sorted(p for s in qc.PAIRED_SLOTS for p in s) == list(range(16))   # the four slots fill a half


def test_a_bijection_on_random_bytes_and_dtypes(gen):
    b = torch.randint(0, 256, (3, 5, 64), generator=gen, dtype=torch.uint8)
    p = qc.pair_codes(b)
    assert p.shape == b.shape and p.dtype == b.dtype and not torch.equal(p, b)
    assert torch.equal(qc.unpair_codes(p), b)
    for dt in (torch.int8, torch.float4_e2m1fn_x2):
        assert p.view(torch.uint8).equal(qc.pair_codes(b.view(dt)).view(torch.uint8))
    with pytest.raises(UserError, match="multiple of 4 bytes"):
        qc.pair_codes(torch.zeros(2, 6, dtype=torch.uint8))


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp4-deepseek", "nvfp4"])
def test_same_values_and_layout_ops(gen, fmt):
    w = quantize_weight("experts.w13", torch.randn(3, 32, 128, generator=gen), fmt)
    p = layout.paired_nibbles(w)
    assert p.fmt.name == f"{fmt}/pairs" and p.fmt.packing == "paired" and p.scale is w.scale
    assert torch.equal(p.dequantize(), w.dequantize())
    # cuts along K on scale blocks, expert slices and stacks move whole words: still the same values
    assert torch.equal(layout.narrow(p, 2, 32, 64).dequantize(), w.dequantize()[..., 32:96])
    assert torch.equal(layout.narrow(p, 0, 1, 2).dequantize(), w.dequantize()[1:3])
    one = layout.paired_nibbles(quantize_weight("experts.0.w1", torch.randn(32, 128, generator=gen), fmt))
    two = layout.stack([one, one], "experts.w1")
    assert two.fmt.name == p.fmt.name and torch.equal(two.dequantize()[1], one.dequantize())
    with pytest.raises(UserError, match="not that"):
        layout.paired_nibbles(p)


def test_refused_where_not_an_e2m1_checkpoint_packing(gen):
    w = quantize_weight("w", torch.randn(128, 128, generator=gen), "fp8-block-128")
    with pytest.raises(UserError, match="not that"):
        layout.paired_nibbles(w)


def test_kernels_of_the_checkpoint_packing_refuse_it_and_the_experts_serve_it(gen):
    """By name: the MXFP4 mma gemm's weight check refuses ``/pairs`` unless told; the 4-bit experts' formats, mma and
    Triton, list it (every bucket of a paired site has a kernel that reads those bits, or the reference)."""
    from latency_specialized.kernels import gemm_q4_mma, moe_experts_mma, moe_experts_q4_triton

    p = layout.paired_nibbles(quantize_weight("w", torch.randn(3, 32, 128, generator=gen), "mxfp4"))
    with pytest.raises(UserError, match="mxfp4/pairs"):
        gemm_q4_mma.mxfp4_parts(p, stacked=True)
    q, _ = gemm_q4_mma.mxfp4_parts(p, stacked=True, paired=True)
    assert torch.equal(q, p.weight)
    assert {"mxfp4/pairs", "mxfp4-deepseek/pairs", "nvfp4/pairs"} <= set(moe_experts_q4_triton.FORMATS)
    assert {"mxfp4/pairs", "mxfp4-deepseek/pairs", "nvfp4/pairs"} <= set(moe_experts_mma.FORMATS_Q4)
    *_, fields = moe_experts_mma.expert_parts(p, "test")
    assert fields == dict(weights="mxfp4", paired=True)


def test_derived_paired_format_names_resolve_and_the_switch_pairs_e2m1_experts_only(gen, monkeypatch):
    """``QuantFormat.get('<e2m1 fmt>/pairs')`` is the paired derived format (bytes per value unchanged), refused for
    FP8; ``latent_moe.arrange_experts`` pairs e2m1 experts under ``PAIR_EXPERT_CODES`` only, and
    ``checkpoint_nibbles`` undoes it bit for bit."""
    from latency_specialized.ops.sites import stored_bytes_per_value
    from latency_specialized.pieces.ffn import latent_moe
    from latency_specialized.quant.formats import QuantFormat

    f = QuantFormat.get("nvfp4/pairs")
    assert f.packing == "paired" and f.name == "nvfp4/pairs" and f.block == QuantFormat.get("nvfp4").block
    assert stored_bytes_per_value("mxfp4/pairs") == stored_bytes_per_value("mxfp4")
    with pytest.raises(UserError, match="not e2m1"):
        QuantFormat.get("fp8-block-128/pairs")
    w13 = quantize_weight("w13", torch.randn(3, 64, 128, generator=gen), "mxfp4-deepseek")
    w2 = quantize_weight("w2", torch.randn(3, 128, 32, generator=gen), "mxfp4-deepseek")
    monkeypatch.setattr(latent_moe, "PAIR_EXPERT_CODES", False)
    assert latent_moe.arrange_experts(w13, w2) == {"w13": w13, "w2": w2}
    fp8 = quantize_weight("w", torch.randn(2, 128, 128, generator=gen), "fp8-block-128")
    monkeypatch.setattr(latent_moe, "PAIR_EXPERT_CODES", True)
    assert latent_moe.arrange_experts(fp8, fp8)["w13"] is fp8
    # a derived FP8 form (one scale per row: GLM-5.3's tiny experts, joined along N) passes through as well
    rows = layout.row_scaled(fp8)
    assert rows.fmt.name == "fp8-block-128/rows" and latent_moe.arrange_experts(rows, rows)["w2"] is rows
    got = latent_moe.arrange_experts(w13, w2)
    assert got["w13"].fmt.name == "mxfp4-deepseek/pairs" and got["w2"].fmt.packing == "paired"
    back = layout.checkpoint_nibbles(got["w13"])
    assert back.fmt == w13.fmt and torch.equal(back.weight.view(torch.uint8), w13.weight.view(torch.uint8))
