"""DeepSeek-V4.1-Flash's composed program outside the matrix (program == reference is the matrix's
``deepseek_v41_flash-*`` cells): `explain` and `generate` smokes, a tiny checkpoint made and read back, the
program's refusals (Engram, YaRN, unsupported KV-source wiring) and the layer kinds of the full model."""

from __future__ import annotations

import re

import pytest
import torch

from latency_specialized.cli import main
from latency_specialized.errors import UserError
from latency_specialized.plugins import get_registry

from latency_specialized_models.deepseek_v41_flash import names as N
from latency_specialized_models.deepseek_v41_flash.composed import composed_model
from latency_specialized_models.deepseek_v41_flash.spec import full_spec, tiny_spec


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _ids(out: str) -> list[str]:
    return re.findall(r"^\[\d+\] ids: (.*)$", out, flags=re.M)


def test_explain_full_model_at_tp8(capsys):
    rc, out, _ = _run(capsys, "explain", "--model", "deepseek_v41_flash", "--tp", "8", "--batch", "4",
                      "--arch", "sm_90")
    assert rc == 0 and out.startswith("plan: deepseek_v41_flash (full) on sm_90")
    assert "sparse_mqa.c1.idx+moe/attn.indexer" in out and "unserved: 0" in out


def test_generate_tiny_batch_with_padding(capsys):
    rc, out, err = _run(capsys, "generate", "--model", "deepseek_v41_flash", "--size", "tiny", "--batch", "3",
                        "--max-tokens", "4", "--prompt-ids", "5,17,300,42,9,11,250,3,77,1,2", "--dtype", "float32")
    assert rc == 0, err
    assert "bucket 4" in out and "program: 3 steps" in out
    ids = _ids(out)
    assert len(ids) == 3 and ids[0] == ids[1] == ids[2]      # one prompt, greedy: every sequence alike


def test_checkpoint_made_and_read_back(tmp_path, capsys):
    d = tmp_path / "tiny"
    rc, out, err = _run(capsys, "make-checkpoint", "deepseek_v41_flash", str(d), "--seed", "0")
    assert rc == 0, err
    spec, named, _ = N.load(d, torch.float32)
    assert spec.model_copy(update={"variant": "tiny"}) == tiny_spec()
    want = N.random_weights(spec, 0, torch.float32)
    assert set(named) == set(want)
    for n in ("layers.2.attn.wq_b.weight", "layers.3.ffn.experts.5.w2.weight", "layers.0.attn.attn_sink"):
        err_max = (named[n] - want[n]).abs().max() / want[n].abs().max()
        assert err_max < (0.3 if "experts" in n else 0.07 if "wq_b" in n else 1e-6), n   # FP4 / FP8 / plain
    rc, out, err = _run(capsys, "generate", "--model", "deepseek_v41_flash", "--checkpoint", str(d), "--prompt-ids",
                        "1,2,3,4,5", "--max-tokens", "3", "--dtype", "float32")
    assert rc == 0, err
    assert len(_ids(out)) == 1


def test_program_refuses_what_the_pieces_do_not_model():
    a = get_registry().adapter("deepseek_v41_flash")
    with pytest.raises(UserError, match="Engram lookups .* use a spec without Engram layers"):
        a.program(full_spec(), plans=None, cache=None)
    yarn = tiny_spec().model_copy(update={"rope": tiny_spec().rope.model_copy(update={"yarn_factor": 4.0})})
    with pytest.raises(UserError, match="YaRN .* use 1"):
        a.program(yarn, plans=None, cache=None)
    with pytest.raises(UserError, match="YaRN"):
        a.reference(yarn)
    # layer 7 a KV source without an indexer: layer 7 would read its rows with layer 6's selection
    bad = tiny_spec().model_copy(update={"kv_source_layers": (2, 4, 6, 7)})
    with pytest.raises(UserError, match="layer 7 .* fix kv_source_layers"):
        composed_model(bad)


def test_full_model_layer_kinds():
    kinds = {k: tuple(lp.index for lp in v) for k, v in composed_model(full_spec()).kinds.items()}
    assert kinds["sparse_mqa.window+moe"] == (0, 1)
    assert kinds["sparse_mqa.c2.src.idx+moe"] == (2, 8, 14) and kinds["sparse_mqa.c1.src.idx+moe"] == (20,)
    assert kinds["sparse_mqa.c1.idx+moe"] == (24, 28, 32, 36)
    assert len(kinds["sparse_mqa.c2+moe"]) == 15 and len(kinds["sparse_mqa.c1+moe"]) == 15


def test_compressed_slots_are_made_once_per_step_and_ratio(monkeypatch):
    """The compressed-cache slots of a step (``pieces.attention.sparse_mqa.compressed_slots``, ~20 small
    kernels) depend only on the step's lengths, the ratio and the cache's block size: the first KV-source layer
    of a ratio makes them (``StepContext.once``), the others reuse them - the program still equals the
    reference (the matrix cell's own check)."""
    from latency_specialized.pieces.attention import sparse_mqa
    from latency_specialized.testing.matrix import Cell

    made: list[tuple[int, int]] = []
    real = sparse_mqa.compressed_slots

    def counted(meta, ratio, block_size):
        made.append((ratio, block_size))
        return real(meta, ratio, block_size)

    monkeypatch.setattr(sparse_mqa, "compressed_slots", counted)
    adapter = get_registry().adapter("deepseek_v41_flash")
    model = composed_model(tiny_spec())
    sources = [lp.attention.spec.compress_ratio for lp in model.layers
               if getattr(lp.attention, "kv_source", False) and lp.attention.spec.compress_ratio]
    ratios = set(sources)
    assert len(sources) > len(ratios), "the tiny model needs two source layers of one ratio to show the reuse"
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = adapter.verify_cell(Cell("deepseek_v41_flash", 2, 1, 40, 0, "cpu"), comm=None)
    finally:
        torch.set_num_threads(before)
    assert res.max_abs_err <= res.tolerance and res.fast_steps == res.steps > 0
    assert sorted(set(r for r, _ in made)) == sorted(ratios)
    # once per step and key, never once per source layer
    assert len(made) == res.steps * len(set(made)) < res.steps * len(sources)


def test_indexer_gets_the_table_cut_to_its_compressed_rows(monkeypatch):
    """``sparse_mqa.compressed_table``: the indexer of a compressed layer gets the first ``ceil(W / ratio)`` block
    columns (every compressed row a W-block table can hold lives there: row j at the slot of position j); with the
    switch on the program still equals the reference, off (the default) the indexer gets the whole table."""
    from latency_specialized.pieces.attention import sparse_mqa
    from latency_specialized.runtime.pieces_api import StepContext
    from latency_specialized.testing.matrix import Cell

    for width, ratio in ((65, 2), (64, 2), (7, 3), (5, 128), (4, 1)):
        bt = torch.arange(2 * width).view(2, width)
        cut = sparse_mqa.compressed_table(bt, ratio)
        assert cut.shape == (2, -(-width // ratio)) and torch.equal(cut, bt[:, :cut.shape[1]])
        for block in (1, 16, 64):   # the last row a width * block table can hold, in block index terms
            assert (width * block // ratio - 1) // block < cut.shape[1]

    widths: list[tuple[int, int]] = []     # (the step's table width, the width the indexer got)
    real_op = StepContext.op

    def op(self, role):
        fn = real_op(self, role)
        if role != "attn.indexer":
            return fn

        def indexer(*args, **kw):
            widths.append((self.meta["block_table"].shape[1], args[5].shape[1]))
            return fn(*args, **kw)
        return indexer

    monkeypatch.setattr(StepContext, "op", op)
    monkeypatch.setattr(sparse_mqa, "INDEX_COMPRESSED_TABLE", True)
    adapter = get_registry().adapter("deepseek_v41_flash")
    res = adapter.verify_cell(Cell("deepseek_v41_flash", 2, 1, 40, 0, "cpu"), comm=None)
    assert res.max_abs_err <= res.tolerance and res.fast_steps == res.steps > 0
    # ratio-1 index layers (full-length compressed KV) keep the whole table; the ratio-2 ones get about half
    ratios = {lp.attention.spec.compress_ratio for lp in composed_model(tiny_spec()).layers
              if getattr(lp.attention.spec, "indexer", None) is not None}
    assert 2 in ratios and widths
    assert {got for _, got in widths} == {-(-w // r) for w, _ in widths for r in ratios}
    widths.clear()
    monkeypatch.setattr(sparse_mqa, "INDEX_COMPRESSED_TABLE", False)   # the default: the whole table
    assert adapter.verify_cell(Cell("deepseek_v41_flash", 2, 1, 40, 0, "cpu"), comm=None).fast_steps > 0
    assert widths and all(got == w for w, got in widths)


def test_compressor_writes_the_index_key_where_a_kernel_serves_it(monkeypatch):
    """``attn.compressor_index`` (``fuses="attn.compressor,attn.indexer.k_proj"``): where a non-reference
    implementation serves it (here its reference registered as one: the Triton kernel is GPU-only and off by
    default), the key owners call it instead of the compressor and the key gemm, and their indexer gets ``k=None``;
    the program still equals the reference (the matrix cell's own check). Layers that own no keys pass ``k=None``
    in both forms. Without it (the CPU default) the three sites run apart."""
    from latency_specialized.contract import Implementation, always
    from latency_specialized.ops.attention.sparse_mqa import sparse_mqa_compress_index_reference
    from latency_specialized.plugins import manager
    from latency_specialized.runtime.pieces_api import StepContext
    from latency_specialized.testing.matrix import Cell

    calls: list[tuple[int, str, bool]] = []     # (layer, role, k given to the indexer)
    real_op = StepContext.op

    def op(self, role):
        fn = real_op(self, role)

        def recorded(*args, **kw):
            calls.append((self.layer, role, role == "attn.indexer" and args[1] is not None))
            return fn(*args, **kw)
        return recorded

    monkeypatch.setattr(StepContext, "op", op)
    owners = {lp.index for lp in composed_model(tiny_spec()).layers if getattr(lp.attention, "index_keys", False)}
    indexers = {lp.index for lp in composed_model(tiny_spec()).layers
                if getattr(lp.attention.spec, "indexer", None) is not None}
    assert owners and indexers - owners, "the tiny model needs key owners and layers that read their keys"
    cell = Cell("deepseek_v41_flash", 2, 1, 40, 0, "cpu")
    for fused in (False, True):
        calls.clear()
        if fused:
            reg = manager.build_registry()
            reg.implementations.register(Implementation(
                "attention.sparse_mqa_compress_index", "attention.sparse_mqa_compress_index.test_fused",
                sparse_mqa_compress_index_reference, always, priority=1000, provider="test", strided_rows=True))
            monkeypatch.setattr(manager, "_REGISTRY", reg)
        res = manager.get_registry().adapter("deepseek_v41_flash").verify_cell(cell, comm=None)
        assert res.max_abs_err <= res.tolerance and res.fast_steps == res.steps > 0
        roles = {(layer, role) for layer, role, _ in calls}
        for layer in owners:
            assert ((layer, "attn.compressor_index") in roles) == fused
            assert ((layer, "attn.compressor") in roles) != fused and ((layer, "attn.indexer.k_proj") in roles) != fused
        keyed = {layer for layer, role, k in calls if role == "attn.indexer" and k}
        assert keyed == (set() if fused else owners)
        assert {layer for layer, role, _ in calls if role == "attn.indexer"} == indexers
