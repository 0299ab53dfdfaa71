"""kernels.kda_verify_triton on the CPU: the Triton interpreter against the torch references, errors, the
sm_90 build (no spill, no FMA contraction).

The kernel cases (marker ``interpreter_case``) run in a child process started with ``TRITON_INTERPRET=1``
(``test_kernel_cases_under_the_interpreter``; why: ``tests/interpret.py``). Every case: fresh random inputs,
requests in scattered (non-identity) state rows, every ``torch.empty`` of the run filled with NaN (``out``
and the norm workspace must be written before they are read) and the tapes NaN before the step:

* verify: every output and every tape entry ``[state_idx[b], :T]`` written, finite and equal to the
  reference's to a per-dtype tolerance (the kernel's sums run in its own order; bf16: one rounding of a
  conv output may flip an ulp); ``tape_conv`` (a cast of the inputs) exactly; nothing else written (the
  live states, other rows and tokens past T unchanged / NaN). fp32 and bf16, H = 1 / 2, D = 16 / 32,
  B = 1 / 3, k = 0 / 3 / 7, with and without ``f_b_weight``, conv widths 2..4, the fused-norm and the
  split (second launch) paths, inputs that are column slices of a wider projection, tapes longer than T;
* accept: ``accepted`` -1, 0, middle, k; on the kernel's own tape and on the reference's, the state
  equals the reference accept on the same tape bit for bit, and the conv state exactly; tape entries
  past each ``j`` are NaN (never read);
* a verification step then an accept equals ``j + 1`` single ``attention.kda`` reference steps (fp32,
  a tolerance: the kernel sums in another order);
* the variants (``VerifyConfig``: hoist_fb, prologue, both; norm in the kernel and split; accept blocks apart
  from the verify's) and every ``candidate_configs`` entry the bench sweeps, as the verify and accept cases.

Not interpreted: the candidates' validity, config errors, and the sm_90 ptxas build (no spill, no FMA) of the
default launches and of every candidate at the bench's shapes.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.attention.kda import kda_decode_reference
from latency_specialized.ops.attention.kda_verify import kda_accept_reference, kda_verify_reference, tape_shapes

from tests.interpret import run_interpreted
from tests.ops.kda_verify_cases import TOL, assert_written_close, verify_args

_HAVE_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not _HAVE_TRITON, reason="needs triton (its interpreter runs the kernels on the CPU)")
interpreted = pytest.mark.interpreter_case
"""Needs TRITON_INTERPRET=1 from the process start: collected only there (the driver below runs these)."""

NUM_ROWS = 9  # state rows


@pytest.mark.interpreter_driver
def test_kernel_cases_under_the_interpreter():
    run_interpreted(__file__, min_passed=36)


@pytest.fixture
def kt():
    from latency_specialized.kernels import kda_verify_triton

    return kda_verify_triton


def _case(seed, B, T, dtype, *, H=2, D=16, W=4, rank=8, fb=True, tmax=None, wide=False, idx64=False):
    """Inputs of one verification step of B requests x T tokens; NaN tapes for ``tmax`` tokens."""
    g = torch.Generator().manual_seed(seed)
    hd = H * D
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    rows = torch.randperm(NUM_ROWS, generator=g)[:B]
    R = B * T
    fcols = rank if fb else hd
    if wide:  # q|k|v | g_out | f | beta column slices of one projection, as the KDA piece passes them
        y = rnd(R, 3 * hd + hd + fcols + H + 5).to(dtype)
        mixed, g_out = y[:, :3 * hd], y[:, 3 * hd:4 * hd]
        f, beta = y[:, 4 * hd:4 * hd + fcols], y[:, 4 * hd + fcols:4 * hd + fcols + H]
    else:
        mixed, g_out, f, beta = rnd(R, 3 * hd).to(dtype), rnd(R, hd).to(dtype), rnd(R, fcols).to(dtype), \
            rnd(R, H).to(dtype)
    inp = dict(mixed_qkv=mixed, conv_weight=rnd(3 * hd, W) / W ** 0.5, f=f,
               A_log=torch.log(0.5 + 1.5 * torch.rand(H, generator=g)), dt_bias=-2.0 + 0.5 * rnd(hd),
               beta_logit=beta, g_out=g_out, norm_weight=1.0 + 0.1 * rnd(D))
    kw = dict(num_heads=H, eps=1e-5, gate_lower_bound=-5.0,
              f_b_weight=(rnd(hd, rank) / rank ** 0.5).to(dtype) if fb else None)
    conv = rnd(NUM_ROWS, 3 * hd, W - 1).to(dtype)
    state = 0.3 * rnd(NUM_ROWS, H, D, D)
    ts, tc = tape_shapes(H, D, (tmax or T) - 1)
    tape_state = torch.full((NUM_ROWS, *ts), float("nan"))
    tape_conv = torch.full((NUM_ROWS, *tc), float("nan"), dtype=dtype)
    return inp, kw, conv, state, rows.to(torch.int64 if idx64 else torch.int32), tape_state, tape_conv


def _verify_both(kt, case, config=None):
    """Reference and kernel (launched as ``config`` says; None: the default) on the same inputs (separate NaN
    tapes); checks; returns both tapes."""
    inp, kw, conv, state, rows, tape_state, tape_conv = case
    dtype, B, T = inp["mixed_qkv"].dtype, rows.shape[0], inp["mixed_qkv"].shape[0] // rows.shape[0]
    conv0, state0 = conv.clone(), state.clone()
    ref_ts, ref_tc = tape_state.clone(), tape_conv.clone()
    want = kda_verify_reference(*verify_args(inp, conv, state, rows, ref_ts, ref_tc), **kw)
    got = kt.kda_verify_triton_with(config, *verify_args(inp, conv, state, rows, tape_state, tape_conv), **kw)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOL[dtype]
    assert_written_close(got, want, tol["out"], "out")
    idx = rows.long()
    for p, name in enumerate(("k", "exp(g)", "v'")):
        assert_written_close(tape_state[idx, :T, :, p], ref_ts[idx, :T, :, p], tol["tape"], f"tape_state {name}")
    assert torch.equal(tape_conv[idx, :T], ref_tc[idx, :T]), "tape_conv: the conv inputs, as they are"
    others = [r for r in range(NUM_ROWS) if r not in idx.tolist()]
    assert tape_state[others].isnan().all() and tape_conv[others].isnan().all(), "a row of another sequence written"
    assert tape_state[idx, T:].isnan().all() and tape_conv[idx, T:].isnan().all(), "a token past T written"
    assert torch.equal(conv, conv0) and torch.equal(state, state0), "the live states must stay as they were"
    return (tape_state, tape_conv), (ref_ts, ref_tc)


VERIFY = [  # (B, k, H, D, fb)
    (1, 0, 2, 16, True), (3, 3, 2, 32, True), (3, 7, 2, 16, False), (1, 7, 1, 32, True), (3, 0, 1, 32, False),
]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,k,H,D,fb", VERIFY)
def test_verify_matches_reference(kt, poisoned, dtype, B, k, H, D, fb):
    _verify_both(kt, _case(1000 * B + 100 * k + D + fb, B, 1 + k, dtype, H=H, D=D, fb=fb))


@interpreted
@pytest.mark.parametrize("bv", [32, 8], ids=["fused_norm", "split_rows"])
def test_verify_fused_norm_and_split_paths(kt, poisoned, monkeypatch, bv):
    """D = 32 as one program per head (the norm in the kernel) and as 4 value-row slices of 8 (o to the
    fp32 workspace, the second launch normalises)."""
    monkeypatch.setattr(kt, "choose_blocks", lambda B, H, D: (bv, 1))
    _verify_both(kt, _case(77 + bv, 3, 4, torch.float32, D=32))
    _verify_both(kt, _case(78 + bv, 1, 8, torch.bfloat16, D=32, fb=False))


@interpreted
@pytest.mark.parametrize("W", [2, 3])
def test_verify_narrow_convs(kt, poisoned, W):
    _verify_both(kt, _case(300 + W, 3, 4, torch.float32, W=W))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_verify_strided_inputs_int64_rows_long_tape(kt, poisoned, dtype):
    """Column slices of one projection (row stride > width), int64 state rows, tapes for k = 7 serving k = 3."""
    _verify_both(kt, _case(41, 3, 4, dtype, D=32, wide=True, idx64=True, tmax=8))


def _accept_both(kt, conv, state, rows, acc, tapes, config=None):
    """Reference and kernel accept on copies of the live states and the same tape: equal bit for bit."""
    c_ref, s_ref, c_got, s_got = conv.clone(), state.clone(), conv.clone(), state.clone()
    kda_accept_reference(c_ref, s_ref, rows, acc, *tapes)
    kt.kda_accept_triton_with(config, c_got, s_got, rows, acc, *tapes)
    assert not s_got.isnan().any() and not c_got.isnan().any(), "the accept read a tape entry past j"
    assert torch.equal(s_got, s_ref), (s_got - s_ref).abs().max()
    assert torch.equal(c_got, c_ref)
    for b, j in enumerate(acc.tolist()):
        if j < 0:
            r = int(rows[b])
            assert torch.equal(s_got[r], state[r]) and torch.equal(c_got[r], conv[r]), "accepted -1 changed the row"
    return c_got, s_got


def _poison_unread(tapes, rows, acc):
    for r, j in zip(rows.tolist(), acc.tolist()):
        for t in tapes:
            t[r, j + 1:] = float("nan")


ACCEPT = [(7, [-1, 0, 3, 7]), (3, [3, -1, 1]), (0, [0, -1])]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k,accepted", ACCEPT)
def test_accept_is_the_reference_replay_bit_for_bit(kt, poisoned, dtype, k, accepted):
    B, T = len(accepted), 1 + k
    inp, kw, conv, state, rows, tape_state, tape_conv = case = _case(500 + 10 * k + B, B, T, dtype, D=32)
    mine, ref = _verify_both(kt, case)
    acc = torch.tensor(accepted, dtype=torch.int32)
    for tapes in (mine, ref):
        _poison_unread(tapes, rows, acc)
        _accept_both(kt, conv, state, rows, acc, tapes)


@interpreted
def test_accept_split_rows_int64(kt, poisoned, monkeypatch):
    monkeypatch.setattr(kt, "choose_blocks", lambda B, H, D: (8, 1))
    inp, kw, conv, state, rows, tape_state, tape_conv = _case(61, 3, 8, torch.float32, D=32, idx64=True)
    tapes = (tape_state, tape_conv)
    kda_verify_reference(*verify_args(inp, conv, state, rows, *tapes), **kw)
    acc = torch.tensor([5, -1, 7], dtype=torch.int64)
    _poison_unread(tapes, rows, acc)
    _accept_both(kt, conv, state, rows, acc, tapes)


@interpreted
@pytest.mark.parametrize("k,accepted", [(3, [3, 0, 2]), (7, [5, 7])])
def test_verify_then_accept_equals_single_steps(kt, poisoned, k, accepted):
    """fp32: the kernels' verify + accept leave the states ``j + 1`` single reference steps leave, and each
    accepted token's output is that step's (to fp32 rounding: the kernel sums in another order)."""
    B, T = len(accepted), 1 + k
    inp, kw, conv, state, rows, tape_state, tape_conv = _case(800 + k, B, T, torch.float32, D=32)
    ref_conv, ref_state = conv.clone(), state.clone()
    got = kt.kda_verify_triton(*verify_args(inp, conv, state, rows, tape_state, tape_conv), **kw).view(B, T, -1)
    acc = torch.tensor(accepted, dtype=torch.int32)
    kt.kda_accept_triton(conv, state, rows, acc, tape_state, tape_conv)
    per = lambda name, t: inp[name][t::T].contiguous()  # noqa: E731 - token t of every request
    for t in range(T):
        live = torch.tensor([b for b in range(B) if accepted[b] >= t])
        if not live.numel():
            break
        rr = lambda name: per(name, t)[live]  # noqa: E731
        o = kda_decode_reference(rr("mixed_qkv"), ref_conv, inp["conv_weight"], rr("f"), inp["A_log"],
                                 inp["dt_bias"], rr("beta_logit"), rr("g_out"), inp["norm_weight"], ref_state,
                                 rows[live], **kw)
        torch.testing.assert_close(got[live, t], o, rtol=1e-4, atol=1e-5)
    idx = rows.long()
    torch.testing.assert_close(state[idx], ref_state[idx], rtol=1e-5, atol=1e-5)
    assert torch.equal(conv[idx], ref_conv[idx])


def _config(kt, kind, bv, nw=1, **accept):
    return kt.VerifyConfig(bv, nw, hoist_fb=kind in ("hoist_fb", "both"),
                           prologue=kind in ("prologue", "both", "split"), prep_split=kind == "split", **accept)


VARIANTS = [  # (kind, block_v, B, k, dtype, case options): each variant at D = 32, norm in the kernel or split
    ("hoist_fb", 32, 3, 3, torch.bfloat16, dict()),
    ("hoist_fb", 8, 1, 7, torch.float32, dict(W=3)),
    ("hoist_fb", 16, 3, 3, torch.float32, dict(fb=False)),            # no gemm to hoist: the fused kernel
    ("prologue", 32, 3, 7, torch.float32, dict(W=3, H=1)),
    ("prologue", 8, 3, 0, torch.bfloat16, dict()),
    ("prologue", 16, 3, 3, torch.bfloat16, dict(fb=False, W=2, wide=True, idx64=True, tmax=8)),
    ("prologue", 16, 1, 7, torch.float32, dict(rank=20)),               # a rank that is no power of two
    ("both", 8, 3, 3, torch.float32, dict()),
    ("split", 16, 3, 3, torch.bfloat16, dict(fb=False, W=2, wide=True, idx64=True, tmax=8)),   # prologue split
    ("split", 32, 1, 7, torch.float32, dict(rank=20, W=3)),
]


@interpreted
@pytest.mark.parametrize("kind,bv,B,k,dtype,opts", VARIANTS,
                         ids=[f"{v[0]}-bv{v[1]}-B{v[2]}-k{v[3]}-{str(v[4])[6:]}-{i}" for i, v in enumerate(VARIANTS)])
def test_verify_variants_match_reference_and_accept_replays_them(kt, poisoned, kind, bv, B, k, dtype, opts):
    """Each variant's outputs and tapes against the reference; then the accept of its own tape (at other
    blocks than the verify's) equals the reference replay of that tape bit for bit."""
    cfg = _config(kt, kind, bv, accept_block_v=max(8, bv // 2), accept_warps=1)
    case = _case(900 + 10 * bv + B + k, B, 1 + k, dtype, D=32, **opts)
    inp, kw, conv, state, rows, tape_state, tape_conv = case
    mine, _ = _verify_both(kt, case, cfg)
    acc = torch.tensor([k, -1, k // 2][:B], dtype=torch.int32)
    _poison_unread(mine, rows, acc)
    _accept_both(kt, conv, state, rows, acc, mine, cfg)


@interpreted
def test_every_candidate_config_matches_reference(kt, poisoned):
    """What the bench sweeps, at a small odd shape: every candidate of B = 3 requests of 2 heads of 32 (fp32: bf16's
    one-ulp flips of a conv output are the variants cases' business, on seeds checked not to flip)."""
    configs = kt.candidate_configs(3, 2, 32)
    assert {c.prologue for c in configs} == {False, True} and any(c.hoist_fb for c in configs)
    assert {c.accept_unroll for c in configs} == {False, True}   # the accept's loop beside its unrolled replay
    assert {c.prep_split for c in configs} == {False, True}
    for i, cfg in enumerate(configs):
        case = _case(950 + i, 3, 4, torch.float32, D=32)
        inp, kw, conv, state, rows, tape_state, tape_conv = case
        mine, _ = _verify_both(kt, case, cfg)
        acc = torch.tensor([3, 0, -1], dtype=torch.int32)
        _poison_unread(mine, rows, acc)
        _accept_both(kt, conv, state, rows, acc, mine, cfg)


# ------------------------------------------------------------------ not interpreted
def test_same_signatures_as_the_references(kt):
    for mine, ref in ((kt.kda_verify_triton, kda_verify_reference), (kt.kda_accept_triton, kda_accept_reference)):
        assert inspect.signature(mine) == inspect.signature(ref), mine.__name__


def test_registered_and_chosen_for_kimi_verification_steps_on_hopper(kt):
    """Registered after the H200 run (session 25: GPU tests pass, 19-27x the torch references): a Kimi K3
    verification plan on sm_90 takes both kernels; on the CPU the references serve and the refusal says why;
    head dims and conv widths the kernels do not build are refused by name."""
    from latency_specialized import hardware
    from latency_specialized.contract import make_context
    from latency_specialized.ops.plan import build_plan
    from latency_specialized.plugins import get_registry
    from latency_specialized.runtime.harness import SpecBoundAdapter

    reg = get_registry()
    names = {i.name for i in reg.implementations}
    assert {kt.NAME, kt.ACCEPT_NAME} <= names
    adapter = reg.adapter("kimi_k3")
    bound = SpecBoundAdapter(adapter, adapter.spec("full").with_spec_tokens(7))
    for arch, want in (("sm_90", (kt.NAME, kt.ACCEPT_NAME)),
                       ("cpu", ("attention.kda_verify.reference", "attention.kda_accept.reference"))):
        plan = build_plan(bound, reg.implementations, hardware.for_arch(arch), tp=8, batch=1, spec_tokens=7)
        got = {c.site.name.rsplit("/", 1)[-1]: c.impl.name for c in plan.choices
               if c.site.family in ("attention.kda_verify", "attention.kda_accept")}
        assert set(got.values()) == set(want), (arch, got)
        if arch == "cpu":
            c = next(c for c in plan.choices if c.site.family == "attention.kda_verify")
            assert any(n == kt.NAME and "CUDA GPUs" in why for n, why in c.refusals)
    impl = next(i for i in reg.implementations if i.name == kt.NAME)
    ctx = lambda **d: make_context("attention.kda_verify", arch="sm_90", dtype="bfloat16", tokens=8,  # noqa: E731
                                   dims=d)
    assert impl.supports(ctx(heads=4, head_dim=128, conv=4)) is True
    assert "power of two" in impl.supports(ctx(heads=4, head_dim=96, conv=4))
    assert "power of two in [16, 128]" in impl.supports(ctx(heads=4, head_dim=256, conv=4))
    assert "conv width 5" in impl.supports(ctx(heads=4, head_dim=128, conv=5))


def test_block_choice_is_static_and_pow2(kt):
    for B in (1, 2, 3, 8, 16, 64):
        for H, D in ((4, 128), (2, 16), (2, 32), (8, 64)):
            bv, nw = kt.choose_blocks(B, H, D)
            assert bv & (bv - 1) == 0 and D % bv == 0 and kt.MIN_BLOCK_V <= bv <= kt.MAX_BLOCK_V or bv == D < 16
            assert nw in (1, 2, 4, 8)
    assert kt.choose_blocks(1, 4, 128) == (16, 2)      # B = 1 at Kimi TP8: 32 programs, not 4
    assert kt.choose_blocks(64, 4, 128) == (64, 8)


def test_candidate_configs_default_first_unique_and_valid(kt):
    for B in (1, 3, 8, 64):
        for H, D in ((12, 128), (4, 128), (2, 16), (2, 32)):
            configs = kt.candidate_configs(B, H, D)
            assert configs[0] == kt.default_config(B, H, D) and configs[0].prologue
            assert kt.VerifyConfig(*kt.choose_blocks(B, H, D)) in configs   # the fused kernel stays in the sweep
            assert 2 <= len(configs) <= 10 and len(set(configs)) == len(configs)
            assert len({c.name for c in configs}) == len(configs)
            for c in configs:
                assert kt._resolve(c, B, H, D) is c


def test_default_is_the_measured_pick(kt):
    """The H200 sweep at Kimi K3 TP8 shapes (H = 12, D = 128; NOTES_verify.md): the prologue form at 16 rows x 4
    warps for 1 request (the prologue split four ways), 32 x 4 with the accept at 32 x 4 from 8; never wider than
    a narrow head."""
    assert kt.default_config(1, 12, 128) == kt.VerifyConfig(16, 4, prologue=True, prep_split=True)
    assert kt.default_config(8, 12, 128) == kt.default_config(64, 12, 128) == kt.VerifyConfig(
        32, 4, prologue=True, prep_split=True, accept_block_v=32, accept_warps=4)
    assert kt.default_config(8, 2, 16) == kt.VerifyConfig(16, 4, prologue=True, prep_split=True, accept_block_v=16,
                                                         accept_warps=4)


def test_config_errors_name_the_fix(kt):
    inp, kw, conv, state, rows, tape_state, tape_conv = _case(4, 2, 3, torch.float32)
    args = verify_args(inp, conv, state, rows, tape_state, tape_conv)
    for bad in (kt.VerifyConfig(12, 1), kt.VerifyConfig(32, 1), kt.VerifyConfig(16, 3),
                kt.VerifyConfig(16, 2, accept_block_v=8)):
        with pytest.raises(UserError, match="block_v a power of two dividing head_dim 16"):
            kt.kda_verify_triton_with(bad, *args, **kw)
        with pytest.raises(UserError, match="block_v a power of two dividing head_dim 16"):
            kt.kda_accept_triton_with(bad, conv, state, rows, rows, tape_state, tape_conv)


def test_errors_name_the_fix(kt):
    inp, kw, conv, state, rows, tape_state, tape_conv = _case(3, 2, 3, torch.float32)
    ok = verify_args(inp, conv, state, rows, tape_state, tape_conv)

    def call(i, v, **over):
        a = list(ok)
        a[i] = v
        kt.kda_verify_triton(*a, **{**kw, **over})

    with pytest.raises(UserError, match="1 \\+ k rows per request"):
        call(0, inp["mixed_qkv"][:5])
    with pytest.raises(UserError, match="fp32"):
        call(11, tape_state.double())
    with pytest.raises(UserError, match="like the conv state"):
        call(12, tape_conv.bfloat16())
    with pytest.raises(UserError, match="tapes hold 3"):
        call(0, torch.cat([inp["mixed_qkv"], inp["mixed_qkv"]]))
    with pytest.raises(UserError, match="num_heads"):
        call(0, inp["mixed_qkv"], num_heads=4)
    with pytest.raises(UserError, match="unit column stride"):
        call(6, inp["g_out"].t().contiguous().t())
    with pytest.raises(UserError, match="f_b_proj"):
        call(0, inp["mixed_qkv"], f_b_weight=kw["f_b_weight"][:5])
    with pytest.raises(UserError, match="conv width"):
        call(1, torch.zeros(NUM_ROWS, conv.shape[1], 4))
    with pytest.raises(UserError, match="power of two"):
        kt.kda_accept_triton(conv[:, :, :], torch.zeros(NUM_ROWS, 2, 12, 12), rows, rows, tape_state, tape_conv)
    with pytest.raises(UserError, match="one per request"):
        kt.kda_accept_triton(conv, state, rows, rows[:1], tape_state, tape_conv)
    with pytest.raises(UserError, match="int32"):
        kt.kda_accept_triton(conv, state, rows, rows.float(), tape_state, tape_conv)


def _kimi_launches(kt, B, *, fb=True, dtype=torch.bfloat16, H=4, config=None):
    """The launches both wrappers make under ``config`` at a Kimi K3 rank (D = 128, W = 4, Rk = 128, k = 7; H = 12
    at TP8 as the bench and the GPU tests run it, 4 the shape ``choose_blocks``' docstring works through)."""
    from tests.triton_offline import recorded_launches

    D, W, rk, T = 128, 4, 128, 8
    hd, R, NR = H * D, B * T, B + 1
    z = torch.zeros
    with recorded_launches() as launches:
        kt.kda_verify_triton_with(config, z(R, 3 * hd, dtype=dtype), z(NR, 3 * hd, W - 1, dtype=dtype), z(3 * hd, W),
                             z(R, rk if fb else hd, dtype=dtype), z(H), z(hd), z(R, H, dtype=dtype),
                             z(R, hd, dtype=dtype), z(D), z(NR, H, D, D), torch.arange(B, dtype=torch.int32),
                             z(NR, T, H, 3, D), z(NR, T, 3 * hd, dtype=dtype), num_heads=H,
                             f_b_weight=z(hd, rk, dtype=dtype) if fb else None)
        kt.kda_accept_triton_with(config, z(NR, 3 * hd, W - 1, dtype=dtype), z(NR, H, D, D),
                                  torch.arange(B, dtype=torch.int32), z(B, dtype=torch.int32), z(NR, T, H, 3, D),
                                  z(NR, T, 3 * hd, dtype=dtype))
    return launches


def test_hopper_build_spills_nothing_and_contracts_no_fma(kt):
    """The sm_90 build through ptxas of the default launches at H = 4 (B = 1, 8, 64: value-row splits 8, 4, 2)
    and of every candidate config at the bench's H = 12 (B = 1, 8, 64): no spill, and no ``fma`` in the PTX
    (the launches pass ``enable_fp_fusion=False``: the accept's replay must round like the reference's two
    operations, and the verify's state update like the accept's). Needs a process that is not interpreting."""
    import os
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from tests.triton_offline import _signature

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("compiles only where triton was imported without the interpreter")
    done = set()
    runs = [(B, 4, None) for B in (1, 8, 64)]
    runs += [(B, 12, c) for B in (1, 8, 64) for c in kt.candidate_configs(B, 12, 128)]
    for B, H, config in runs:
        launches = _kimi_launches(kt, B, H=H, config=config)
        if config is None:   # the default: the prologue form (state-free work first, then the delta rule)
            assert [fn.fn.__name__ for fn, _, _ in launches] == ["kda_verify_prep_kernel", "kda_verify_rec_kernel",
                                                                "kda_out_norm_kernel", "kda_accept_kernel"]
        for fn, args, kw in launches:
            assert kw["enable_fp_fusion"] is False
            sig, const = _signature(fn, args, {k: v for k, v in kw.items() if k != "enable_fp_fusion"})
            key = (fn.fn.__name__, tuple(sorted(const.items())), kw["num_warps"])
            if key in done:
                continue
            done.add(key)
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": kw["num_warps"], "enable_fp_fusion": False})
            ptx = k.asm["ptx"]
            assert "fma." not in ptx, (B, config, fn.fn.__name__)
            with tempfile.TemporaryDirectory() as tmp:
                src = os.path.join(tmp, "k.ptx")
                with open(src, "w") as f:
                    f.write(ptx)
                log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", src, "-o", src + ".o"],
                                     capture_output=True, text=True, check=True).stderr
            assert "0 bytes spill stores, 0 bytes spill loads" in log, (B, config, fn.fn.__name__, log)
