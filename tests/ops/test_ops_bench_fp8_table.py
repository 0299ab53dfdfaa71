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
