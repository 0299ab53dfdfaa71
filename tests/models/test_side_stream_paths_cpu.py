"""The side-stream paths of the pieces' session-51 switches, run inline on the CPU: a stand-in for
``runtime.side_stream.SideStream`` that calls the function at once and hands its result back at ``join`` lets the CPU
suite execute the code those switches take on a GPU - ``pieces.attention.sparse_mqa.COMPRESS_BESIDE_QUERY`` (the
compressor's work returned through the join) and ``pieces.attention.sparse_mla.INDEXER_BESIDE_ATTENTION`` (the
indexer's join handed to the sparse MLA op as ``before_split``) - in whole tiny cells against their references. What
the stand-in cannot show (two streams really overlapping, graph branches) is the GPU tests' part
(``tests/models/test_indexer_switches_gpu.py``)."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from latency_specialized.pieces.attention import sparse_mla as sparse_mla_piece, sparse_mqa as sparse_mqa_piece
from latency_specialized.plugins import get_registry
from latency_specialized.runtime import composed
from latency_specialized.testing.matrix import Cell


class _InlineJoin:
    def __init__(self, result: Any):
        self._result = result
        self.joined = 0

    def join(self) -> Any:
        self.joined += 1
        return self._result


class _InlineSideStream:
    """``SideStream.run`` / ``Pending.join`` without CUDA: the work runs when forked; every fork is counted."""

    def __init__(self) -> None:
        self.forks: list[tuple[str, _InlineJoin]] = []

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> _InlineJoin:
        pending = _InlineJoin(fn(*args, **kwargs))
        self.forks.append((getattr(fn, "__name__", repr(fn)), pending))   # ops are named 'op[<site>]'
        return pending

    def joined_once(self, what: str) -> int:
        """How many forks whose function's name holds ``what`` there were; each must have been joined once."""
        mine = [p for name, p in self.forks if what in name]
        assert all(p.joined == 1 for p in mine), [p.joined for p in mine]
        return len(mine)


@pytest.fixture
def side(monkeypatch):
    """Every program built in the test gets the inline side stream (the CPU makes none)."""
    stream = _InlineSideStream()
    init = composed.ComposedProgram.__init__

    def with_side(self, *a, **k):
        init(self, *a, **k)
        self.streams["side"] = stream

    monkeypatch.setattr(composed.ComposedProgram, "__init__", with_side)
    return stream


def _cell(model: str, batch: int, spec: int):
    res = get_registry().adapter(model).verify_cell(Cell(model, batch, 1, 40, spec, "cpu"), comm=None)
    assert res.steps > 0 and res.max_abs_err <= res.tolerance, (res.max_abs_err, res.tolerance)
    return res


@pytest.mark.parametrize("beside", [True, False], ids=["beside", "inline"])
@pytest.mark.parametrize("batch,spec", [(3, 0), (2, 3)], ids=["b3", "b2-s3"])
def test_deepseek_compressor_through_the_side_stream_path(monkeypatch, side, batch, spec, beside):
    monkeypatch.setattr(sparse_mqa_piece, "COMPRESS_BESIDE_QUERY", beside)
    _cell("deepseek_v41_flash", batch, spec)
    if beside:
        assert side.joined_once("_source") > 0, "the KV source layers forked their compressor"
    else:   # the switch off (on by default): nothing of the compressor forked
        assert side.joined_once("_source") == 0


@pytest.mark.parametrize("beside", [True, False], ids=["beside", "inline"])
@pytest.mark.parametrize("batch,spec", [(3, 0), (2, 3)], ids=["b3", "b2-s3"])
def test_glm_indexer_through_the_side_stream_path(monkeypatch, side, batch, spec, beside):
    monkeypatch.setattr(sparse_mla_piece, "INDEXER_BESIDE_ATTENTION", beside)
    _cell("glm53", batch, spec)
    if beside:
        assert side.joined_once("attn.indexer]") > 0, "the full layers forked their indexer, the attention joined it"
    else:
        assert side.joined_once("attn.indexer]") == 0
