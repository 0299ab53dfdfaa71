"""The block-FP8 op bench's table (CPU: rows as the H200 run writes them): the main comparison per case, and the
norm-prologue section for the gemms behind a norm site (what decides ``gemm_fp8_triton.NORM_MAX_M``)."""

from __future__ import annotations

from latency_specialized.bench.ops_bench_fp8 import NORM_SHAPES, SHAPES, to_markdown
from latency_specialized.bench.ops_bench_moe_kda import Row


def test_table_has_the_norm_prologue_section_for_gemms_behind_a_norm():
    assert set(NORM_SHAPES) <= set(SHAPES)
    case = "glm53-tp8 q_b+wq_b N=6144 K=2048 fp8-block-128 M=1 (9 copies)"
    nb = 6144 * 2048 + 8
    rows = [Row("gemm", case, "w8a16[default]", [6.0, 6.2], 1, nb), Row("gemm", case, "w8a8[default]", [5.5, 5.6], 1, nb),
            Row("gemm", case, "bf16-cublas", [9.0, 9.1], 1, 2 * nb),
            Row("gemm", case, "peer-humming", [], 1, nb, notes="humming unavailable: ImportError"),
            Row("gemm", case, "w8a16+norm[prologue]", [6.4, 6.5], 1, nb),
            Row("gemm", case, "norm+w8a16[separate]", [8.1, 8.0], 1, nb, extra={"norm": "norm.cutedsl"})]
    md = to_markdown(rows, "NVIDIA H200")
    main = next(line for line in md.splitlines() if line.startswith(f"| {case} | ") and "6.00" in line)
    assert "5.50 (5.50)" in main and "humming unavailable" in main
    assert "| " + case + " | 6.40 | 8.00 |" in md


def test_humming_peer_scale_layouts():
    """The humming peer's scales (no humming needed): GLM-5.3's 128 x 128 fp32 blocks as humming blocks; DeepSeek-V4.1's
    32 x 32 ue8m0 blocks repeated over their rows into MXFP8's one scale per 32 values of a row (as vLLM loads them);
    anything else refused with what it takes."""
    import pytest
    import torch

    from latency_specialized.bench.peers.humming_fp8 import _scale_config
    from latency_specialized.errors import UserError

    cfg, s = _scale_config(300, 256, torch.ones(3, 2))
    assert cfg["weight_scale_type"] == "block" and cfg["weight_scale_group_size_n"] == 128 and s.shape == (3, 2)
    blocks = torch.tensor([[120, 121], [122, 123]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    cfg, s = _scale_config(40, 64, blocks)
    assert cfg == {"weight_scale_type": "group", "group_size": 32, "scale_dtype": "float8e8m0"}
    rows = s.view(torch.uint8)
    assert s.dtype == torch.float8_e8m0fnu and rows.shape == (40, 2)
    assert rows[:32].eq(torch.tensor([120, 121], dtype=torch.uint8)).all() and rows[32:].eq(
        torch.tensor([122, 123], dtype=torch.uint8)).all()
    with pytest.raises(UserError, match="32 x 32"):
        _scale_config(40, 64, blocks[:1])
    with pytest.raises(UserError, match="fp32"):
        _scale_config(40, 64, torch.ones(2, 2, dtype=torch.float16))
