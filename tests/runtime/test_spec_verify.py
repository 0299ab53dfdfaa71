"""Verification steps (speculative decoding) in the generic runtime: per-row meta, the static inputs, which
pieces may verify, and a composed model of paged attention (GQA with a sliding window and sinks, MoE)
whose verification step equals 1 + k single steps - the causal mask within the block comes from the
per-row sequence lengths alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from latency_specialized import hardware
from latency_specialized.errors import UserError
from latency_specialized.ops.plan import build_plan
from latency_specialized.plugins import get_registry
from latency_specialized.pieces import DenseMLP, TokenEmbedding, LMHead, PreNormResidual
from latency_specialized.pieces.attention.kda import KDAAttention
from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
from latency_specialized.runtime.composed import (ComposedModel, ComposedProgram, LayerPieces, spec_tokens_of,
                                                  verification_problems)
from latency_specialized.runtime.pieces_api import StateDecl
from latency_specialized.runtime.states import ModelStates
from latency_specialized.runtime.step_meta import VerifyRows
from latency_specialized.spec import DenseMLPSpec, KDAAttentionSpec, LayerSpec, ModelSpec, NormSpec

from tests.runtime.composed_toy import ToyAdapter, random_weights, toy_model

BS = 4


def cpu_plan(model, batch, dtype, spec_tokens=0):
    return build_plan(ToyAdapter(model), get_registry().implementations, hardware.for_arch("cpu"), tp=1,
                      batch=batch, dtype="float32", spec_tokens=spec_tokens)


def _buffers(k: int, max_batch: int = 4, nb: int = 3) -> DecodeBuffers:
    return DecodeBuffers(BufferSpec(max_batch=max_batch, max_blocks_per_seq=nb, block_size=BS, spec_tokens=k))


def test_verify_rows_make_every_row_a_request_of_its_own():
    k, T = 2, 3
    buf = _buffers(k)
    bt = torch.tensor([[5, 2, 9], [1, 7, 4], [3, 0, 6]])
    buf.load([11, 12, 13], [3, 7, 0], [4, 2, 6], bt)
    buf.set_drafts(torch.tensor([[21, 31], [22, 32], [23, 33]]))
    buf.set_accepted([1, -1, 2])
    rows = VerifyRows(4, k, 3, "cpu")
    m = rows.fill(buf, 4)
    M = 4 * T
    assert all(m[n].shape[0] == M for n in ("tokens", "positions", "slots", "seq_lens", "block_table"))
    assert m["tokens"].view(4, T)[:3].tolist() == [[11, 21, 31], [12, 22, 32], [13, 23, 33]]
    pos = m["positions"].view(4, T)
    assert pos[:3].tolist() == [[3, 4, 5], [7, 8, 9], [0, 1, 2]]
    assert m["seq_lens"].view(4, T).tolist() == [[4, 5, 6], [8, 9, 10], [1, 2, 3], [0, 0, 0]]
    # position p lives in column p // 4 of the request's blocks, offset p % 4
    want = [[bt[b, p // BS].item() * BS + p % BS for p in pos[b].tolist()] for b in range(3)]
    assert m["slots"].view(4, T)[:3].tolist() == want
    assert m["slots"].view(4, T)[3].tolist() == [-1] * T                          # padding writes nothing
    assert torch.equal(m["block_table"].view(4, T, 3)[:3], bt.int().unsqueeze(1).expand(3, T, 3))
    # per request: state rows and the accepted counts (padding: the scratch row, nothing pending)
    assert m["rows"].tolist() == [4, 2, 6, 0] and m["accepted"].tolist() == [1, -1, 2, -1]
    with pytest.raises(UserError, match="spec_tokens=2"):
        rows.fill(_buffers(3), 4)


def test_buffers_carry_drafts_and_accepted_counts():
    buf = _buffers(3)
    buf.load([1, 2], [0, 4], [1, 2])
    assert buf.accepted.tolist() == [-1] * 4 and buf.drafts.shape == (4, 3)
    buf.set_accepted([2, 0])
    assert buf.accepted.tolist() == [2, 0, -1, -1]
    buf.load([1, 2], [0, 4], [1, 2])
    assert buf.accepted.tolist() == [-1] * 4, "a new batch composition has nothing pending"
    assert {"drafts", "accepted"} <= set(buf.tensors())                      # snapshotted around graph warm-up
    with pytest.raises(UserError, match="set_drafts"):
        buf.set_drafts(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(UserError, match="set_accepted"):
        buf.set_accepted([0])
    # the last draft must fit the block table (12 tokens): position 8 + 3 drafts = 11 fits, 9 does not
    buf.load([1], [8], [1])
    assert buf.capacity_problem() is None
    with pytest.raises(UserError, match="capacity"):
        buf.load([1], [9], [1])


@dataclass(frozen=True)
class Recurrent:
    """An attention piece with a per-sequence state and no verification path."""

    role: ClassVar[str] = "attn"

    def states(self, spec, tp):
        return [StateDecl("h", "rows", (4,), dtype="float32")]


def _model(attn) -> ComposedModel:
    kda = KDAAttentionSpec(num_heads=2, head_dim=16, conv_kernel=4, decay_rank=16)
    spec = ModelSpec(name="kda_toy", variant="tiny", hidden_size=32, vocab_size=64, max_context=64,
                     layers=(LayerSpec(index=0, attention=kda, ffn=DenseMLPSpec(intermediate=32)),), norm=NormSpec())
    return ComposedModel(spec, TokenEmbedding(), PreNormResidual(), [LayerPieces(0, "kda", attn,
                                                                                DenseMLP(spec.layers[0].ffn))], LMHead())


def test_only_pieces_with_per_sequence_states_must_verify_themselves():
    kda = KDAAttentionSpec(num_heads=2, head_dim=16, conv_kernel=4, decay_rank=16)
    assert verification_problems(toy_model(), 7) == []            # paged attention, MoE, dense: row-wise
    assert verification_problems(_model(KDAAttention(kda)), 0) == []
    [p] = verification_problems(_model(KDAAttention(kda)), 3)
    assert "KDAAttention piece keeps per-sequence states ['conv', 'state']" in p and "spec_tokens >= 3" in p
    assert verification_problems(_model(KDAAttention(kda, spec_tokens=7)), 3) == []
    [p] = verification_problems(_model(KDAAttention(kda, spec_tokens=3)), 7)
    assert "verifies 3 speculative tokens" in p
    [p] = verification_problems(_model(Recurrent()), 1)
    assert "Recurrent piece" in p and "no verification path" in p


def test_states_of_a_plain_model_extended_by_the_tapes_share_their_tensors():
    kda = KDAAttentionSpec(num_heads=2, head_dim=16, conv_kernel=4, decay_rank=16)
    plain = ModelStates.allocate(_model(KDAAttention(kda)), 2, 8, block_size=BS, dtype=torch.float32)
    plain.layer(0)["state"].normal_()
    ext = plain.extended(_model(KDAAttention(kda, spec_tokens=3)), torch.float32)
    assert ext.layer(0)["state"] is plain.layer(0)["state"] and ext.slots == plain.slots
    assert ext.layer(0)["tape_state"].shape == (3, 4, 2, 3, 16) and not ext.layer(0)["tape_state"].any()
    assert ext.layer(0)["tape_conv"].shape == (3, 4, 3 * 32)


def test_a_plan_of_tokens_not_bucket_times_1_plus_k_is_refused():
    plan = cpu_plan(toy_model(), 2, torch.float32)
    assert spec_tokens_of(plan) == 0
    plan.tokens = 3
    with pytest.raises(UserError, match="bucket x \\(1 \\+ k\\)"):
        spec_tokens_of(plan)


def _prefilled(model, lens, seed):
    """States with ``lens[b]`` tokens of sequence b, written by plain decode steps (one at a time)."""
    w = random_weights(model, seed=seed, dtype=torch.float32)
    states = ModelStates.allocate(model, len(lens), max(lens) + 16, block_size=BS, dtype=torch.float32,
                                  shuffle_seed=seed)
    plan = cpu_plan(model, len(lens), torch.float32)
    prog = ComposedProgram(model, w, plan, states)
    buf = DecodeBuffers(BufferSpec(max_batch=plan.bucket, max_blocks_per_seq=len(states.slots[0].blocks),
                                   block_size=BS))
    g = torch.Generator().manual_seed(seed)
    for t in range(max(lens)):
        live = [b for b, n in enumerate(lens) if t < n]
        slots = [states.slots[b] for b in live]
        buf.load(torch.randint(0, 96, (len(live),), generator=g), [t] * len(live), [s.row for s in slots],
                 states.block_table(slots))
        buf.metadata(plan.bucket)
        prog.step(buf, plan.bucket)
    return w, states


@pytest.mark.parametrize("k", [1, 3])
def test_paged_attention_verification_step_equals_single_steps(k):
    """GQA (grouped and MQA, sliding window 5, sinks) + MoE: the verification step of 1 + k rows per request
    gives every row the logits of the single step at its position (the window counts the block's own rows)."""
    model, lens = toy_model(), [5, 9, 3]
    B, T = len(lens), 1 + k
    w, states = _prefilled(model, lens, seed=3 + k)
    rows, bt = [s.row for s in states.slots], states.block_table()
    toks = torch.randint(0, 96, (B, T), generator=torch.Generator().manual_seed(k))
    plan = cpu_plan(model, B, torch.float32, spec_tokens=k)
    vs = states.clone()
    prog = ComposedProgram(model, w, plan, vs)
    assert prog.spec_tokens == k and plan.tokens == plan.bucket * T
    buf = _buffers(k, max_batch=plan.bucket, nb=bt.shape[1])
    buf.load(toks[:, 0], lens, rows, bt)
    buf.set_drafts(toks[:, 1:])
    prog.step(buf, plan.bucket)
    got = prog.outputs()["logits"]
    assert got.shape == (plan.bucket, T, 96)
    single = ComposedProgram(model, w, cpu_plan(model, B, torch.float32), ss := states.clone())
    sbuf = DecodeBuffers(BufferSpec(max_batch=plan.bucket, max_blocks_per_seq=bt.shape[1], block_size=BS))
    for t in range(T):
        sbuf.load(toks[:, t], [p + t for p in lens], rows, bt)
        sbuf.metadata(plan.bucket)
        single.step(sbuf, plan.bucket)
        want = single.logits[:B]
        assert ((got[:B, t] - want).abs().max() / want.abs().max()).item() <= 5e-5, t
        assert torch.equal(got[:B, t].argmax(-1), want.argmax(-1))
    for a, b in zip(vs.tensors(), ss.tensors()):   # the same KV written, row for row
        assert ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item() <= 5e-5
