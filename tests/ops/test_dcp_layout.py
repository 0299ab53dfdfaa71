"""Decode context parallelism on one process: the layout math against brute force, and DCP attention
(every rank's partial computed here, merged by ``dcp_merge_reference``) against single-rank attention.

The case builders below are shared with ``tests/comm/test_dcp_attention.py`` (the same cases over real
gloo processes) and ``tests/ops/test_dcp_gqa_lse.py`` (the Triton partial under the interpreter).
Every case: fresh random inputs; every cache row no live position reads is NaN (tails of blocks, unused
blocks, the new token's slot before the write); block ids shuffled, -1 past each sequence's table.
"""

from __future__ import annotations

import math

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.attention.dcp import (DcpLayout, dcp_gqa_decode, dcp_mla_decode, global_positions,
                                                    gqa_partial_reference, local_seq_lens, local_slot_mapping,
                                                    mla_partial_reference, token_owner)
from latency_specialized.ops.attention.dcp_merge import dcp_merge_across, dcp_merge_reference
from latency_specialized.ops.attention.gqa import gqa_decode_reference
from latency_specialized.ops.attention.mla import mla_decode_reference

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
LENGTH_SETS = {1: [(37,), (1,), (3,)], 3: [(1, 2, 29), (5, 0, 3)], 8: [(1, 2, 3, 4, 0, 17, 40, 9)]}
"""Global lengths (the new token included) per batch size: lengths below the world, 0 (a padding row)."""


# ----------------------------------------------------------------------------------- brute force
def owned_positions(n: int, layout: DcpLayout) -> list[int]:
    """Global positions < n stored on layout.rank, in the rank's local order (straight from the rule)."""
    return [t for t in range(n) if (t // layout.interleave) % layout.world == layout.rank]


def paged(tokens: list[torch.Tensor], table: torch.Tensor, bs: int, num_blocks: int, feat: tuple,
          dtype: torch.dtype) -> torch.Tensor:
    """A NaN cache [num_blocks, bs, *feat] holding tokens[b][j] at block table[b, j // bs], offset j % bs."""
    cache = torch.full((num_blocks, bs, *feat), float("nan"), dtype=dtype)
    for b, tok in enumerate(tokens):
        for j in range(tok.shape[0]):
            cache[int(table[b, j // bs]), j % bs] = tok[j].to(dtype)
    return cache


def table_for(gen: torch.Generator, B: int, width: int, used: list[int]) -> tuple[torch.Tensor, int]:
    """[B, width] distinct shuffled block ids, -1 past each row's ``used[b]`` blocks; and the block count."""
    num_blocks = B * width + 3
    ids = torch.randperm(num_blocks, generator=gen)[:B * width].view(B, width).to(torch.int32)
    cols = torch.arange(width).unsqueeze(0)
    return torch.where(cols < torch.tensor(used).unsqueeze(1), ids, -1), num_blocks


def slot_of(table: torch.Tensor, b: int, j: int, bs: int) -> int:
    return int(table[b, j // bs]) * bs + j % bs


# ----------------------------------------------------------------------------------- case builders
def make_case(kind: str, seed: int, lens: tuple, *, dtype=torch.float32, sinks=False, gate=False, kv_norm=False,
              window=None, H=4, KV=2, D=16, nope=16, R=8, L=32, v=16) -> dict:
    """Inputs of one decode step shared by every rank: history tokens per sequence, the new token, q."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    if kind == "gqa":
        feat, hist = (KV, D), [torch.randn(max(n - 1, 0), KV, D, generator=g) for n in lens]
        hist_v = [torch.randn(max(n - 1, 0), KV, D, generator=g) for n in lens]
        new = dict(k=torch.randn(B, KV, D, generator=g).to(dtype), v=torch.randn(B, KV, D, generator=g).to(dtype))
        q = torch.randn(B, H, D, generator=g).to(dtype)
        extra = dict(sinks=torch.randn(H, generator=g) if sinks else None, window=window)
        return dict(kind=kind, lens=lens, dtype=dtype, feat=feat, hist=[hist, hist_v], new=new, q=q, extra=extra)
    feat, hist = (L + R,), [torch.randn(max(n - 1, 0), L + R, generator=g) for n in lens]
    kv_c = torch.randn(B, L, generator=g).to(dtype)
    k_pe = torch.randn(B, R, generator=g).to(dtype)
    q = torch.randn(B, H, nope + R, generator=g).to(dtype)
    w = (torch.randn(H * (nope + v), L, generator=g) * L ** -0.5).to(dtype)
    extra = dict(qk_nope_head_dim=nope, v_head_dim=v,
                 gate=torch.randn(B, H * v, generator=g).to(dtype) if gate else None,
                 kv_norm_weight=(1 + 0.1 * torch.randn(L, generator=g)).to(dtype) if kv_norm else None)
    return dict(kind=kind, lens=lens, dtype=dtype, feat=feat, hist=[hist], new=dict(kv_c=kv_c, k_pe=k_pe), q=q,
                w=w, extra=extra)


def single_rank(case: dict, seed: int, bs: int = 4) -> torch.Tensor:
    """The oracle: the op family's reference over one cache holding every sequence whole."""
    g = torch.Generator().manual_seed(seed + 7)
    lens = case["lens"]
    width = max(math.ceil(max(lens) / bs), 1) + 1
    table, nb = table_for(g, len(lens), width, [math.ceil(n / bs) for n in lens])
    caches = [paged(h, table, bs, nb, case["feat"], case["dtype"]) for h in case["hist"]]
    slots = torch.tensor([slot_of(table, b, n - 1, bs) if n > 0 else -1 for b, n in enumerate(lens)])
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    if case["kind"] == "gqa":
        return gqa_decode_reference(case["q"], *caches, table, seq_lens, slot_mapping=slots, **case["new"],
                                    **case["extra"])
    return mla_decode_reference(case["q"], case["new"]["kv_c"], case["new"]["k_pe"], caches[0], slots, table,
                                seq_lens, case["w"], **case["extra"])


def rank_state(case: dict, layout: DcpLayout, seed: int, bs: int = 4) -> dict:
    """This rank's caches (its tokens only, local order), the group's shared table (one entry per
    ``bs * world`` positions; the same on every rank: seeded alike), and the slot the new token must
    land in here (-1: another rank owns it)."""
    g = torch.Generator().manual_seed(seed + 11)
    lens, W = case["lens"], layout.world
    width = max(math.ceil(max(lens) / (bs * W)), 1) + 1
    table, nb = table_for(g, len(lens), width, [math.ceil(n / (bs * W)) for n in lens])
    caches, expect = [], []
    for h in case["hist"]:
        mine = [hb[owned_positions(hb.shape[0], layout)] for hb in h]
        caches.append(paged(mine, table, bs, nb, case["feat"], case["dtype"]))
    for b, n in enumerate(lens):
        own = n > 0 and ((n - 1) // layout.interleave) % W == layout.rank
        expect.append(slot_of(table, b, len(owned_positions(n - 1, layout)), bs) if own else -1)
    return dict(caches=caches, table=table, expect_slots=expect, before=[c.clone() for c in caches])


def rank_partial(case: dict, layout: DcpLayout, st: dict, gqa_partial=gqa_partial_reference):
    """(o, lse) of this rank: local lengths and slots from the layout functions, then the partial op."""
    seq_lens = torch.tensor(case["lens"], dtype=torch.int32)
    lens = local_seq_lens(seq_lens, layout)
    slots = local_slot_mapping(seq_lens.long() - 1, st["table"], st["caches"][0].shape[1], layout)
    if case["kind"] == "gqa":
        sinks = case["extra"]["sinks"] if layout.rank == 0 else None
        win = case["extra"]["window"]
        windowed = dict(window=win, layout=layout, global_seq_lens=seq_lens) if win else {}
        return gqa_partial(case["q"], *st["caches"], st["table"], lens, sinks=sinks, slot_mapping=slots,
                           **case["new"], **windowed)
    ex = {k: v for k, v in case["extra"].items() if k != "gate"}
    return mla_partial_reference(case["q"], case["new"]["kv_c"], case["new"]["k_pe"], st["caches"][0], slots,
                                 st["table"], lens, case["w"], **ex)


def dcp_step(case: dict, layout: DcpLayout, st: dict, comm, merge: str, gqa_partial=gqa_partial_reference):
    """The public one-step DCP op of the case's kind on this rank."""
    seq_lens = torch.tensor(case["lens"], dtype=torch.int32, device=case["q"].device)
    if case["kind"] == "gqa":
        return dcp_gqa_decode(case["q"], *st["caches"], st["table"], seq_lens, layout=layout, comm=comm,
                              merge=merge, partial=gqa_partial, **case["new"], **case["extra"])
    return dcp_mla_decode(case["q"], case["new"]["kv_c"], case["new"]["k_pe"], st["caches"][0], st["table"],
                          seq_lens, case["w"], layout=layout, comm=comm, merge=merge, **case["extra"])


def finish(case: dict, o: torch.Tensor) -> torch.Tensor:
    """A merged fp32 partial as the op's output: MLA's gate after the merge, the one rounding."""
    if case["kind"] == "mla":
        o = o.reshape(o.shape[0], -1)
        if case["extra"]["gate"] is not None:
            o = o * torch.sigmoid(case["extra"]["gate"].float())
    return o.to(case["dtype"])


def written_slots(st: dict) -> list[int]:
    """Flat slots whose contents changed during the call (NaN-aware), over every cache of the rank."""
    changed = set()
    for before, after in zip(st["before"], st["caches"]):
        b, a = before.view(-1, before[0, 0].numel()), after.view(-1, after[0, 0].numel())
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        changed |= set(torch.nonzero(~same.all(-1)).flatten().tolist())
    return sorted(changed)


def new_token_ok(case: dict, st: dict) -> bool:
    """The rank wrote exactly the new tokens it owns, at the expected slots, with their values."""
    want = sorted(s for s in st["expect_slots"] if s >= 0)
    if written_slots(st) != want:
        return False
    news = list(case["new"].values()) if case["kind"] == "gqa" else [torch.cat(list(case["new"].values()), -1)]
    if case["kind"] == "mla" and case["extra"]["kv_norm_weight"] is not None:
        return True  # the normed latent is the op's own; the slot set above is what this checks
    for cache, new in zip(st["caches"], news):
        flat = cache.view(-1, *cache.shape[2:])
        for b, s in enumerate(st["expect_slots"]):
            if s >= 0 and not torch.equal(flat[s], new[b].to(cache.dtype)):
                return False
    return True


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    """Max abs error; raises on NaN or a value outside the dtype's tolerance."""
    tol = TOL[dtype]
    g, w = got.float(), want.float()
    assert g.shape == w.shape, (tuple(g.shape), tuple(w.shape))
    assert not torch.isnan(g).any(), "NaN in the DCP result"
    err = (g - w).abs()
    bad = err > tol["atol"] + tol["rtol"] * w.abs()
    assert not bad.any(), f"{int(bad.sum())} elements off, max error {err.max().item():.3g}"
    return err.max().item()


CASES = [("gqa", {}), ("gqa", dict(sinks=True, window=5)), ("gqa", dict(dtype=torch.bfloat16)),
         ("mla", {}), ("mla", dict(gate=True, kv_norm=True)), ("mla", dict(dtype=torch.bfloat16))]


# ----------------------------------------------------------------------------------- layout tests
@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (4, 1), (3, 2), (4, 4)])
def test_local_lengths_positions_and_owner_match_the_rule(world, interleave):
    n = torch.arange(0, 70, dtype=torch.int32)
    total = torch.zeros_like(n)
    for r in range(world):
        lay = DcpLayout(world, r, interleave)
        got = local_seq_lens(n, lay)
        assert got.dtype == n.dtype
        assert got.tolist() == [len(owned_positions(int(x), lay)) for x in n]
        j = torch.arange(40)
        assert global_positions(j, lay).tolist() == owned_positions(10 ** 4, lay)[:40]
        assert (token_owner(global_positions(j, lay), world, interleave) == r).all()
        total += got
    assert torch.equal(total, n)   # every token on exactly one rank


@pytest.mark.parametrize("world,interleave,bs", [(2, 1, 4), (4, 1, 4), (4, 2, 4), (3, 4, 8)])
def test_local_slots_put_each_token_at_its_local_index(world, interleave, bs):
    # the vLLM formula (offset inside a virtual block of bs * world) == the brute-force local index j
    # stored at table[j // bs], offset j % bs: an ordinary paged cache of the rank's own tokens
    g = torch.Generator().manual_seed(3)
    B, width = 5, 6
    table, _ = table_for(g, B, width, [width] * B)
    for r in range(world):
        lay = DcpLayout(world, r, interleave)
        for t in range(width * bs * world):
            pos = torch.full((B,), t)
            got = local_slot_mapping(pos, table, bs, lay)
            if (t // interleave) % world != r:
                assert (got == -1).all(), (r, t)
                continue
            j = len(owned_positions(t, lay))
            assert got.tolist() == [slot_of(table, b, j, bs) for b in range(B)], (r, t)


def test_padding_rows_get_no_slot_and_bad_layouts_name_the_fix():
    table = torch.zeros(2, 1, dtype=torch.int32)
    lay = DcpLayout(2, 0)
    assert local_slot_mapping(torch.tensor([-1, -1]), table, 4, lay).tolist() == [-1, -1]
    assert local_seq_lens(torch.tensor([0, 0]), lay).tolist() == [0, 0]
    with pytest.raises(UserError, match="multiple of interleave"):
        local_slot_mapping(torch.tensor([0, 1]), table, 6, DcpLayout(2, 1, interleave=4))
    with pytest.raises(UserError, match="0 <= rank < world"):
        DcpLayout(2, 2)
    with pytest.raises(UserError, match="interleave"):
        DcpLayout(2, 0, interleave=0)


# ----------------------------------------------------------------------------------- attention, all ranks here
def _all_ranks(case, world, interleave, seed, gqa_partial=gqa_partial_reference):
    parts, states = [], []
    for r in range(world):
        lay = DcpLayout(world, r, interleave)
        st = rank_state(case, lay, seed)
        parts.append(rank_partial(case, lay, st, gqa_partial))
        states.append(st)
    o = torch.stack([p[0] for p in parts])
    lse = torch.stack([p[1] for p in parts])
    return o, lse, states


@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (4, 1), (4, 2)])
@pytest.mark.parametrize("batch", sorted(LENGTH_SETS))
@pytest.mark.parametrize("kind,opts", CASES, ids=lambda x: x if isinstance(x, str) else "-".join(x) or "plain")
def test_partials_merged_equal_single_rank_attention(kind, opts, batch, world, interleave):
    for i, lens in enumerate(LENGTH_SETS[batch]):
        seed = 100 * batch + 10 * world + i
        case = make_case(kind, seed, lens, **opts)
        want = single_rank(case, seed)
        o, lse, states = _all_ranks(case, world, interleave, seed)
        assert o.dtype == torch.float32 and lse.dtype == torch.float32
        merged, _ = dcp_merge_reference(o, lse)
        close(finish(case, merged), want, case["dtype"])
        for st in states:
            assert new_token_ok(case, st), (lens, st["expect_slots"], written_slots(st))


def test_empty_ranks_and_padding_rows_merge_to_zeros_not_nan():
    case = make_case("gqa", 5, (0, 1, 2))
    o, lse, _ = _all_ranks(case, 4, 1, 5)
    assert torch.isneginf(lse[:, 0]).all() and torch.isneginf(lse[2:, 1]).all()   # no key: -inf, o = 0
    assert (o[:, 0] == 0).all()
    merged, total = dcp_merge_reference(o, lse)
    assert (merged[0] == 0).all() and torch.isneginf(total[0]).all()
    assert not torch.isnan(merged).any()


class ThreadGroup:
    """W ranks as threads of this process: ``all_gather`` / ``all_reduce`` (sum in rank order) meet at a
    barrier - the communicator protocol without processes (the gloo run is tests/comm/test_dcp_attention.py)."""

    def __init__(self, world: int):
        import threading

        self.world, self.barrier, self.slots = world, threading.Barrier(world, timeout=60), [None] * world

    def comm(self, rank: int):
        group = self

        class _Comm:
            name, world_size = "threads", group.world

            def __init__(self):
                self.rank = rank

            def _exchange(self, t):
                group.slots[rank] = t.clone()
                group.barrier.wait()
                parts = list(group.slots)
                group.barrier.wait()   # nobody overwrites a slot before every rank has read it
                return parts

            def all_gather(self, t, dim=-1):
                return torch.cat(self._exchange(t), dim=dim)

            def all_reduce(self, t):
                parts = self._exchange(t)
                acc = parts[0].float()
                for p in parts[1:]:
                    acc = acc + p.float()
                return t.copy_(acc)

        return _Comm()

    def run(self, fn):
        """[fn(rank, comm) for every rank], each on its own thread; the first exception re-raised."""
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(self.world) as ex:
            futures = [ex.submit(fn, r, self.comm(r)) for r in range(self.world)]
            return [f.result() for f in futures]


@pytest.mark.parametrize("merge", ["allgather", "rescale"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind,opts", [("gqa", dict(sinks=True, window=6)), ("mla", dict(gate=True))],
                         ids=["gqa", "mla"])
def test_public_dcp_ops_over_a_thread_group_equal_single_rank(kind, opts, world, merge):
    lens = (1, 2, 3, 0, 30, 11, 7, 4)
    case = make_case(kind, 21 + world, lens, **opts)
    want = single_rank(case, 21)

    def body(rank, comm):
        lay = DcpLayout(world, rank)
        st = rank_state(case, lay, 21)
        return dcp_step(case, lay, st, comm, merge), new_token_ok(case, st)

    results = ThreadGroup(world).run(body)
    for y, ok in results:
        close(y, want, case["dtype"])
        assert ok
        assert torch.equal(y, results[0][0])   # the same bits on every rank
    with pytest.raises(ValueError, match="allgather, rescale"):
        dcp_merge_across(torch.zeros(1, 1, 1), torch.zeros(1, 1), None, method="max")


@pytest.mark.parametrize("interleaved", [False, True])
def test_dcp_mla_applies_the_ops_rope(interleaved):
    """``dcp_mla_decode`` with ``positions`` / ``rope_inv_freq`` rotates q's rope part and the new rope key as
    ``attention.mla`` does (the MLA piece passes its RoPE so): merged over a thread group of 2, equal to the
    single-rank reference given the same RoPE arguments."""
    lens = (1, 5, 30, 0, 12)
    case = make_case("mla", 41, lens, gate=True, kv_norm=True)
    g = torch.Generator().manual_seed(5)
    R = case["new"]["k_pe"].shape[1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, R, 2).float() / R)) * (1 + 0.01 * torch.rand(R // 2, generator=g))
    rope = dict(positions=torch.tensor([max(n - 1, 0) for n in lens]) + 3, rope_inv_freq=inv_freq,
                rope_interleaved=interleaved)
    plain = dict(case, extra=dict(case["extra"]))
    case["extra"].update(rope)
    want = single_rank(case, 41)
    assert (single_rank(plain, 41) - want).abs().max() > 1e-3   # the RoPE matters here

    def body(rank, comm):
        lay = DcpLayout(2, rank)
        return dcp_step(case, lay, rank_state(case, lay, 41), comm, "allgather")

    for y in ThreadGroup(2).run(body):
        close(y, want, case["dtype"])


# ----------------------------------------------------------------------------------- GPU: graph capture
@pytest.mark.gpu
@pytest.mark.parametrize("kind,partial", [("gqa", "torch"), ("gqa", "triton"), ("mla", "torch")])
def test_rank_steps_and_merge_capture_into_one_cuda_graph(kind, partial):
    """Every rank's layout math + partial + the merge of the stacked partials in one CUDA graph (no host
    sync anywhere: capture would fail on one), replayed for other lengths == single-rank attention.
    The collectives are not in it: gloo is not capturable (the process test covers them)."""
    from latency_specialized.ops.attention.dcp import gqa_partial_triton

    world, seed, dev = 2, 77, "cuda"
    fn = gqa_partial_triton if partial == "triton" else gqa_partial_reference
    lens = (1, 2, 3, 0, 300, 41, 77, 8)
    case = make_case(kind, seed, lens, sinks=kind == "gqa")
    want = single_rank(case, seed)
    lays = [DcpLayout(world, r) for r in range(world)]
    states = [rank_state(case, lay, seed) for lay in lays]
    pristine = [[c.clone() for c in st["caches"]] for st in states]

    def to_dev(x):
        return {k: to_dev(v) for k, v in x.items()} if isinstance(x, dict) else (
            [to_dev(v) for v in x] if isinstance(x, list) else (x.to(dev) if isinstance(x, torch.Tensor) else x))

    case_d, states_d = to_dev(case), [to_dev(st) for st in states]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)

    def step():
        parts = []
        for lay, st in zip(lays, states_d):
            local = local_seq_lens(seq_lens, lay)
            slots = local_slot_mapping(seq_lens.long() - 1, st["table"], st["caches"][0].shape[1], lay)
            if kind == "gqa":
                parts.append(fn(case_d["q"], *st["caches"], st["table"], local, slot_mapping=slots,
                                sinks=case_d["extra"]["sinks"] if lay.rank == 0 else None, **case_d["new"]))
            else:
                parts.append(mla_partial_reference(case_d["q"], case_d["new"]["kv_c"], case_d["new"]["k_pe"],
                                                   st["caches"][0], slots, st["table"], local, case_d["w"],
                                                   qk_nope_head_dim=16, v_head_dim=16))
        return dcp_merge_reference(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))[0]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()   # warm-up (compiles the kernels); it writes the new tokens, restored below
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    seq_lens.copy_(torch.tensor((5, 1, 9, 2, 3, 0, 4, 6), dtype=torch.int32))   # captured with other lengths
    with torch.cuda.graph(graph):
        out = step()
    for st, clean in zip(states_d, pristine):
        for c, p in zip(st["caches"], clean):
            c.copy_(p)
    seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    close(finish(case, out.cpu()), want, case["dtype"])
    for st in states_d:
        assert new_token_ok(case, _cpu(st))


def _cpu(st: dict) -> dict:
    return {k: ([c.cpu() for c in v] if isinstance(v, list) and v and isinstance(v[0], torch.Tensor) else
                (v.cpu() if isinstance(v, torch.Tensor) else v)) for k, v in st.items()}
