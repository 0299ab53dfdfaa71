"""ModelStates: allocation from the pieces' declarations (paged caches with a shuffled block allocator,
'rows' states with row 0 scratch), per-rank shapes, clone, external tensors (vLLM's caches), errors."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.runtime.pieces_api import StateDecl
from latency_specialized.runtime.composed import ComposedModel
from latency_specialized.runtime.states import BlockAllocator, ModelStates

from tests.runtime.composed_toy import toy_model


@dataclasses.dataclass(frozen=True)
class RecurrentFFN:
    """An FFN piece with a recurrent 'rows' state (to exercise the second state kind)."""

    inner: object
    role: ClassVar[str] = "ffn"

    def sites(self, b, rank_spec):
        self.inner.sites(b, rank_spec)

    def weights(self, spec, tp):
        return self.inner.weights(spec, tp)

    def states(self, spec, tp):
        return [StateDecl("memory", "rows", (8 // tp, 3), dtype="float32")]

    def arrange(self, w, rank_spec):
        return self.inner.arrange(w, rank_spec)

    def forward(self, step, w, state, h):
        return self.inner.forward(step, w, state, h)


def model_with_rows() -> ComposedModel:
    m = toy_model()
    layers = list(m.layers)
    layers[1] = dataclasses.replace(layers[1], kind="A+rec", ffn=RecurrentFFN(layers[1].ffn))
    return ComposedModel(m.spec, m.embedding, m.residual, layers, m.head)


def test_allocate_paged_and_rows_states_per_rank():
    model = model_with_rows()
    for tp, kv_a, kv_b in ((1, 2, 1), (2, 1, 1)):
        st = ModelStates.allocate(model, 3, 10, tp=tp, block_size=4, dtype=torch.bfloat16, shuffle_seed=3)
        assert set(st.by_layer) == {0, 1, 2, 3} and set(st.layer(1)) == {"k", "v", "memory"}
        assert st.layer(0)["k"].shape == (9, 4, kv_a, 16) and st.layer(0)["k"].dtype == torch.bfloat16
        assert st.layer(2)["v"].shape == (9, 4, kv_b, 16)                   # MQA: 1 KV head on every rank
        assert st.layer(1)["memory"].shape == (4, 8 // tp, 3) and st.layer(1)["memory"].dtype == torch.float32
        assert all((t == 0).all() for t in st.tensors()) and len(st.tensors()) == 9
        rows = [s.row for s in st.slots]
        assert rows == [1, 2, 3]                                             # row 0: padding scratch
        blocks = [b for s in st.slots for b in s.blocks]
        assert sorted(blocks) == list(range(9)) and blocks != list(range(9))  # disjoint, shuffled
        assert st.capacity == 12 and st.block_table().shape == (3, 3) and st.block_table().dtype == torch.int32
    plain = ModelStates.allocate(model, 2, 8, block_size=4, dtype=torch.float64)
    assert [b for s in plain.slots for b in s.blocks] == [0, 1, 2, 3]       # no seed: contiguous per sequence
    assert plain.layer(1)["memory"].dtype == torch.float64                  # fp32 states are fp64 in fp64 runs


def test_clone_is_deep_and_keeps_the_slots():
    st = ModelStates.allocate(toy_model(), 2, 8, block_size=4, dtype=torch.float32, shuffle_seed=1)
    st.layer(0)["k"].normal_()
    c = st.clone()
    assert c.slots == st.slots and torch.equal(c.layer(0)["k"], st.layer(0)["k"])
    c.layer(0)["k"].zero_()
    assert st.layer(0)["k"].abs().sum() > 0


def test_rows_only_snapshot_shares_the_paged_caches_and_rolls_back_the_rows():
    """clone(paged=False) copies the 'rows' states and shares the paged ones; copy_sequence(paged=False) restores
    one sequence's rows from it and leaves the paged caches as they are (a verification step's rollback)."""
    st = ModelStates.allocate(model_with_rows(), 2, 8, block_size=4, dtype=torch.float32, shuffle_seed=1)
    for t in st.tensors():
        t.normal_()
    snap = st.clone(paged=False)
    assert snap.layer(1)["k"] is st.layer(1)["k"] and snap.layer(1)["memory"] is not st.layer(1)["memory"]
    before = st.layer(1)["memory"].clone()
    for t in st.tensors():
        t.add_(1.0)                                     # decoding drafts: every state moves on
    paged_after = st.layer(1)["k"].clone()
    a, b = st.slots
    st.copy_sequence(a, snap, a, 5, paged=False)
    assert torch.equal(st.layer(1)["memory"][a.row], before[a.row])          # rolled back
    assert torch.equal(st.layer(1)["memory"][b.row], before[b.row] + 1.0)    # the other sequence untouched
    assert torch.equal(st.layer(1)["k"], paged_after)                        # paged: as they are
    full = st.clone()
    assert full.layer(1)["k"] is not st.layer(1)["k"] and torch.equal(full.layer(1)["k"], st.layer(1)["k"])


def test_external_tensors_are_checked_and_used_in_place():
    model = toy_model()
    vllm = {i: torch.randn(2, 5, 8, 2 if i != 2 else 1, 16) for i in range(4)}   # [2, blocks, bs, heads, dim]
    st = ModelStates.external(model, {i: {"k": kv[0], "v": kv[1]} for i, kv in vllm.items()})
    assert st.block_size == 8 and st.slots == []
    assert st.layer(3)["v"].data_ptr() == vllm[3][1].data_ptr()             # a view of the given tensor
    with pytest.raises(UserError, match="no tensor for the state 'v'"):
        ModelStates.external(model, {i: {"k": kv[0]} for i, kv in vllm.items()})
    with pytest.raises(UserError, match=r"this rank needs \[num_blocks, block_size, 1, 16\] at TP=2"):
        ModelStates.external(model, {i: {"k": kv[0], "v": kv[1]} for i, kv in vllm.items()}, tp=2)
    odd = {i: {"k": kv[0], "v": kv[1]} for i, kv in vllm.items()}
    odd[1] = {"k": torch.randn(5, 4, 2, 16), "v": torch.randn(5, 4, 2, 16)}
    with pytest.raises(UserError, match="one block size"):
        ModelStates.external(model, odd)
    with pytest.raises(UserError, match="not declared"):
        ModelStates.external(model, {i: {"k": kv[0], "v": kv[1], "extra": kv[0]} for i, kv in vllm.items()})


def test_block_allocator_and_allocation_errors():
    a = BlockAllocator(6, shuffle_seed=0)
    first = a.allocate(4)
    assert len(set(first)) == 4 and a.num_free == 2
    with pytest.raises(UserError, match="KV cache full: 3 blocks asked, 2 of 6 free"):
        a.allocate(3)
    a.free(first[:2])
    assert a.num_free == 4
    with pytest.raises(UserError, match="double free"):
        a.free(first[:1])
    with pytest.raises(UserError, match="beyond the model context"):
        ModelStates.allocate(toy_model(), 1, 10_000)
    with pytest.raises(UserError, match="row 0 is padding"):
        ModelStates.allocate(toy_model(), 3, 8, num_rows=3)
