"""The indexer's and its neighbours' switches (sessions 49 and 51; four of session 51's on since session 53) through
whole programs on the GPU: DeepSeek-V4.1-Flash and GLM-5.3 tiny cells with each switch on and, where it is on by
default, off equal their references as the matrix's cells do.

``sparse_mqa_triton.COMPRESS_INDEX_KEY`` (DeepSeek's key owners: the compressor writes the indexer's key, the key gemm
and the key launch skipped), ``indexer_triton.SCORE_WRITES_KEY`` (the scoring program holding the new position writes
the key: GLM-5.3's index layers; verification rows keep the key launch) and ``indexer_triton.SCORE_SELECTS`` (the
row's last scoring program selects it). The kernels' own GPU tests check each against its op reference; these check
the pieces' wiring with them on - which sites the plan skips, the ``k=None`` and ``cross_row_reads`` arguments -
plain steps at batch 1 and 8 and a verification step (1 + 3 rows a request, rows reading each other's new keys).
Run on the H200: ``pytest -m gpu tests/models/test_indexer_switches_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.kernels import indexer_triton, sparse_mqa_triton
from latency_specialized.pieces.attention import sparse_mla as sparse_mla_piece, sparse_mqa as sparse_mqa_piece
from latency_specialized.plugins import get_registry
from latency_specialized.testing.matrix import Cell

pytestmark = pytest.mark.gpu


def _cell_matches_reference(model: str, batch: int, spec: int):
    """A tiny cell of ``model`` (TP 1, context 40), graph-captured as the matrix's: every step on the fast path and
    within the adapter's tolerance of the reference; its result (``impls``: site -> implementation)."""
    res = get_registry().adapter(model).verify_cell(Cell(model, batch, 1, 40, spec, "cuda"), comm=None)
    assert res.steps > 0 and res.fast_steps == res.steps and res.stock_steps == 0
    assert res.max_abs_err <= res.tolerance, f"max |program - reference| = {res.max_abs_err} > {res.tolerance}"
    assert res.top1_agreement >= 0.99
    return res


@pytest.mark.parametrize("model", ["deepseek_v41_flash", "glm53"])
@pytest.mark.parametrize("batch,spec", [(1, 0), (8, 0), (4, 3)], ids=["b1", "b8", "b4-s3"])
def test_cells_with_the_indexer_switches_on(monkeypatch, model, batch, spec):
    monkeypatch.setattr(sparse_mqa_triton, "COMPRESS_INDEX_KEY", True)
    monkeypatch.setattr(indexer_triton, "SCORE_WRITES_KEY", True)
    monkeypatch.setattr(indexer_triton, "SCORE_SELECTS", True)
    res = _cell_matches_reference(model, batch, spec)
    if model == "deepseek_v41_flash":   # the fused compressor served the key owners
        assert any(impl == sparse_mqa_triton.COMPRESS_INDEX_NAME for impl in res.impls.values()), res.impls


@pytest.mark.parametrize("model", ["deepseek_v41_flash", "glm53"])
@pytest.mark.parametrize("batch,spec", [(1, 0), (8, 0), (4, 3)], ids=["b1", "b8", "b4-s3"])
@pytest.mark.parametrize("first_byte", [True, False], ids=["first_byte", "all_passes"])
def test_cells_with_the_select_from_leading_bytes(monkeypatch, model, batch, spec, first_byte):
    """``indexer_triton.SELECT_FIRST_BYTE`` and ``SELECT_PACKED_SCAN`` (session 51, on since session 53): the score
    kernel counts the leading key bytes, the select starts from them and resets them - every index layer's call of
    every step in turn on the one buffer - and ranks with one prefix sum. Both set, as the matrix runs them, and both
    cleared (the A/B's other side, which the matrix no longer runs)."""
    monkeypatch.setattr(indexer_triton, "SELECT_FIRST_BYTE", first_byte)
    monkeypatch.setattr(indexer_triton, "SELECT_PACKED_SCAN", first_byte)
    res = _cell_matches_reference(model, batch, spec)
    assert any(impl == indexer_triton.NAME for impl in res.impls.values()), res.impls
    assert not indexer_triton.first_byte_counts(torch.device("cuda")).any()


@pytest.mark.parametrize("model", ["deepseek_v41_flash", "glm53"])
@pytest.mark.parametrize("batch,spec", [(1, 0), (8, 0), (4, 3)], ids=["b1", "b8", "b4-s3"])
def test_cells_with_the_wide_rows_looped(monkeypatch, model, batch, spec):
    """``indexer_triton.SELECT_WIDE_LOOPS`` (session 54, off): rows past the half-width path loop over tiles. The
    half-width path starts at 2,048-wide tiles, the loops at 8,192, beyond these cells' tables: both lowered to 16 here,
    so that the rows past half of these cells' small tables loop (over 16-wide tiles at the least) and the shorter
    ones, DeepSeek's compressed rows among them, take the half path."""
    monkeypatch.setattr(indexer_triton, "SELECT_WIDE_LOOPS", True)
    monkeypatch.setattr(indexer_triton, "SELECT_NARROW_MIN_TILE", 16)
    monkeypatch.setattr(indexer_triton, "SELECT_WIDE_LOOPS_MIN_TILE", 16)
    res = _cell_matches_reference(model, batch, spec)
    assert any(impl == indexer_triton.NAME for impl in res.impls.values()), res.impls


@pytest.mark.parametrize("batch,spec", [(1, 0), (8, 0), (4, 3)], ids=["b1", "b8", "b4-s3"])
@pytest.mark.parametrize("beside", [True, False], ids=["beside", "inline"])
def test_glm_cells_with_the_indexer_beside_the_attention(monkeypatch, batch, spec, beside):
    """``pieces.attention.sparse_mla.INDEXER_BESIDE_ATTENTION`` (session 51, on since session 53): GLM-5.3's full
    layers run the indexer on the side stream and the sparse MLA joins it before its split kernel - plain and
    verification steps, graph-captured as the matrix's cells are, equal their references; and with it off (inline)."""
    monkeypatch.setattr(sparse_mla_piece, "INDEXER_BESIDE_ATTENTION", beside)
    _cell_matches_reference("glm53", batch, spec)


@pytest.mark.parametrize("key_fused", [False, True], ids=["key_gemm", "key_in_compressor"])
@pytest.mark.parametrize("batch,spec", [(1, 0), (8, 0), (4, 3)], ids=["b1", "b8", "b4-s3"])
@pytest.mark.parametrize("beside", [True, False], ids=["beside", "inline"])
def test_deepseek_cells_with_the_compressor_beside_the_query(monkeypatch, key_fused, batch, spec, beside):
    """``pieces.attention.sparse_mqa.COMPRESS_BESIDE_QUERY`` (session 51, on since session 53): DeepSeek-V4.1-Flash's
    KV source layers run their compressed slots, compressor and the indexer's key gemm (or the compressor writing the
    key, ``COMPRESS_INDEX_KEY``) on the side stream beside the q norm and q_b gemm - plain and verification steps,
    graph-captured, equal their references; and with it off (inline)."""
    monkeypatch.setattr(sparse_mqa_piece, "COMPRESS_BESIDE_QUERY", beside)
    monkeypatch.setattr(sparse_mqa_triton, "COMPRESS_INDEX_KEY", key_fused)
    _cell_matches_reference("deepseek_v41_flash", batch, spec)
