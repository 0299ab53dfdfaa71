"""ModelStates.clone's subclass hook: a clone is of the subclass, and ``copy_history`` hands it what the
subclass keeps per sequence beyond the state tensors (a reference's own history); shard_states at TP 1 too."""

from __future__ import annotations

import torch

from latency_specialized.runtime.states import ModelStates, shard_states

from tests.runtime.composed_toy import toy_model


class HistoryStates(ModelStates):
    """States plus a per-row token history (what a reference keeps beside the program's states)."""

    history: dict[int, list[int]]

    def copy_history(self, out: "HistoryStates") -> None:  # type: ignore[override]
        out.history = {r: list(h) for r, h in self.history.items()}


def test_clone_keeps_the_subclass_and_its_history():
    st = HistoryStates.allocate(toy_model(), 2, 8, block_size=4, dtype=torch.float32)
    st.history = {1: [5, 6]}
    st.layer(0)["k"].fill_(1.0)
    for c in (st.clone(), shard_states(toy_model(), st, 0, 1)):
        assert type(c) is HistoryStates and c.history == {1: [5, 6]} and c.history[1] is not st.history[1]
        assert c.slots == st.slots and c.allocator is None and torch.equal(c.layer(0)["k"], st.layer(0)["k"])
        c.layer(0)["k"].zero_()
        c.history[1].append(7)
        assert (st.layer(0)["k"] == 1).all() and st.history == {1: [5, 6]}     # deep: the original is untouched


def test_plain_states_clone_to_plain_states():
    st = ModelStates.allocate(toy_model(), 1, 4, block_size=4, dtype=torch.float32)
    c = st.clone()
    assert type(c) is ModelStates and not hasattr(c, "history") and c.slots == st.slots
