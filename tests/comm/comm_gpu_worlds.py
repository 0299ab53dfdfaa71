"""Per-rank bodies of the GPU comm tests: W processes share CUDA devices through CUDA IPC.

On the one-H200 test machine every rank runs on cuda:0 (contexts time-slice); on a multi-GPU
machine rank r uses cuda:(r % device_count). The reference runs on CPU through the gloo group
(NCCL refuses two ranks on one GPU). Every check is recorded, never raised, so that all ranks
keep issuing the same sequence of collective calls; the parent asserts on the report.
"""

from __future__ import annotations

import random
import time

import torch

from comm_worlds import check_close, make_call, same_on_all_ranks

EPS = 1e-5
ALGOS = ("one_shot", "two_stage")
SIDE_GEMM = 2048
"""Side-stream GEMM size: a few hundred microseconds each on the H200, kept queued during stress."""


def _fns():
    from latency_specialized.kernels.allreduce_lamport import allreduce_lamport
    from latency_specialized.kernels.allreduce_two_stage import allreduce_two_stage

    return {"one_shot": allreduce_lamport, "two_stage": allreduce_two_stage}


def _record(rep: dict, what: str, fn) -> None:
    try:
        fn()
    except AssertionError as e:
        rep["errors"].append(f"{what}: {e}")


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Exact int64 fingerprint of ``t``'s bits (position-weighted), computed on the device."""
    b = t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).reshape(-1).to(torch.int64)
    w = torch.arange(1, b.numel() + 1, device=t.device, dtype=torch.int64) % 65521
    return (b * w).sum()


def _violation(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    """max(|got - want| - atol - rtol |want|) on the device (> 0: out of tolerance; NaN counts)."""
    d = (got.float() - want.float()).abs() - atol - rtol * want.float().abs()
    return torch.nan_to_num(d, nan=1e30).max()


def _expected(partial, residual, weight, zc, ref_comm):
    from latency_specialized.ops.allreduce import allreduce_residual_rmsnorm_reference as reference

    return reference(partial, residual, weight, EPS, comm=ref_comm, zero_centered=zc)


def correctness(comm, dtype: str, n: int, Ms, seed: int, rank: int, ref_comm, rep: dict) -> int:
    """Every (M, algorithm) once with fresh spiky inputs, NaN-poisoned outputs; + zc and no-norm."""
    tdt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    dev = comm.device
    cases = [(M, a, "norm") for M in Ms for a in ALGOS] + [(3, a, v) for a in ALGOS for v in ("zc", "no_norm")]
    for i, (M, algo, variant) in enumerate(cases):
        partial, residual, weight = make_call(seed + i, rank, M, n, tdt)
        w = None if variant == "no_norm" else weight
        zc = variant == "zc"
        y_ref, h_ref = _expected(partial, residual, w, zc, ref_comm)
        out = (torch.full((M, n), float("nan"), dtype=tdt, device=dev),
               torch.full((M, n), float("nan"), dtype=tdt, device=dev))
        y, h = _fns()[algo](partial.to(dev), residual.to(dev), None if w is None else w.to(dev), EPS, comm=comm,
                            zero_centered=zc, out=out)
        torch.cuda.synchronize()
        what = f"{dtype} N={n} M={M} {algo} {variant}"
        _record(rep, what + " residual_out", lambda: check_close(h.cpu(), h_ref, dtype, what))
        if w is not None:
            _record(rep, what + " normed", lambda: check_close(y.cpu(), y_ref, dtype, what))
            rep["identical"] &= same_on_all_ranks(y)
        else:
            rep["identical"] &= y is None
        rep["identical"] &= same_on_all_ranks(h)
        rep["cases"] += 1
    return len(cases)


def _input_sets(comm, n: int, Ms, sets: int, seed: int, rank: int, ref_comm) -> dict:
    """{(M, s): (partial, residual, weight, y_expected, h_expected)} on the device."""
    dev, out = comm.device, {}
    for M in Ms:
        for s in range(sets):
            p, r, w = make_call(seed + 97 * M + s, rank, M, n, torch.bfloat16)
            y, h = _expected(p, r, w, False, ref_comm)
            out[(M, s)] = tuple(t.to(dev) for t in (p, r, w, y, h))
    return out


def stress(comm, n: int, calls: int, seed: int, rank: int, ref_comm, rep: dict) -> int:
    """``calls`` back-to-back calls (random M, algorithm, input set; no host sync) while a side
    stream keeps GEMMs running; every call's outputs are checked on the device against the
    reference and fingerprinted for the cross-rank bit comparison."""
    Ms, sets = (1, 7, 64), 3
    data = _input_sets(comm, n, Ms, sets, seed, rank, ref_comm)
    plan = random.Random(seed)  # identical call sequence on every rank
    fns = _fns()
    viol = torch.empty(calls, dtype=torch.float32, device=comm.device)
    fp = torch.empty(calls, dtype=torch.int64, device=comm.device)
    side = torch.cuda.Stream()
    a = torch.randn(SIDE_GEMM, SIDE_GEMM, device=comm.device, dtype=torch.bfloat16)
    side_gemms = 0
    side.wait_stream(torch.cuda.current_stream())  # `a` was made on the main stream
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(calls):
        M, algo, s = plan.choice(Ms), plan.choice(ALGOS), plan.randrange(sets)
        if i % 25 == 0:  # keep the side stream busy the whole time
            with torch.cuda.stream(side):
                for _ in range(8):
                    a = torch.tanh(a @ a * 1e-2)
                    side_gemms += 1
        p, r, w, y_exp, h_exp = data[(M, s)]
        y, h = fns[algo](p, r, w, EPS, comm=comm)
        viol[i] = torch.maximum(_violation(h, h_exp, 1.6e-2, 1e-2), _violation(y, y_exp, 1.6e-2, 1e-2))
        fp[i] = _fingerprint(h) * 3 + _fingerprint(y)
    torch.cuda.synchronize()
    side.synchronize()
    elapsed = time.perf_counter() - t0
    worst = viol.max().item()
    bad = int((viol > 0).sum().item())
    if bad:
        rep["errors"].append(f"stress: {bad} of {calls} calls out of tolerance (worst excess {worst:.3g}); "
                             f"first at call {int((viol > 0).nonzero()[0].item())}")
    rep["identical"] &= same_on_all_ranks(fp)
    rep["stress"] = {"calls": calls, "seconds": elapsed, "us_per_call": 1e6 * elapsed / calls,
                     "side_stream_gemms": side_gemms, "bad_calls": bad}
    return calls


def graph(comm, n: int, replays: int, seed: int, rank: int, ref_comm, rep: dict) -> int:
    """Capture 4 calls (both algorithms, several M, a no-norm call) in one CUDA graph, replay it
    with fresh inputs copied into the static tensors, check every replay."""
    steps = [(4, "one_shot"), (64, "two_stage"), (1, "one_shot"), (17, "two_stage")]
    sets = 3
    data = _input_sets(comm, n, sorted({m for m, _ in steps}), sets, seed, rank, ref_comm)
    fns = _fns()
    static = {M: [t.clone() for t in data[(M, 0)][:3]] for M, _ in steps}
    no_norm_step = 2

    def run_steps():
        outs = []
        for k, (M, algo) in enumerate(steps):
            p, r, w = static[M]
            outs.append(fns[algo](p, r, None if k == no_norm_step else w, EPS, comm=comm))
        return outs

    run_steps()  # eager warm-up: kernels loaded, allocator warmed, before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = run_steps()
    nodes = None
    try:
        nodes = g.num_nodes() if hasattr(g, "num_nodes") else None
    except Exception:  # noqa: BLE001 - informational only
        nodes = None
    viol = torch.zeros(replays, dtype=torch.float32, device=comm.device)
    fp = torch.zeros(replays, dtype=torch.int64, device=comm.device)
    for i in range(replays):
        s = i % sets
        for M, _ in steps:
            for dst, src in zip(static[M], data[(M, s)][:3]):
                dst.copy_(src)
        g.replay()
        for k, ((M, _), (y, h)) in enumerate(zip(steps, outs)):
            _, _, _, y_exp, h_exp = data[(M, s)]
            v = _violation(h, h_exp, 1.6e-2, 1e-2)
            if k != no_norm_step:
                v = torch.maximum(v, _violation(y, y_exp, 1.6e-2, 1e-2))
            viol[i] = torch.maximum(viol[i], v)
            fp[i] = fp[i] * 7 + _fingerprint(h)
    torch.cuda.synchronize()
    bad = int((viol > 0).sum().item())
    if bad:
        rep["errors"].append(f"graph: {bad} of {replays} replays out of tolerance (worst {viol.max().item():.3g})")
    rep["identical"] &= same_on_all_ranks(fp)
    rep["graph"] = {"replays": replays, "calls_per_replay": len(steps), "bad_replays": bad, "nodes": nodes}
    return (replays + 1) * len(steps)  # + the eager warm-up; capturing runs nothing


def gpu_world(rank: int, world_size: int, stress_calls: int, graph_replays: int, seed: int) -> dict:
    """Correctness (bf16 N=7168 and fp32 N=2048), stress and CUDA-graph checks on one world."""
    from latency_specialized.comm import layout as L
    from latency_specialized.comm.base import TorchDistributedCommunicator
    from latency_specialized.comm.symmetric import SymmetricMemoryCommunicator

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    ref_comm = TorchDistributedCommunicator()
    rep = {"errors": [], "identical": True, "cases": 0, "stress": None, "graph": None, "calls_ok": True,
           "device": torch.cuda.get_device_name(dev)}
    t0 = time.perf_counter()
    for dtype, n, max_tokens, Ms in (("bfloat16", 7168, 64, (1, 2, 16, 64)), ("float32", 2048, 16, (1, 5, 16))):
        comm = SymmetricMemoryCommunicator(None, hidden=n, dtype=dtype, max_tokens=max_tokens, device=dev)
        calls = correctness(comm, dtype, n, Ms, seed, rank, ref_comm, rep)
        if dtype == "bfloat16":
            calls += stress(comm, n, stress_calls, seed + 1, rank, ref_comm, rep)
            calls += graph(comm, n, graph_replays, seed + 2, rank, ref_comm, rep)
        torch.cuda.synchronize()
        # the device-side call counter advanced exactly once per call (also through graph replays)
        rep["calls_ok"] &= int(comm.flags[L.FLAG_CALL].item()) == calls
        comm.destroy()
    rep["seconds"] = time.perf_counter() - t0
    return rep


def check_world(world_size: int, stress_calls: int, graph_replays: int, timeout: float,
                results_dir: str | None = None) -> list[dict]:
    """Run :func:`gpu_world` on ``world_size`` processes and assert on every rank's report."""
    import json
    import os

    from latency_specialized.comm.worlds import run_world

    reports = run_world(gpu_world, world_size, stress_calls, graph_replays, 23 + world_size, timeout=timeout)
    if results_dir:
        with open(os.path.join(results_dir, f"allreduce_gpu_world{world_size}.json"), "w") as f:
            json.dump(reports, f, indent=1, default=str)
    for rank, rep in enumerate(reports):
        assert not rep["errors"], f"rank {rank}: " + "\n".join(rep["errors"][:10])
        assert rep["identical"], f"rank {rank}: results differ between ranks"
        assert rep["calls_ok"], f"rank {rank}: device call counter out of step"
        assert rep["stress"]["calls"] == stress_calls and rep["stress"]["bad_calls"] == 0
        assert rep["stress"]["side_stream_gemms"] > 0
        assert rep["graph"]["replays"] == graph_replays and rep["graph"]["bad_replays"] == 0
        assert rep["cases"] == 2 * (4 + 3) + 4 * 2, rep["cases"]  # (M x algos) + zc/no-norm, per dtype
    return reports


def main(worlds=(2, 4, 8)) -> None:
    """What test_comm_ipc_gpu.py runs, for a device without pytest (tests/comm/gpu_session.sh)."""
    import os

    out = os.environ.get("LS_RESULTS_DIR")
    calls = int(os.environ.get("LS_STRESS_CALLS", "2000"))
    for w in worlds:
        t0 = time.perf_counter()
        reps = check_world(w, calls, 20, float(os.environ.get("LS_WORLD_TIMEOUT", "300")), out)
        st = reps[0]["stress"]
        print(f"PASSED world {w}: {reps[0]['cases']} cases, {st['calls']} stress calls at {st['us_per_call']:.0f} "
              f"us/call, graph {reps[0]['graph']}, {time.perf_counter() - t0:.1f} s", flush=True)
