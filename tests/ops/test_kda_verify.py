"""attention.kda_verify / attention.kda_accept (CPU references): a verification step over 1 + k tokens is
k + 1 single ``attention.kda`` steps, and accepting j draft tokens leaves, bit for bit, the states after
exactly the first j + 1 tokens.

Fresh random inputs per case, requests in scattered state rows (one shared padding row too), tapes
poisoned with NaN before every call, and entries an accept must not read poisoned again after the
verification step: a NaN in any state means the accept read an entry nobody wrote.
"""

from __future__ import annotations

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.attention.kda import kda_decode_reference
from latency_specialized.ops.attention.kda_verify import (kda_accept_reference, kda_verify_reference,
                                                          tape_shapes)
from latency_specialized.pieces.attention.kda import KDAAttention
from latency_specialized.plugins import get_registry
from latency_specialized.spec import DenseMLPSpec, KDAAttentionSpec, LayerSpec, ModelSpec

from tests.pieces.piece_harness import TOL, ThreadWorld, bind, random_weights, rel, shard, step_context

NUM_ROWS = 12  # state rows; row 0 = padding scratch


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _case(B, T, dtype, seed, *, H=4, D=8, W=4, rank=8, tmax=None, pad=False):
    """Inputs of one verification step of B requests x T tokens, states and NaN tapes for ``tmax`` tokens."""
    g = torch.Generator().manual_seed(seed)
    hd = H * D
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    rows = torch.randperm(NUM_ROWS - 1, generator=g)[:B] + 1
    if pad and B > 1:
        rows[-1] = 0  # a padding request on the scratch row
    R = B * T
    inp = dict(
        mixed_qkv=rnd(R, 3 * hd).to(dtype),
        conv_weight=rnd(3 * hd, W) / W ** 0.5,
        f=rnd(R, rank).to(dtype),
        A_log=torch.log(0.5 + 1.5 * torch.rand(H, generator=g)),
        dt_bias=-2.0 + 0.5 * rnd(hd),
        beta_logit=rnd(R, H).to(dtype),
        g_out=rnd(R, hd).to(dtype),
        norm_weight=1.0 + 0.1 * rnd(D),
    )
    kw = dict(num_heads=H, eps=1e-5, gate_lower_bound=-5.0, f_b_weight=(rnd(hd, rank) / rank ** 0.5).to(dtype))
    conv = rnd(NUM_ROWS, 3 * hd, W - 1).to(dtype)
    state = 0.3 * rnd(NUM_ROWS, H, D, D)
    ts, tc = tape_shapes(H, D, (tmax or T) - 1)
    tape_state = torch.full((NUM_ROWS, *ts), float("nan"))
    tape_conv = torch.full((NUM_ROWS, *tc), float("nan"), dtype=dtype)
    return inp, kw, conv, state, rows.to(torch.int32), tape_state, tape_conv


def _single_steps(inp, kw, conv, state, rows, T):
    """T single ``attention.kda`` steps over the batch: per-token outputs [B, T, HD] and the states after each
    token (``conv``/``state`` lists of [B, ...] for t = 0..T-1)."""
    conv, state = conv.clone(), state.clone()
    idx = rows.long()
    per = lambda name, t: inp[name][t::T].contiguous()  # noqa: E731 - token t of every request
    outs, convs, states = [], [], []
    for t in range(T):
        o = kda_decode_reference(per("mixed_qkv", t), conv, inp["conv_weight"], per("f", t), inp["A_log"],
                                 inp["dt_bias"], per("beta_logit", t), per("g_out", t), inp["norm_weight"], state,
                                 rows, **kw)
        outs.append(o)
        convs.append(conv[idx].clone())
        states.append(state[idx].clone())
    return torch.stack(outs, dim=1), convs, states


def _verify(inp, kw, conv, state, rows, tape_state, tape_conv):
    return kda_verify_reference(inp["mixed_qkv"], conv, inp["conv_weight"], inp["f"], inp["A_log"], inp["dt_bias"],
                                inp["beta_logit"], inp["g_out"], inp["norm_weight"], state, rows, tape_state, tape_conv,
                                **kw)


def _poison_unread(tape_state, tape_conv, rows, accepted):
    """NaN into every tape entry past each request's accepted token: the accept must not read them."""
    for r, j in zip(rows.tolist(), accepted.tolist()):
        tape_state[r, j + 1:] = float("nan")
        tape_conv[r, j + 1:] = float("nan")


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [0, 1, 3, 7])
@pytest.mark.parametrize("B", [1, 3, 8])
def test_verify_equals_single_steps(dtype, k, B):
    T = 1 + k
    inp, kw, conv, state, rows, tape_state, tape_conv = _case(B, T, dtype, seed=100 * k + B + (dtype == torch.bfloat16))
    want, want_convs, want_states = _single_steps(inp, kw, conv, state, rows, T)
    conv0, state0 = conv.clone(), state.clone()

    got = _verify(inp, kw, conv, state, rows, tape_state, tape_conv)
    assert got.dtype == dtype and got.shape == (B * T, inp["g_out"].shape[1])
    assert torch.equal(got.view(B, T, -1), want)                      # every token's output, in order
    # the verification step itself leaves the live states as they were (the accept moves them on)
    assert torch.equal(conv, conv0) and torch.equal(state, state0)

    kda_accept_reference(conv, state, rows, torch.full((B,), k, dtype=torch.int32), tape_state, tape_conv)
    idx = rows.long()
    assert torch.equal(state[idx], want_states[-1]) and torch.equal(conv[idx], want_convs[-1])
    others = [r for r in range(NUM_ROWS) if r not in rows.tolist()]  # other sequences' rows untouched
    assert torch.equal(conv[others], conv0[others]) and torch.equal(state[others], state0[others])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,accepted", [(7, [0, 7, 3, 5, 1, 7, 0, 6]), (3, [3, 0, 2]), (1, [1, 0, 0, 1])])
def test_accept_rolls_back_to_the_accepted_prefix_bit_for_bit(dtype, k, accepted):
    T, B = 1 + k, len(accepted)
    inp, kw, conv, state, rows, tape_state, tape_conv = _case(B, T, dtype, seed=7 + k + B)
    _, want_convs, want_states = _single_steps(inp, kw, conv, state, rows, T)
    _verify(inp, kw, conv, state, rows, tape_state, tape_conv)
    acc = torch.tensor(accepted, dtype=torch.int32)
    _poison_unread(tape_state, tape_conv, rows, acc)

    kda_accept_reference(conv, state, rows, acc, tape_state, tape_conv)
    for b, (r, j) in enumerate(zip(rows.tolist(), accepted)):
        assert torch.equal(state[r], want_states[j][b]), (b, j)      # the state after tokens 0..j, exactly
        assert torch.equal(conv[r], want_convs[j][b]), (b, j)
    assert not state.isnan().any() and not conv.isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_shorter_step_in_a_longer_tape_and_steps_in_a_row(dtype):
    """Tapes sized for k = 7 serve a k = 3 step (entries past it stay NaN and unread); two verification
    steps with partial acceptance in a row equal single steps over the accepted tokens only."""
    B, T = 3, 4
    inp, kw, conv, state, rows, tape_state, tape_conv = _case(B, T, dtype, seed=31, tmax=8)
    ref_conv, ref_state = conv.clone(), state.clone()
    acc = torch.tensor([2, 0, 3], dtype=torch.int32)
    _verify(inp, kw, conv, state, rows, tape_state, tape_conv)
    assert tape_state[rows.long(), T:].isnan().all()                  # nothing written past the step's tokens
    _poison_unread(tape_state, tape_conv, rows, acc)
    kda_accept_reference(conv, state, rows, acc, tape_state, tape_conv)
    # the reference: per request, its accepted tokens as single steps (one request at a time)
    for b in range(B):
        one = rows[b:b + 1]
        for t in range(int(acc[b]) + 1):
            r = b * T + t
            kda_decode_reference(inp["mixed_qkv"][r:r + 1], ref_conv, inp["conv_weight"], inp["f"][r:r + 1],
                                 inp["A_log"], inp["dt_bias"], inp["beta_logit"][r:r + 1], inp["g_out"][r:r + 1],
                                 inp["norm_weight"], ref_state, one, **kw)
    # batch-of-one and batch-of-three single steps may sum in another order: equal to fp32 rounding
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    idx = rows.long()
    assert (state[idx] - ref_state[idx]).abs().max() <= tol * ref_state[idx].abs().max()
    assert (conv[idx].float() - ref_conv[idx].float()).abs().max() <= tol * ref_conv[idx].float().abs().max()

    # a second step from the accepted states, fully accepted
    inp2, *_ = _case(B, T, dtype, seed=32)
    want, want_convs, want_states = _single_steps(inp2, kw, conv, state, rows, T)
    got = _verify(inp2, kw, conv, state, rows, tape_state, tape_conv)
    kda_accept_reference(conv, state, rows, torch.full((B,), T - 1, dtype=torch.int32), tape_state, tape_conv)
    assert torch.equal(got.view(B, T, -1), want)
    assert torch.equal(state[idx], want_states[-1]) and torch.equal(conv[idx], want_convs[-1])


def test_accept_minus_one_leaves_the_row_and_padding_rows_are_harmless():
    B, T = 4, 3
    inp, kw, conv, state, rows, tape_state, tape_conv = _case(B, T, torch.float32, seed=5, pad=True)
    _, want_convs, want_states = _single_steps(inp, kw, conv, state, rows, T)
    conv0, state0 = conv.clone(), state.clone()
    _verify(inp, kw, conv, state, rows, tape_state, tape_conv)
    acc = torch.tensor([-1, 1, 2, 0], dtype=torch.int32)  # request 0 has nothing pending; request 3 is padding
    _poison_unread(tape_state, tape_conv, rows, acc)
    kda_accept_reference(conv, state, rows, acc, tape_state, tape_conv)
    r0 = int(rows[0])
    assert torch.equal(state[r0], state0[r0]) and torch.equal(conv[r0], conv0[r0])
    for b in (1, 2):
        r, j = int(rows[b]), int(acc[b])
        assert torch.equal(state[r], want_states[j][b]) and torch.equal(conv[r], want_convs[j][b])


@pytest.mark.parametrize("H,D,W,rank", [(3, 5, 2, 6), (1, 7, 3, 4), (5, 3, 5, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_heads_and_widths(H, D, W, rank, dtype):
    k, B = 3, 3
    T = 1 + k
    inp, kw, conv, state, rows, tape_state, tape_conv = _case(B, T, dtype, seed=H * 100 + D * 10 + W, H=H, D=D, W=W,
                                                              rank=rank)
    want, want_convs, want_states = _single_steps(inp, kw, conv, state, rows, T)
    got = _verify(inp, kw, conv, state, rows, tape_state, tape_conv)
    assert torch.equal(got.view(B, T, -1), want)
    acc = torch.tensor([0, 3, 2], dtype=torch.int32)
    _poison_unread(tape_state, tape_conv, rows, acc)
    kda_accept_reference(conv, state, rows, acc, tape_state, tape_conv)
    for b, (r, j) in enumerate(zip(rows.tolist(), acc.tolist())):
        assert torch.equal(state[r], want_states[j][b]) and torch.equal(conv[r], want_convs[j][b])


def test_misshaped_tapes_name_the_fix():
    inp, kw, conv, state, rows, tape_state, tape_conv = _case(2, 4, torch.float32, seed=1, tmax=2)
    with pytest.raises(UserError, match="most speculative tokens"):
        _verify(inp, kw, conv, state, rows, tape_state, tape_conv)
    inp, kw, conv, state, rows, tape_state, tape_conv = _case(2, 2, torch.float32, seed=1)
    with pytest.raises(UserError, match="request-major"):
        _verify({**inp, "mixed_qkv": inp["mixed_qkv"][:3]}, kw, conv, state, rows, tape_state, tape_conv)
    with pytest.raises(UserError, match="like the conv state"):
        _verify(inp, kw, conv, state, rows, tape_state, tape_conv.to(torch.bfloat16))


def test_families_have_their_references_registered():
    impls = get_registry().implementations
    assert impls.reference("attention.kda_verify").fn is kda_verify_reference
    assert impls.reference("attention.kda_accept").fn is kda_accept_reference


# ---------------------------------------------------------------------- the KDA piece in a verification step
HIDDEN = 40
ATTN = KDAAttentionSpec(num_heads=3, head_dim=8, conv_kernel=4, decay_rank=8, gate_lower_bound=-5.0)
PIECE_SPECIAL = {
    "A_log": lambda shape, g: torch.log(0.5 + 1.5 * torch.rand(shape, generator=g)),
    "dt_bias": lambda shape, g: -2.0 + 0.5 * torch.randn(shape, generator=g),
    **{f"{n}_conv": (lambda shape, g: torch.randn(shape, generator=g) / shape[-1] ** 0.5) for n in "qkv"},
}


def _model_spec() -> ModelSpec:
    return ModelSpec(name="piece-test", variant="tiny", hidden_size=HIDDEN, vocab_size=64, max_context=64,
                     layers=(LayerSpec(index=0, attention=ATTN, ffn=DenseMLPSpec(intermediate=32)),))


def _piece_states(piece, spec, dtype, g):
    """Random live states and NaN tapes for NUM_ROWS rows, as the piece declares them."""
    out = {}
    for d in piece.states(spec, 1):
        dt = torch.float32 if d.dtype == "float32" else dtype
        fill = torch.full if d.name.startswith("tape") else None
        out[d.name] = (fill((NUM_ROWS, *d.shape), float("nan"), dtype=dt) if fill
                       else (0.3 * torch.randn(NUM_ROWS, *d.shape, generator=g)).to(dt))
    return out


def _piece_step(piece, spec, w, states, h, *, rows, k=0, accepted=None, tp=1, rank=0, comm=None):
    rank_spec = spec.shard(tp) if tp > 1 else spec
    ops = bind(lambda b: piece.sites(b, rank_spec), dtype=h.dtype, rows=h.shape[0], tp=tp)
    meta = {"rows": rows} if accepted is None else {"rows": rows, "accepted": accepted}
    step = step_context(ops, spec, rows=h.shape[0], meta=meta, tp=tp, rank=rank, comm=comm)
    if k:
        step.spec_tokens = k  # the field a speculative program sets (NOTES_verify.md)
    return piece.forward(step, piece.arrange(w, step.rank_spec), states, h), ops


@pytest.mark.parametrize("dtype", DTYPES)
def test_piece_two_verification_steps_equal_single_steps_over_the_accepted_tokens(dtype):
    """Step 1 (nothing pending) and step 2 (accepting step 1's prefix first), then the accept of step 2's
    prefix: every output and the final states equal the piece's plain decode path run one request and
    one token at a time over exactly the accepted tokens (gemms over other row counts: to rounding)."""
    k, B = 3, 3
    T = 1 + k
    g = torch.Generator().manual_seed(77 + (dtype == torch.bfloat16))
    spec = _model_spec()
    piece = KDAAttention(ATTN, spec_tokens=k)
    w = random_weights(piece.weights(spec, 1), dtype, g, PIECE_SPECIAL)
    states = _piece_states(piece, spec, dtype, g)
    rows = torch.tensor([4, 1, 9], dtype=torch.int32)
    ref = {n: states[n].clone() for n in ("conv", "state")}
    h1, h2 = (torch.randn(B * T, HIDDEN, generator=g).to(dtype) for _ in range(2))
    acc1, acc2 = torch.tensor([1, 3, 0], dtype=torch.int32), torch.tensor([2, 0, 3], dtype=torch.int32)

    none = torch.full((B,), -1, dtype=torch.int32)
    got1, ops = _piece_step(piece, spec, w, states, h1, rows=rows, k=k, accepted=none)
    got2, _ = _piece_step(piece, spec, w, states, h2, rows=rows, k=k, accepted=acc1)
    assert dict(ops.calls) == {"kind/attn.in_proj": 1, "kind/attn.kda_accept": 1, "kind/attn.kda_verify": 1,
                               "kind/attn.o_proj": 1}
    kda_accept_reference(states["conv"], states["state"], rows, acc2, states["tape_state"], states["tape_conv"])

    for b in range(B):
        one = rows[b:b + 1]
        for step_h, got, keep in ((h1, got1, int(acc1[b])), (h2, got2, int(acc2[b]))):
            kept = None
            for t in range(T):
                r = b * T + t
                want, _ = _piece_step(piece, spec, w, ref, step_h[r:r + 1], rows=one)
                assert rel(got[r:r + 1], want) <= TOL[dtype], (b, t)
                if t == keep:
                    kept = {n: x.clone() for n, x in ref.items()}
            for n in ref:  # roll the reference back to the accepted token (this request's row only)
                ref[n][int(one)] = kept[n][int(one)]
    idx = rows.long()
    assert rel(states["state"][idx], ref["state"][idx]) <= TOL[dtype]
    assert rel(states["conv"][idx].float(), ref["conv"][idx].float()) <= TOL[dtype]


def test_piece_tp2_verification_ranks_sum_to_the_whole():
    """Each rank's shard of the weights and of the states (tapes included, by their declarations:
    heads, and q | k | v conv channels each on its own) gives a partial sum; the ranks' sum is the
    TP=1 output and their states are the TP=1 states' slices."""
    k, B, tp, dtype = 2, 2, 2, torch.float32
    T = 1 + k
    g = torch.Generator().manual_seed(21)
    a = KDAAttentionSpec(num_heads=4, head_dim=8, conv_kernel=4, decay_rank=8, gate_lower_bound=-5.0)
    spec = ModelSpec(name="piece-test", variant="tiny", hidden_size=HIDDEN, vocab_size=64, max_context=64,
                     layers=(LayerSpec(index=0, attention=a, ffn=DenseMLPSpec(intermediate=32)),))
    piece = KDAAttention(a, spec_tokens=k)
    w = random_weights(piece.weights(spec, 1), dtype, g, PIECE_SPECIAL)
    full = _piece_states(piece, spec, dtype, g)
    rows = torch.tensor([3, 7], dtype=torch.int32)
    hs = [torch.randn(B * T, HIDDEN, generator=g) for _ in range(2)]
    accs = [torch.full((B,), -1, dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32)]

    whole = {n: t.clone() for n, t in full.items()}
    want = [_piece_step(piece, spec, w, whole, h, rows=rows, k=k, accepted=acc)[0] for h, acc in zip(hs, accs)]
    decls_full = {d.name: d for d in piece.states(spec, 1)}

    def rank_states(r):
        out = {}
        for n, t in full.items():
            d = decls_full[n]
            parts = torch.split(t, list(d.parts), dim=1 + d.split) if d.parts else [t]
            out[n] = torch.cat([p.chunk(tp, dim=1 + d.split)[r] for p in parts], dim=1 + d.split).contiguous()
        return out

    def rank_body(r, comm):
        wr = {d.name: shard(d, w[d.name], r, tp) for d in piece.weights(spec, tp)}
        st = rank_states(r)
        outs = [_piece_step(piece, spec, wr, st, h, rows=rows, k=k, accepted=acc, tp=tp, rank=r, comm=comm)[0]
                for h, acc in zip(hs, accs)]
        return outs, st

    res = ThreadWorld(tp).run(rank_body)
    for i in range(2):
        assert rel(res[0][0][i] + res[1][0][i], want[i]) <= TOL[dtype]
    idx = rows.long()
    got_state = torch.cat([res[0][1]["state"], res[1][1]["state"]], dim=1)
    assert rel(got_state[idx], whole["state"][idx]) <= TOL[dtype]


def test_piece_declarations_with_and_without_speculation():
    spec = _model_spec()
    plain, verify = KDAAttention(ATTN), KDAAttention(ATTN, spec_tokens=7)
    assert [d.name for d in plain.states(spec, 1)] == ["conv", "state"]
    st = {d.name: d for d in verify.states(spec, 1)}
    hd = ATTN.num_heads * ATTN.head_dim
    assert st["tape_state"].shape == (8, ATTN.num_heads, 3, ATTN.head_dim) and st["tape_state"].dtype == "float32"
    assert st["tape_conv"].shape == (8, 3 * hd) and st["tape_conv"].parts == (hd, hd, hd)
    assert st["tape_state"].split == st["tape_conv"].split == 1 and st["tape_state"].kind == "rows"

    def fams(p):
        return {c.site.name: c.site.family
                for c in bind(lambda b: p.sites(b, spec), dtype=torch.float32, rows=8).plan.choices}

    assert set(fams(plain).values()) == {"gemm", "attention.kda"}
    assert fams(verify)["kind/attn.kda_verify"] == "attention.kda_verify"
    assert fams(verify)["kind/attn.kda_accept"] == "attention.kda_accept"


def test_piece_refuses_more_draft_tokens_than_its_tapes():
    spec = _model_spec()
    g = torch.Generator().manual_seed(3)
    piece = KDAAttention(ATTN, spec_tokens=1)
    w = random_weights(piece.weights(spec, 1), torch.float32, g, PIECE_SPECIAL)
    states = _piece_states(piece, spec, torch.float32, g)
    rows = torch.tensor([2, 3], dtype=torch.int32)
    with pytest.raises(UserError, match="spec_tokens >= 3"):
        _piece_step(piece, spec, w, states, torch.randn(8, HIDDEN, generator=g), rows=rows, k=3,
                    accepted=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(UserError, match="per request"):
        _piece_step(piece, spec, w, states, torch.randn(4, HIDDEN, generator=g), rows=rows.repeat(2), k=1,
                    accepted=torch.zeros(4, dtype=torch.int32))


# ---------------------------------------------------------------------- CUDA graphs (H200)
@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 7])
def test_verify_and_accept_capture_in_a_cuda_graph_without_host_syncs(k):
    """The references on CUDA: no host sync (sync debug mode 'error'), and a replayed graph of one
    accept (previous step) + one verification step equals the same calls run eagerly, bit for bit."""
    B, T = 8, 1 + k
    inp, kw, conv, state, rows, tape_state, tape_conv = _case(B, T, torch.bfloat16, seed=k, H=12, D=128, rank=128)
    dev = lambda t: t.cuda() if isinstance(t, torch.Tensor) else t  # noqa: E731
    inp, kw = {n: dev(t) for n, t in inp.items()}, {n: dev(t) for n, t in kw.items()}
    rows = rows.cuda()
    start = [t.cuda() for t in (conv, state, tape_state, tape_conv)]
    # a first verification step fills the tapes the accept of the captured step reads
    _verify(inp, kw, *start[:2], rows, *start[2:])
    accepted = torch.randint(0, T, (B,), dtype=torch.int32, device="cuda")

    def step(c, s, ts, tc):
        kda_accept_reference(c, s, rows, accepted, ts, tc)
        return _verify(inp, kw, c, s, rows, ts, tc)

    eager_bufs = [t.clone() for t in start]
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager_out = step(*eager_bufs)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    bufs = [t.clone() for t in start]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(*bufs)  # warm-up (allocator, lazy init) off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*bufs)
    for b, s0 in zip(bufs, start):  # undo the warm-up: the replay starts where the eager run did
        b.copy_(s0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_out)
    for got, want in zip(bufs, eager_bufs):  # tape rows of no request stay NaN in both
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
