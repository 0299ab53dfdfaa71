"""The plan picks one-shot vs two-stage by message size and names why (supports() reasons)."""

from __future__ import annotations

import pytest

from latency_specialized.kernels import allreduce_common as C
from latency_specialized.ops.registry import make_context


def _ctx(tokens, n=7168, world_size=8, arch="sm_90", dtype="bfloat16", **attrs):
    return make_context("allreduce", arch=arch, dtype=dtype, tokens=tokens, world_size=world_size, dims={"N": n},
                        attrs=attrs or None)


one_shot, two_stage = C.make_supports("one_shot"), C.make_supports("two_stage")
needs_cute = pytest.mark.skipif(C.cute_available() is not True, reason="nvidia-cutlass-dsl not installed")


@needs_cute
@pytest.mark.parametrize("tokens", [1, 2, 4, 8, 16])
def test_small_messages_go_one_shot(tokens):
    assert one_shot(_ctx(tokens)) is True
    assert "one-shot serves" in two_stage(_ctx(tokens))


@needs_cute
def test_large_messages_go_two_stage_with_reason():
    # 64 x 7168 bf16 = 896 KiB per rank
    assert two_stage(_ctx(64)) is True
    assert one_shot(_ctx(64)) == "message 896 KiB > one-shot limit 256 KiB at TP=8: two-stage serves"
    assert two_stage(_ctx(64, world_size=4)) is True  # 896 KiB > 512 KiB at TP=4


@needs_cute
@pytest.mark.parametrize("world_size", [4, 8])
def test_crossover_is_exactly_at_the_limit(world_size):
    limit = C.one_shot_limit(world_size)
    tokens = limit // (7168 * 2)
    ctx = lambda m: _ctx(m, world_size=world_size)  # noqa: E731
    assert one_shot(ctx(tokens)) is True and one_shot(ctx(tokens + 1)) is not True
    assert two_stage(ctx(tokens)) is not True and two_stage(ctx(tokens + 1)) is True


@needs_cute
def test_two_ranks_always_one_shot():
    assert one_shot(_ctx(64, world_size=2)) is True
    assert "one hop" in two_stage(_ctx(64, world_size=2))


@pytest.mark.parametrize("ctx,needle", [
    (_ctx(4, arch="cpu"), "symmetric-memory communicator"),
    (_ctx(4, arch="sm_80"), "needs sm_90+"),
    (_ctx(4, world_size=1), "world size 1"),
    (_ctx(4, world_size=16), "world size 16 > 8"),
    (_ctx(4, dtype="float16"), "use bfloat16 or float32"),
    (_ctx(4, n=7170), "multiple of 8"),
    (_ctx(4, comm="torch.distributed"), "no peer-mapped workspace"),
])
def test_refusals_name_the_reason(ctx, needle):
    for supports in (one_shot, two_stage):
        reason = supports(ctx)
        assert reason is not True and needle in reason


@needs_cute
def test_explain_plan_switches_algorithm_with_batch():
    from latency_specialized import hardware
    from latency_specialized.ops.plan import build_plan
    from latency_specialized.plugins import get_registry

    reg = get_registry()
    adapter = reg.adapter("kimi_k3")
    for batch in (1, 64):
        plan = build_plan(adapter, reg.implementations, hardware.for_arch("sm_90"), tp=8, batch=batch)
        ar = [c for c in plan.choices if c.site.family == "allreduce"]
        assert ar, "kimi_k3 has all-reduce sites at TP=8"
        for c in ar:
            msg = c.site.ctx.tokens * c.site.ctx.dim("N") * 2
            want = "allreduce.lamport_one_shot" if msg <= C.one_shot_limit(8) else "allreduce.two_stage"
            assert c.impl.name == want, (batch, c.site.name, msg)
        if batch == 64:  # the hidden-size sites (64 x 7168 bf16 = 896 KiB) are past the crossover
            assert any(c.impl.name == "allreduce.two_stage" for c in ar)


def test_cpu_plan_keeps_the_reference():
    from latency_specialized import hardware
    from latency_specialized.ops.plan import build_plan
    from latency_specialized.plugins import get_registry

    reg = get_registry()
    plan = build_plan(reg.adapter("kimi_k3"), reg.implementations, hardware.for_arch("cpu"), tp=8, batch=4)
    for c in plan.choices:
        if c.site.family == "allreduce":
            assert c.impl.name == "allreduce.reference"
            assert any(n == "allreduce.lamport_one_shot" for n, _ in c.refusals)


# --- the plan sees the communicator: every all-reduce site's context carries its kind -----------------

def _kimi_plan(arch="sm_90", tp=8, batch=4, **kw):
    from latency_specialized import hardware
    from latency_specialized.ops.plan import build_plan
    from latency_specialized.plugins import get_registry

    reg = get_registry()
    return build_plan(reg.adapter("kimi_k3"), reg.implementations, hardware.for_arch(arch), tp=tp, batch=batch, **kw)


def _allreduce_choices(plan):
    ar = [c for c in plan.choices if c.site.family == "allreduce"]
    assert ar, "kimi_k3 has all-reduce sites"
    return ar


def test_every_other_kind_is_refused_with_its_reason():
    from latency_specialized.comm import kinds

    want = {kinds.TORCH_DISTRIBUTED: "no peer-mapped workspace", kinds.EMULATED: "host memory (/dev/shm",
            kinds.LOCAL: "one rank", kinds.EXCLUDED: "communication excluded", "some-other": "some-other"}
    assert set(want) - {"some-other"} == set(kinds.KINDS) - {kinds.SYMMETRIC}
    for kind, needle in want.items():
        for supports in (one_shot, two_stage):
            reason = supports(_ctx(4, world_size=2, comm=kind))
            assert reason is not True and needle in reason, (kind, reason)


@needs_cute
def test_kernels_accept_the_symmetric_kind_of_comm_kinds():
    from latency_specialized.comm import kinds

    # the kernels compare against a literal (kernels do not import comm): it must be comm.kinds' name
    assert one_shot(_ctx(4, world_size=2, comm=kinds.SYMMETRIC)) is True
    assert two_stage(_ctx(64, comm=kinds.SYMMETRIC)) is True


def test_plan_with_torch_distributed_refuses_the_fused_kernels_and_explain_says_why():
    plan = _kimi_plan(comm="torch.distributed")
    assert plan.comm == "torch.distributed" and plan.to_dict()["comm"] == "torch.distributed"
    for c in _allreduce_choices(plan):
        assert c.site.ctx.attr("comm") == "torch.distributed"
        assert c.impl.name == "allreduce.reference"
        refused = dict(c.refusals)
        for name in ("allreduce.lamport_one_shot", "allreduce.two_stage"):
            assert "torch.distributed has no peer-mapped workspace" in refused[name], refused
    text = plan.to_text()
    assert "communicator torch.distributed" in text.splitlines()[0]
    assert "refused allreduce.lamport_one_shot: communicator torch.distributed has no peer-mapped workspace" in text
    assert "comm=torch.distributed" in text  # the site context as explain prints it
    # only communication sites carry the kind
    assert all(c.site.ctx.attr("comm") is None for c in plan.choices if c.site.family != "allreduce")


@needs_cute
@pytest.mark.parametrize("comm", [None, "symmetric-memory"])
def test_plan_for_symmetric_memory_picks_the_fused_kernels(comm):
    # None: build_plan's default on a GPU at TP > 1 is the symmetric-memory communicator
    for batch, want in ((1, {"allreduce.lamport_one_shot"}), (64, {"allreduce.two_stage"})):
        plan = _kimi_plan(batch=batch, comm=comm)
        assert plan.comm == "symmetric-memory"
        ar = _allreduce_choices(plan)
        assert {c.impl.name for c in ar} == want
        assert all(c.site.ctx.attr("comm") == "symmetric-memory" for c in ar)
        for c in ar:
            assert plan.runs_on(c, "symmetric-memory") is True
            assert "no peer-mapped workspace" in plan.runs_on(c, "torch.distributed")


def test_plan_defaults_per_arch_and_world():
    assert _kimi_plan(arch="cpu").comm == "torch.distributed"
    assert _kimi_plan(arch="sm_90", tp=1).comm == "local"
    assert _kimi_plan(arch="cpu", tp=1).comm == "local"


def test_plan_takes_the_communicator_object_and_checks_its_world():
    from latency_specialized.comm.base import ExcludedCommunicator
    from latency_specialized.errors import UserError

    plan = _kimi_plan(comm=ExcludedCommunicator(8))
    assert plan.comm == "excluded"
    for c in _allreduce_choices(plan):
        assert c.impl.name == "allreduce.reference"
        assert "communication excluded" in dict(c.refusals)["allreduce.lamport_one_shot"]
    with pytest.raises(UserError, match="TP=8 over a communicator of 4 rank"):
        _kimi_plan(comm=ExcludedCommunicator(4))
    with pytest.raises(UserError, match="communicator kind 'nccl'"):
        _kimi_plan(comm="nccl")


def test_kind_of_communicators():
    from latency_specialized.comm import kinds
    from latency_specialized.comm.base import ExcludedCommunicator, LocalCommunicator
    from latency_specialized.comm.symmetric import SymmetricMemoryCommunicator

    assert kinds.kind_of(None) == kinds.kind_of(LocalCommunicator()) == kinds.LOCAL
    assert kinds.kind_of(ExcludedCommunicator(2)) == kinds.EXCLUDED
    host = SymmetricMemoryCommunicator.single_process_world(2, hidden=64, dtype="float32", max_tokens=2,
                                                            device="cpu")
    assert {kinds.kind_of(c) for c in host} == {kinds.EMULATED}
    assert kinds.default_kind("sm_100", 4) == kinds.SYMMETRIC
    assert kinds.default_kind("cpu", 4) == kinds.TORCH_DISTRIBUTED
