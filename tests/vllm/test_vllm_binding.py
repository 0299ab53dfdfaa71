"""The vLLM binding's generic parts without an engine: the SiteTable over the plans (one SiteChoice,
stock sites on top of it), vLLM's CPU KV-cache layout as the GQA piece's states, and the decode step
(a ComposedProgram over given weights and caches, fed from vLLM-style metadata) against the same
ComposedProgram run standalone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from latency_specialized import hardware
from latency_specialized.errors import UserError
from latency_specialized.ops.attention.gqa import gqa_decode_reference
from latency_specialized.ops.plan import SiteChoice
from latency_specialized.plugins import get_registry
from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
from latency_specialized.runtime.composed import ComposedProgram
from latency_specialized.runtime.op_table import OpTable
from latency_specialized.runtime.states import ModelStates
from latency_specialized.runtime.vllm_binding import (STOCK, SiteTable, VllmAttention, VllmComposedStep,
                                                      kv_state_views)
from latency_specialized.spec import Deployment

from latency_specialized_models.vllm_moe.adapter import VllmMoEAdapter
from latency_specialized_models.vllm_moe.composed import composed_model
from latency_specialized_models.vllm_moe.spec import tiny_spec

REASON = "vLLM's Attention layer owns the paged KV cache and its backend"


def _sites(max_batch: int = 8, arch: str = "cpu") -> SiteTable:
    reg = get_registry()
    adapter = VllmMoEAdapter(tiny_spec().model_copy(update={"variant": "full"}))
    return SiteTable.build(adapter, reg.implementations, hardware.for_arch(arch),
                           Deployment(arch=arch, dtype="float32"), max_batch)


def test_site_table_holds_the_planners_site_choices_and_marks_stock_sites_on_them():
    sites = _sites()
    assert sites.buckets == (1, 2, 4, 8)
    before = {b: {c.site.name: c for c in p.choices} for b, p in sites.plans.items()}
    fn = VllmAttention({})
    for kind in ("gqa+dense", "gqa+moe"):
        sites.serve_stock(f"{kind}/attn.gqa", fn, REASON)
    for b, plan in sites.plans.items():
        assert plan.bucket == b
        for c in plan.choices:
            assert type(c) is SiteChoice  # the plan's own dataclass: no second one
            old = before[b][c.site.name]
            if c.site.name.endswith("/attn.gqa"):
                assert c.stock == REASON and c.impl.name == STOCK and c.impl.fn is fn and not c.is_fast
                assert c.site is old.site and (old.impl.name, f"not used: {REASON}") in c.refusals
                assert sites.reason(b, c.site.name) == REASON
            else:
                assert c is old and not c.stock
        counts = plan.counts()  # stock sites are counted as stock, not as references or fast sites
        assert counts["stock"] == 2 and "stock: 2 |" in plan.to_text()
        assert counts["fast"] + counts["reference"] + counts["stock"] + counts["unserved"] \
            + counts["not_called"] == counts["sites"]
    # the program's op table binds exactly these choices
    table = OpTable(sites.plans)
    for b, plan in sites.plans.items():
        assert all(table[b].impls[c.site.name] is c.impl for c in plan.choices)
    assert sites.problems() == []  # the CPU references serve every other site
    with pytest.raises(UserError, match="no op site 'gqa\\+moe/attn.sdpa'"):
        sites.serve_stock("gqa+moe/attn.sdpa", fn, REASON)


def test_unserved_sites_are_start_time_problems_stock_sites_are_not():
    sites = _sites(max_batch=2)
    sites.serve_stock("gqa+moe/attn.gqa", VllmAttention({}), REASON)
    sites.allow_reference = False  # as on a GPU: a reference-only site cannot serve
    problems = sites.problems()
    assert problems and all("only the reference" in p for p in problems)
    assert not any("gqa+moe/attn.gqa" in p for p in problems)
    assert any("gqa+dense/attn.gqa" in p for p in problems)
    assert len(problems) == len(set(problems))  # one line per site, not per bucket


def test_kv_state_views_are_the_cpu_backends_key_and_value_halves():
    nb, KV, bs, D = 5, 2, 32, 16
    kv = torch.randn(nb, KV, bs, 2 * D)
    k, v = kv_state_views(kv, KV, D)
    assert k.shape == v.shape == (nb, bs, KV, D)
    read = kv.view(nb, KV, 2 * bs, D)  # how CPU_ATTN reads its cache
    assert torch.equal(k, read[:, :, :bs].permute(0, 2, 1, 3)) and torch.equal(v, read[:, :, bs:].permute(0, 2, 1, 3))
    assert k.data_ptr() == kv.data_ptr() and k.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
    k[3, 7, 1] = 42.0  # a view: writes land in vLLM's tensor
    assert torch.all(read[3, 1, 7] == 42.0)
    with pytest.raises(UserError, match="not the CPU backend's"):
        kv_state_views(torch.zeros(2, nb, bs, KV, D), KV, D)


class FakeAttention:
    """Stands in for vLLM's Attention layer: its own CPU-layout cache, metadata from the 'forward context'."""

    def __init__(self, kv_cache: torch.Tensor, meta: SimpleNamespace, kv_heads: int, head_dim: int, name: str):
        self.kv_cache, self.meta, self.kv_heads, self.head_dim, self.layer_name = kv_cache, meta, kv_heads, head_dim, name
        self.rows: list[int] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = q.shape[0]
        self.rows.append(n)
        m = self.meta
        assert m.slot_mapping.numel() == n  # called on the live rows only
        kc, vc = kv_state_views(self.kv_cache, self.kv_heads, self.head_dim)
        slots = m.slot_mapping.long()
        kc[slots // kc.shape[1], slots % kc.shape[1]] = k
        vc[slots // kc.shape[1], slots % kc.shape[1]] = v
        return gqa_decode_reference(q, kc, vc, m.block_table, m.seq_lens).reshape(n, -1)


def _weights(model, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out: dict = {}
    for (layer, role, local), d in model.weight_decls(1).items():
        t = torch.randn(d.shape, generator=g) * 0.2
        if "norm" in local:
            t = 1.0 + 0.1 * t
        out.setdefault(layer, {}).setdefault(role, {})[local] = t
    return out


def test_decode_step_equals_the_standalone_composed_program():
    """Three sequences (bucket 4: one padded row) decode four steps through VllmComposedStep, over
    caches in vLLM's CPU layout, with vLLM-style metadata; the same ComposedProgram run standalone on
    its own paged caches (attn.gqa by the reference) gives the same hidden states, bit for bit."""
    spec = tiny_spec().model_copy(update={"variant": "full"})
    model = composed_model(spec)
    weights = _weights(model)
    a = spec.layers[0].attention
    nb, bs, B, W = 12, 32, 3, 2
    meta = SimpleNamespace()
    sites = _sites(max_batch=4)
    caches = {i: torch.zeros(nb, a.num_kv_heads, bs, 2 * a.head_dim) for i in range(spec.num_layers)}
    layers = {i: FakeAttention(caches[i], meta, a.num_kv_heads, a.head_dim, f"model.layers.{i}.self_attn.attn")
              for i in range(spec.num_layers)}
    attention = VllmAttention(layers)
    for kind in spec.layer_kinds():
        sites.serve_stock(f"{kind}/attn.gqa", attention, REASON)
    step = VllmComposedStep(model, weights, sites, attention, metadata_layer="model.layers.0.self_attn.attn",
                            metadata_fn=lambda name: meta)

    ref_plans = _sites(max_batch=4).plans  # the planner's choices, attn.gqa by the reference
    ref_states = ModelStates.allocate(model, B, W * bs, block_size=bs, dtype=torch.float32, num_blocks=nb)
    ref = ComposedProgram(model, weights, ref_plans, ref_states)
    ref_buf = DecodeBuffers(BufferSpec(max_batch=ref.max_batch, max_blocks_per_seq=W, block_size=bs))

    block_table = torch.tensor([[7, 2], [0, 11], [5, 9]], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    for pos in range(4):
        tokens = torch.randint(0, spec.vocab_size, (B,), generator=g, dtype=torch.int32)  # vLLM's are int32
        positions = torch.full((B,), pos, dtype=torch.int64)
        slots = (block_table[:, 0].long() * bs + pos)
        meta.slot_mapping, meta.block_table = slots, block_table
        meta.seq_lens = torch.full((B,), pos + 1, dtype=torch.int32)
        got = step(tokens, positions, B).clone()

        ref_buf.tokens[:B], ref_buf.positions[:B], ref_buf.slot_mapping[:B] = tokens, positions, slots
        ref_buf.seq_lens[:B], ref_buf.block_tables[:B] = pos + 1, block_table
        ref.step(ref_buf, 4)
        assert torch.equal(got, ref.hidden[:B]), pos
    program = step.program
    assert isinstance(program, ComposedProgram) and program.model.head is None and program.steps_run == 4
    assert all(rows == [B] * 4 for rows in (l.rows for l in layers.values()))
    assert all(program.op_table[b].impls[c.site.name] is c.impl for b, p in sites.plans.items() for c in p.choices)
    assert program.op_table.calls["gqa+moe/attn.gqa"] == 4 * 2 and program.op_table.calls["gqa+dense/attn.gqa"] == 4
    for i in range(spec.num_layers):  # the program's states are views of the layers' caches
        assert program.states.layer(i)["k"].data_ptr() == caches[i].data_ptr()
    # what was written into vLLM's caches is what the standalone program wrote into its own
    for i in range(spec.num_layers):
        k, v = kv_state_views(caches[i], a.num_kv_heads, a.head_dim)
        assert torch.equal(k, ref_states.layer(i)["k"]) and torch.equal(v, ref_states.layer(i)["v"])


def test_decode_step_refuses_a_model_with_a_head_and_states_it_did_not_bind():
    spec = tiny_spec().model_copy(update={"variant": "full"})
    from dataclasses import replace

    from latency_specialized.pieces import LMHead

    with pytest.raises(UserError, match="head=None"):
        VllmComposedStep(replace(composed_model(spec), head=LMHead()), {}, _sites(2), VllmAttention({}),
                         metadata_layer="x")
    a = VllmAttention({})
    with pytest.raises(UserError, match="not a bound vLLM cache view"):
        a(torch.zeros(1, 4, 32), torch.zeros(1, 32, 2, 32), torch.zeros(1, 32, 2, 32), torch.zeros(1, 1),
          torch.ones(1), k=torch.zeros(1, 2, 32), v=torch.zeros(1, 2, 32), slot_mapping=torch.zeros(1))
