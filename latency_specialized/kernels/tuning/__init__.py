"""Measured dispatch tables: which gemm implementation wins per (N, K, M bucket) on the H200.

``h200_gemm.json`` is written by ``latency-specialized bench-ops --ops gemm --write-table DIR``
on the H200 (CUDA-graph replays, weights rotated beyond L2, each variant timed twice; see
bench/ops_bench.py) and committed. Every gemm implementation's ``supports()`` reads it, so the
plan picks the measured winner and names why the others were refused, e.g.
``cuBLAS faster at N=7168,K=1536,M=32 (9.8 us vs 11.2 us)``. A kernel only wins a cell when it
beats cuBLAS by more than the table's ``margin`` (run-to-run noise): cuBLAS is kept otherwise.

``bench-ops ... --merge-table`` adds cells to it; each merge is listed under ``merged`` with the environment it was
measured in. Cells no H200 run has measured may come from another sm_90 card (session 40's 20 DeepSeek-V4.1-Flash
cells, the shared expert's and the indexer's small gemms, are an H100's: ``merged[-1]``); an H200 run of the same
cells replaces them.

Table layout::

    {"device": ..., "arch": "sm_90", "margin": 0.03, "m_buckets": [1, 2, 4, ...],
     "entries": {"N,K,M": {"winner": impl, "times_us": {impl: us}, "configs": {impl: {...}},
                           "notes": {impl: "why it has no time"}}}}
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from latency_specialized.contract import OpContext, Support

M_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
"""Token counts the table is measured at; a call with M tokens uses the smallest bucket >= M."""

GEMM_TABLE = Path(__file__).with_name("h200_gemm.json")

NORM_SITE_CREDIT_US = 0.0
"""At a gemm site behind a norm site (attr ``norm_site``), how many microseconds an implementation with a norm
prologue (``NORM_PROLOGUE_IMPLS``) may lose to the table's winner and still serve the site: its prologue removes the
norm kernel, one launch. 0: the measured winner as it is. Off until a layer A/B on a GPU (the cells it would move and
what they measured: ``models/deepseek_v41_flash/NOTES.md``, session 41)."""
NORM_PROLOGUE_IMPLS = frozenset({"gemm.cutedsl_gemv"})
"""The table's implementations registered with ``norm_prologue`` (a test checks this against the registry)."""

SHORT_NAMES = {
    "gemm.cublas": "cuBLAS",
    "gemm.cutedsl_gemv": "GEMV kernel",
    "gemm.cutedsl_small_m": "small-M kernel",
    "gemm.cutedsl_splitk": "split-K kernel",
}


@functools.cache
def load_table(path: str | None = None) -> dict[str, Any] | None:
    """The committed gemm table (None when it does not exist yet); $LS_GEMM_TABLE overrides the path."""
    p = Path(path) if path else Path(os.environ.get("LS_GEMM_TABLE") or GEMM_TABLE)
    if not p.exists():
        return None
    return json.loads(p.read_text())


def m_bucket(m: int) -> int | None:
    """Smallest measured bucket holding ``m`` tokens; None beyond the largest."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return None


def table_key(n: int, k: int, m: int) -> str:
    return f"{n},{k},{m}"


def entry(n: int, k: int, m: int, table: dict[str, Any] | None = None) -> dict[str, Any] | None:
    table = table if table is not None else load_table()
    b = m_bucket(m)
    if table is None or b is None:
        return None
    return table.get("entries", {}).get(table_key(n, k, b))


def config_for(name: str, n: int, k: int, m: int, cls: type) -> Any | None:
    """The measured config of ``name`` at (N, K, bucket(M)) as ``cls``, or None."""
    e = entry(n, k, m)
    if e is None or name not in e.get("configs", {}):
        return None
    return cls(**e["configs"][name])


def table_winner(e: dict[str, Any], ctx: OpContext) -> str:
    """The implementation a table entry gives this site: the measured winner, or - behind a norm site, with a
    ``NORM_SITE_CREDIT_US`` credit - the fastest implementation with a norm prologue within the credit of it."""
    winner = e["winner"]
    times = e.get("times_us", {})
    if NORM_SITE_CREDIT_US > 0 and ctx.attr("norm_site") and winner not in NORM_PROLOGUE_IMPLS:
        fused = sorted((times[n], n) for n in NORM_PROLOGUE_IMPLS if n in times and n in e.get("configs", {}))
        if fused and fused[0][0] <= times[winner] + NORM_SITE_CREDIT_US:
            return fused[0][1]
    return winner


def gemm_supports(name: str, ctx: OpContext, *, fp32_out: bool = False) -> Support:
    """supports() shared by the gemm kernels: arch, dtype, output dtype (``fp32_out``: the kernel can
    store fp32), DSL, then the measured winner (bf16-output timings: same reads, same work)."""
    from latency_specialized.kernels.compile_cache import cute_available

    if ctx.attr("weight_format"):
        return f"weights {ctx.attr('weight_format')}: bf16 weights only (the block-FP8 gemms serve these)"
    if not ctx.arch.startswith("sm_90"):
        return f"kernels are tuned on the H200 only: no measured table for {ctx.arch}"
    if ctx.dtype != "bfloat16":
        return f"bf16 kernels (dtype={ctx.dtype})"
    if ctx.attr("out_dtype") not in (None, ctx.dtype) and not (fp32_out and ctx.attr("out_dtype") == "float32"):
        return (f"writes {ctx.dtype} only; {ctx.attr('out_dtype')} output (router logits) is cuBLAS's "
                "out_dtype epilogue")
    ok = cute_available()
    if ok is not True:
        return ok
    n, k, m = ctx.dim("N"), ctx.dim("K"), ctx.tokens
    where = f"N={n},K={k},M={m}"
    if m_bucket(m) is None:
        return f"not measured beyond M={M_BUCKETS[-1]} ({where})"
    e = entry(n, k, m)
    if e is None:
        return (f"no H200 measurement for {where} in tuning/{GEMM_TABLE.name}: run "
                f"`latency-specialized bench-ops --ops gemm --write-table` on the H200")
    winner = table_winner(e, ctx)
    if winner == name:
        return True
    times = e.get("times_us", {})
    if name not in times:
        note = e.get("notes", {}).get(name, "not measured")
        return f"{note} ({where})"
    if winner != e["winner"]:
        return (f"{SHORT_NAMES.get(winner, winner)} normalises its input itself (the norm site's kernel saved) within "
                f"{NORM_SITE_CREDIT_US} us of it at {where} ({times[winner]:.1f} us vs {times[name]:.1f} us)")
    return (f"{SHORT_NAMES.get(winner, winner)} faster at {where} "
            f"({times[winner]:.1f} us vs {times[name]:.1f} us)")
