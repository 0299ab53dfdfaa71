"""Op benchmarks (H200): MoE router, routed experts, shared-expert overlap, fused KDA decode.

Method (PERF.md): every variant is captured in a CUDA graph that runs ``rotations`` independent
input sets back to back (different routing / state rows, weights beyond the 60 MB L2), replayed
after warm-up, timed with CUDA events per replay; the figure is the median per step. Each variant
is measured twice (two captures) and both numbers are reported. The comparison is the stock
composition (``latency_specialized.bench.stock``: Triton grouped top-k, align + fused-MoE GEMMs +
activation + sum, conv + recurrent KDA + gated norm) and the plain-torch references where they are
graph-capturable, all in the same process on the same inputs.

Roofline = bytes that must move / the device's HBM bandwidth (``hardware.roofline_bandwidth()``): the
*distinct* selected experts' weights (measured per rotation from the actual routing) + activations for the
experts; state read + write + conv state read + write + inputs/outputs for KDA.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from latency_specialized.hardware import roofline_bandwidth
from latency_specialized.spec import ActivationSpec, RouterSpec

SITU = ActivationSpec(kind="situ_glu", beta=4, beta_lin=25)
K3_ROUTER = RouterSpec(score_func="sigmoid")
EXPERT_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "v1_gu8_dn16_hint": dict(pdl=False, gu_rows=8, dn_rows=16, stream_hint=True),
    "pdl_gu4_dn8_hint": dict(pdl=True, gu_rows=4, dn_rows=8, stream_hint=True),
    "nopdl_gu4_dn8": dict(pdl=False, gu_rows=4, dn_rows=8, stream_hint=False),
    # 8 warps halve each down warp's serial chain of pairs (16 pairs: 2 per warp instead of 4)
    "pdl_gu4_w8dn8": dict(pdl=True, gu_rows=4, dn_rows=8, dn_warps=8, stream_hint=False),
    "pdl_gu4_w8dn14": dict(pdl=True, gu_rows=4, dn_rows=14, dn_warps=8, stream_hint=False),
}
"""Routed-expert tuning variants timed at batch 1 (ExpertsConfig fields)."""
EXPERT_VARIANTS_MULTI: dict[str, dict[str, Any]] = {
    "default": {},
    "dn8": dict(dn_rows=8),
    "dn12": dict(dn_rows=12),
    "w6dn14": dict(dn_warps=6, dn_rows=14),
}
"""Variants timed at several tokens (``--experts-sweep``): the default sizes ``down`` to one wave
(``moe_experts.one_wave_down_rows``: 10 rows for N 3584 on 132 SMs); dn8 is the previous default."""
K3 = dict(E=896, top_k=16, latent=3584, expert_inter=3072, hidden=7168, shared=2, heads=96, head_dim=128, conv=4)


@dataclass
class Row:
    """One measured variant."""

    op: str
    case: str
    impl: str
    us: list[float]
    """Median us per step of each of the two runs."""
    kernels: int
    bytes: int
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def best_us(self) -> float:
        return min(self.us) if self.us else 0.0

    @property
    def roofline_us(self) -> float:
        return self.bytes / roofline_bandwidth() * 1e6

    @property
    def roofline_frac(self) -> float:
        return self.roofline_us / self.best_us if self.best_us > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(best_us=self.best_us, roofline_us=self.roofline_us, roofline_frac=self.roofline_frac)
        return d


def write_rows(rows: list[Row], out_dir: str, stem: str, markdown: Callable[[list[Row], str], str]) -> None:
    """``out_dir/<stem>.json`` (the rows and the GPU's name) and ``<stem>.md`` (``markdown(rows, device)``): what every
    op bench writes after each case, so that a run cut short keeps what it measured."""
    import os

    device = torch.cuda.get_device_name(0)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(dict(device=device, rows=[r.to_json() for r in rows]), f, indent=1)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(markdown(rows, device))


def time_graph(step: Callable[[int], None], rotations: int, *, replays: int = 40, warmup: int = 5,
               sync_each: bool = False) -> float:
    """Median us per step of a CUDA graph that calls ``step(r)`` for r in range(rotations).

    ``sync_each``: the host waits for every replay before recording the next one (no replay overlaps
    the previous one's tail; the MLA bench's method), else the replays are queued back to back."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for r in range(rotations):
            step(r)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for r in range(rotations):
            step(r)
    for _ in range(warmup):
        g.replay()
    if sync_each:
        torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for e0, e1 in events:
        e0.record()
        g.replay()
        e1.record()
        if sync_each:
            e1.synchronize()
    torch.cuda.synchronize()
    times = [e0.elapsed_time(e1) * 1e3 / rotations for e0, e1 in events]
    del g
    return statistics.median(times)


def twice(step: Callable[[int], None], rotations: int) -> list[float]:
    return [round(time_graph(step, rotations), 2) for _ in range(2)]


def _stock():
    """The stock Triton kernels, or the reason they cannot run here (reported, never silently skipped)."""
    try:
        from latency_specialized.bench.stock import kda as kda_k
        from latency_specialized.bench.stock import moe as moe_k
        from latency_specialized.bench.stock import norms

        return (moe_k, kda_k, norms), ""
    except Exception as e:  # noqa: BLE001
        return None, f"stock kernels unavailable: {type(e).__name__}: {e}"


def routing(M: int, E: int, k: int, g: torch.Generator, dev: str):
    """Random top-k routing of M tokens over E experts: (weights [M, k] fp32 summing to 1, ids [M, k])."""
    logits = torch.randn(M, E, generator=g, device=dev)
    ids = logits.topk(k, dim=-1).indices
    w = torch.rand(M, k, generator=g, device=dev) + 0.05
    return (w / w.sum(-1, keepdim=True)).contiguous(), ids.contiguous()


# ------------------------------------------------------------------------------------------ experts
def bench_experts(tp: int, batches: list[int], variants: dict[str, dict[str, int]], *, rotations: int = 8,
                  seed: int = 0, log: Callable[[str], None] = print,
                  multi_variants: dict[str, dict[str, Any]] | None = None) -> list[Row]:
    """Routed experts (ours per variant, the two kernels alone, stock Triton) per batch. ``variants``
    are timed at batch 1, ``multi_variants`` (default: the default only) at larger batches."""
    from latency_specialized.kernels.moe_experts import experts

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    E, k, K = K3["E"], K3["top_k"], K3["latent"]
    I = K3["expert_inter"] // tp
    N = K
    w13 = torch.empty(E, 2 * I, K, device=dev, dtype=torch.bfloat16).normal_(0, K ** -0.5, generator=g)
    w2 = torch.empty(E, N, I, device=dev, dtype=torch.bfloat16).normal_(0, I ** -0.5, generator=g)
    expert_bytes = 3 * I * K * 2
    stock, why = _stock()
    rows: list[Row] = []
    for M in batches:
        xs = [torch.randn(M, K, generator=g, device=dev).bfloat16() for _ in range(rotations)]
        routes = [routing(M, E, k, g, dev) for _ in range(rotations)]
        distinct = statistics.mean(len(torch.unique(ids)) for _, ids in routes)
        nbytes = int(distinct * expert_bytes + M * K * 2 * 2)
        case = f"tp{tp} M={M} E={E} k={k} K={K} I={I} ({distinct:.0f} distinct experts)"
        for vname, tuning in (variants if M == 1 else (multi_variants or {"default": {}})).items():
            outs = [torch.empty(M, N, device=dev, dtype=torch.bfloat16) for _ in range(rotations)]
            wss = [dict() for _ in range(rotations)]

            def step(r, tuning=tuning, outs=outs, wss=wss):
                w, ids = routes[r]
                experts(xs[r], w, ids, w13, w2, SITU, out=outs[r], workspace=wss[r], **tuning)

            try:
                us = twice(step, rotations)
                rows.append(Row("moe.experts", case, f"cutedsl[{vname}]", us, 2, nbytes, extra=dict(tuning)))
            except Exception as e:  # noqa: BLE001 - a failing variant is reported, the others still run
                rows.append(Row("moe.experts", case, f"cutedsl[{vname}]", [], 2, nbytes,
                                notes=f"{type(e).__name__}: {e}"[:300], extra=dict(tuning)))
            log(f"experts {case} cutedsl[{vname}] {rows[-1].us} us  roofline {rows[-1].roofline_frac:.2f} "
                f"{rows[-1].notes}")
            if vname == "default" and rows[-1].us:
                rows += _experts_split(xs, routes, w13, w2, wss, outs, case, distinct, I, K, log)
        if stock is None:
            rows.append(Row("moe.experts", case, "stock-triton", [], 0, nbytes, notes=why))
            continue
        moe_k = stock[0]
        T = M * k
        ids32 = [ids.to(torch.int32) for _, ids in routes]
        aligns = [moe_k.AlignBuffers.allocate(moe_k.AlignSizes(T, E, 16), dev) for _ in range(rotations)]
        gu = torch.empty(T, 2 * I, device=dev, dtype=torch.bfloat16)
        act = torch.empty(T, I, device=dev, dtype=torch.bfloat16)
        yp = torch.empty(T, N, device=dev, dtype=torch.bfloat16)
        out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)

        def stock_step(r):
            moe_k.moe_align(ids32[r], aligns[r])
            moe_k.moe_gemm(xs[r], w13, aligns[r], k, out=gu, a_per_pair=False)
            moe_k.situ_and_mul(gu, SITU.beta, SITU.beta_lin, out=act)
            moe_k.moe_gemm(act, w2, aligns[r], k, out=yp, a_per_pair=True, topk_weights=routes[r][0].view(-1))
            moe_k.moe_sum(yp, k, out=out)

        try:
            us = twice(stock_step, rotations)
            rows.append(Row("moe.experts", case, "stock-triton", us, 5, nbytes))
        except Exception as e:  # noqa: BLE001 - reported in the table
            rows.append(Row("moe.experts", case, "stock-triton", [], 5, nbytes, notes=f"{type(e).__name__}: {e}"))
        log(f"experts {case} stock {rows[-1].us} {rows[-1].notes}")
    del w13, w2
    torch.cuda.empty_cache()
    return rows


def _experts_split(xs, routes, w13, w2, wss, outs, case, distinct, I, K, log) -> list[Row]:
    """Each of the two expert kernels alone (diagnostic: where the time goes), same inputs/workspaces."""
    from latency_specialized.kernels import moe_experts as me

    M, k = routes[0][1].shape
    cfg = me.make_config(M, K, I, w2.shape[1], k, torch.bfloat16, routes[0][1].dtype, SITU)
    gate_up, down = me.compile_gate_up(cfg), me.compile_down(cfg)
    rows = []
    for name, frac, fn in (
        ("gate_up only", 2 / 3, lambda r: gate_up(xs[r], routes[r][1].view(-1), w13, wss[r]["h"], wss[r]["lead"],
                                                  wss[r]["members"])),
        ("down only", 1 / 3, lambda r: down(wss[r]["h"], routes[r][1].view(-1), routes[r][0].view(-1),
                                            wss[r]["lead"], wss[r]["members"], w2, outs[r]))):
        nbytes = int(distinct * 3 * I * K * 2 * frac)
        rows.append(Row("moe.experts", case, f"cutedsl[default: {name}]", twice(fn, len(xs)), 1, nbytes))
        log(f"experts {case} {name} {rows[-1].us} roofline {rows[-1].roofline_frac:.2f}")
    return rows


# ------------------------------------------------------------------------------------------- router
def bench_router(batches: list[int], *, rotations: int = 8, seed: int = 1,
                 log: Callable[[str], None] = print) -> list[Row]:
    """Router alone: ``rotations`` calls per graph (a one-kernel graph would time the graph launch)."""
    from latency_specialized.kernels.moe_router import route
    from latency_specialized.ops.moe import route_reference

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    E, k = K3["E"], K3["top_k"]
    stock, why = _stock()
    rows: list[Row] = []
    bias = torch.randn(E, generator=g, device=dev) * 0.1
    for M in batches:
        logits = [torch.randn(M, E, generator=g, device=dev) for _ in range(rotations)]
        w = [torch.empty(M, k, device=dev) for _ in range(rotations)]
        ids = [torch.empty(M, k, device=dev, dtype=torch.int64) for _ in range(rotations)]
        ids32 = [torch.empty(M, k, device=dev, dtype=torch.int32) for _ in range(rotations)]
        nbytes = M * E * 4 + E * 4 + M * k * 12
        case = f"M={M} E={E} k={k} sigmoid+bias"
        rows.append(Row("moe.router", case, "cutedsl",
                        twice(lambda r: route(logits[r], bias, k, K3_ROUTER, out_weights=w[r], out_ids=ids[r]),
                              rotations), 1, nbytes))
        # the default is the sort kernel at these batches; the redux-rounds kernel beside it
        rows.append(Row("moe.router", case, "cutedsl[rounds]",
                        twice(lambda r: route(logits[r], bias, k, K3_ROUTER, out_weights=w[r], out_ids=ids[r],
                                              sort=False), rotations), 1, nbytes))
        rows.append(Row("moe.router", case, "torch-reference",
                        twice(lambda r: route_reference(logits[r], bias, k, K3_ROUTER), rotations), 0, nbytes,
                        notes="torch sigmoid + stable sort + gather + renorm (several kernels)"))
        if stock is not None:
            rows.append(Row("moe.router", case, "stock-triton",
                            twice(lambda r: stock[0].grouped_topk(logits[r], bias, k, weights=w[r], ids=ids32[r]),
                                  rotations), 1, nbytes))
        else:
            rows.append(Row("moe.router", case, "stock-triton", [], 1, nbytes, notes=why))
        for row in rows[-4:]:
            log(f"router {case} {row.impl} {row.us}")
    return rows


# ---------------------------------------------------------------------------------------------- KDA
def bench_kda(tp: int, batches: list[int], *, rotations: int = 8, seed: int = 2,
              log: Callable[[str], None] = print) -> list[Row]:
    from latency_specialized.kernels.kda_decode import kda_decode
    from latency_specialized.ops.attention.kda import kda_decode_reference

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    H, D, W = K3["heads"] // tp, K3["head_dim"], K3["conv"]
    HD = H * D
    stock, why = _stock()
    rows: list[Row] = []
    for B in batches:
        S = rotations * B
        state = torch.randn(S, H, D, D, generator=g, device=dev) * 0.1
        conv_state = torch.randn(S, 3 * HD, W - 1, generator=g, device=dev).bfloat16()
        conv_w = torch.randn(3 * HD, W, generator=g, device=dev) * 0.5
        A_log = torch.randn(H, generator=g, device=dev) * 0.5
        dt_bias = torch.randn(HD, generator=g, device=dev) * 0.5
        norm_w = 1 + 0.1 * torch.randn(D, generator=g, device=dev)
        perm = torch.randperm(S, generator=g, device=dev).to(torch.int32)
        idx = [perm[r * B:(r + 1) * B].contiguous() for r in range(rotations)]
        inp = [dict(mixed_qkv=torch.randn(B, 3 * HD, generator=g, device=dev).bfloat16(),
                    f=torch.randn(B, HD, generator=g, device=dev).bfloat16(),
                    beta_logit=torch.randn(B, H, generator=g, device=dev).bfloat16(),
                    g_out=torch.randn(B, HD, generator=g, device=dev).bfloat16()) for _ in range(rotations)]
        out = torch.empty(B, HD, device=dev, dtype=torch.bfloat16)
        state_bytes = B * H * D * D * 4 * 2
        conv_bytes = B * 3 * HD * (W - 1) * 2 * 2
        io_bytes = B * (3 * HD + HD + H + HD + HD) * 2
        nbytes = state_bytes + conv_bytes + io_bytes
        case = f"tp{tp} B={B} H={H} D={D}"

        # state in registers (row split 1 or 2) or staged through shared memory (3 CTAs per SM)
        for rs, staged in ((1, False), (2, False), (1, True)):
            label = f"cutedsl[row_split={rs}{', smem' if staged else ''}]"

            def ours(r, rs=rs, staged=staged):
                kda_decode(inp[r]["mixed_qkv"], conv_state, conv_w, inp[r]["f"], A_log, dt_bias,
                           inp[r]["beta_logit"], inp[r]["g_out"], norm_w, state, idx[r], num_heads=H, out=out,
                           row_split=rs, stage_smem=staged)

            try:
                rows.append(Row("attention.kda", case, label, twice(ours, rotations), 1,
                                nbytes, extra=dict(state_bytes=state_bytes)))
            except Exception as e:  # noqa: BLE001
                rows.append(Row("attention.kda", case, label, [], 1, nbytes,
                                notes=f"{type(e).__name__}: {e}"[:300]))

        def ref(r):
            kda_decode_reference(inp[r]["mixed_qkv"], conv_state, conv_w, inp[r]["f"], A_log, dt_bias,
                                 inp[r]["beta_logit"], inp[r]["g_out"], norm_w, state, idx[r], num_heads=H)

        try:
            rows.append(Row("attention.kda", case, "torch-reference", twice(ref, rotations), 0, nbytes))
        except Exception as e:  # noqa: BLE001
            rows.append(Row("attention.kda", case, "torch-reference", [], 0, nbytes, notes=f"{type(e).__name__}: {e}"))
        if stock is not None:
            _, kda_k, norms = stock
            conv = torch.empty(B, 3 * HD, device=dev, dtype=torch.bfloat16)
            o = torch.empty(B, HD, device=dev, dtype=torch.bfloat16)

            def stock_step(r):
                kda_k.conv_update(inp[r]["mixed_qkv"], conv_state, conv_w, idx[r], out=conv)
                kda_k.recurrent_kda(conv, inp[r]["f"], A_log, dt_bias, inp[r]["beta_logit"], state, idx[r],
                                    num_heads=H, lower_bound=-5.0, out=o)
                norms.gated_rmsnorm(o, inp[r]["g_out"], norm_w, D, 1e-5, out=out)

            try:
                rows.append(Row("attention.kda", case, "stock-triton", twice(stock_step, rotations), 3, nbytes))
            except Exception as e:  # noqa: BLE001
                rows.append(Row("attention.kda", case, "stock-triton", [], 3, nbytes, notes=f"{type(e).__name__}: {e}"))
        else:
            rows.append(Row("attention.kda", case, "stock-triton", [], 3, nbytes, notes=why))
        for row in rows[-4:]:
            log(f"kda {case} {row.impl} {row.us} roofline {row.roofline_frac:.2f} {row.notes}")
        del state, conv_state
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------- shared-expert overlap
def _shared_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Shared expert as stock runs it: cuBLAS gate/up, SiTU-GLU (torch elementwise), cuBLAS down."""
    from latency_specialized.ops.activation import gated_activation

    gu = torch.nn.functional.linear(x, w13)
    inter = w13.shape[0] // 2
    return torch.nn.functional.linear(gated_activation(gu[:, :inter], gu[:, inter:], SITU).to(x.dtype), w2)


def bench_overlap(tp: int, batches: list[int], *, rotations: int = 8, seed: int = 3,
                  log: Callable[[str], None] = print) -> list[Row]:
    """Routing + routed experts (main stream) vs the shared expert (side stream): serial vs overlapped."""
    from latency_specialized.kernels.moe_experts import experts
    from latency_specialized.kernels.moe_router import route
    from latency_specialized.runtime.side_stream import SideStream

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    E, k, K, Hd = K3["E"], K3["top_k"], K3["latent"], K3["hidden"]
    I = K3["expert_inter"] // tp
    Is = K3["shared"] * K3["expert_inter"] // tp
    w13 = torch.empty(E, 2 * I, K, device=dev, dtype=torch.bfloat16).normal_(0, K ** -0.5, generator=g)
    w2 = torch.empty(E, K, I, device=dev, dtype=torch.bfloat16).normal_(0, I ** -0.5, generator=g)
    sw13 = [torch.empty(2 * Is, Hd, device=dev, dtype=torch.bfloat16).normal_(0, Hd ** -0.5, generator=g)
            for _ in range(rotations)]
    sw2 = [torch.empty(K, Is, device=dev, dtype=torch.bfloat16).normal_(0, Is ** -0.5, generator=g)
           for _ in range(rotations)]
    bias = torch.randn(E, generator=g, device=dev) * 0.1
    side = SideStream()
    rows: list[Row] = []
    for M in batches:
        logits = [torch.randn(M, E, generator=g, device=dev) for _ in range(rotations)]
        xl = [torch.randn(M, K, generator=g, device=dev).bfloat16() for _ in range(rotations)]
        xh = [torch.randn(M, Hd, generator=g, device=dev).bfloat16() for _ in range(rotations)]
        w = [torch.empty(M, k, device=dev) for _ in range(rotations)]
        ids = [torch.empty(M, k, device=dev, dtype=torch.int64) for _ in range(rotations)]
        routed = [torch.empty(M, K, device=dev, dtype=torch.bfloat16) for _ in range(rotations)]
        wss = [dict() for _ in range(rotations)]
        sink: dict[int, torch.Tensor] = {}

        def main(r):
            route(logits[r], bias, k, K3_ROUTER, out_weights=w[r], out_ids=ids[r])
            experts(xl[r], w[r], ids[r], w13, w2, SITU, out=routed[r], workspace=wss[r])

        def shared(r):
            sink[r] = _shared_mlp(xh[r], sw13[r], sw2[r])

        def serial(r):
            main(r)
            shared(r)

        def overlapped(r):
            pending = side.run(_shared_mlp, xh[r], sw13[r], sw2[r])
            main(r)
            sink[r] = pending.join()

        case = f"tp{tp} M={M}: router+experts (main) | shared expert {2 * Is}x{Hd} + {K}x{Is} (side)"
        t = {name: twice(fn, rotations) for name, fn in
             (("main only", main), ("shared only", shared), ("serial", serial), ("overlapped", overlapped))}
        best = {n: min(v) for n, v in t.items()}
        saved = best["serial"] - best["overlapped"]
        hidden = saved / best["shared only"] if best["shared only"] > 0 else 0.0
        for name, us in t.items():
            rows.append(Row("moe.overlap", case, name, us, 0, 0,
                            extra=dict(saved_us=round(saved, 2), shared_hidden_frac=round(hidden, 3))))
        log(f"overlap {case}: {t} saved {saved:.2f} us ({hidden:.0%} of the shared expert hidden)")
    return rows


# -------------------------------------------------------------------------------------- calibration
def bench_bandwidth(*, log: Callable[[str], None] = print) -> list[Row]:
    """What HBM gives for pure reads, copies and in-place read-modify-write (KDA's access pattern)."""
    dev = "cuda"
    rows: list[Row] = []
    big = torch.randn(512 * 2**20 // 4, device=dev)  # 512 MiB fp32, far beyond the L2
    dst = torch.empty_like(big)
    nbytes = big.numel() * 4
    chunks = big.view(8, -1)  # 8 x 64 MiB: an in-place pass over one chunk per step, rotating
    for name, fn, moved in (
        ("read (sum)", lambda r: big.sum(), nbytes),
        ("copy (read+write)", lambda r: dst.copy_(big), 2 * nbytes),
        ("in-place RMW 64 MiB (read+write)", lambda r: chunks[r].mul_(1.0000001), 2 * chunks[0].numel() * 4),
    ):
        rots = 8 if "RMW" in name else 1
        us = twice(fn, rots)
        row = Row("hbm", "HBM bandwidth calibration", name, us, 1, moved,
                  extra=dict(tb_per_s=round(moved / min(us) / 1e6, 2)))
        rows.append(row)
        log(f"bandwidth {name}: {us} us -> {moved / min(us) / 1e6:.2f} TB/s")
    return rows


# ---------------------------------------------------------------------------------------- reporting
def to_markdown(rows: list[Row], device: str) -> str:
    lines = [f"# MoE / KDA op benchmarks ({device})", "",
             "CUDA-graph replays, median us per step, two runs each; "
             f"roofline = bytes / {roofline_bandwidth() / 1e12:.1f} TB/s.",
             "`only` rows time one of the two expert kernels alone (diagnostic); `vs stock` compares whole ops.", "",
             "| op | case | impl | us (run1, run2) | kernels | roofline us | roofline frac | vs stock | notes |",
             "|---|---|---|---|---|---|---|---|---|"]
    stock = {(r.op, r.case): r.best_us for r in rows if r.impl == "stock-triton" and r.us}
    for r in rows:
        us = ", ".join(f"{u:.2f}" for u in r.us) if r.us else "-"
        rf = f"{r.roofline_frac:.2f}" if (r.us and r.bytes) else "-"
        ru = f"{r.roofline_us:.2f}" if r.bytes else "-"
        whole = "only" not in r.impl
        vs = f"{stock[(r.op, r.case)] / r.best_us:.2f}x" if (whole and r.us and (r.op, r.case) in stock) else "-"
        notes = r.notes or (", ".join(f"{k}={v}" for k, v in r.extra.items()) if r.extra else "")
        cells = [r.op, r.case, r.impl, us, str(r.kernels or "-"), ru, rf, vs, notes]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def rows_from_json(path: str) -> tuple[str, list[Row]]:
    """(device, rows) of a results file written by :func:`run_all` (to re-render the Markdown)."""
    with open(path) as f:
        data = json.load(f)
    names = {f for f in Row.__dataclass_fields__}
    return data["device"], [Row(**{k: v for k, v in r.items() if k in names}) for r in data["rows"]]


def run_experts_sweep(out_dir: str, batches: list[int], tps: list[int], *,
                      log: Callable[[str], None] = print) -> list[Row]:
    """Routed experts at several tokens: every ``EXPERT_VARIANTS_MULTI`` variant against stock Triton
    (which of the two serves each bucket); writes ops_moe_experts_sweep.{json,md} into ``out_dir``."""
    rows: list[Row] = []
    for tp in tps:
        rows += bench_experts(tp, batches, {"default": {}}, log=log, multi_variants=EXPERT_VARIANTS_MULTI)
        write_rows(rows, out_dir, "ops_moe_experts_sweep", to_markdown)
    return rows


def run_all(out_dir: str, *, quick: bool = False, log: Callable[[str], None] = print) -> list[Row]:
    """Every case; writes ops_moe_kda.json / .md into ``out_dir`` after each op (partial results survive)."""
    variants = EXPERT_VARIANTS
    rows: list[Row] = []
    plan = [
        ("bandwidth", lambda: bench_bandwidth(log=log)),
        ("experts tp8", lambda: bench_experts(8, [1, 8, 64], variants, log=log)),
        ("router", lambda: bench_router([1, 8, 64], log=log)),
        ("kda tp8", lambda: bench_kda(8, [1, 8, 64], log=log)),
        ("overlap tp8", lambda: bench_overlap(8, [1, 8], log=log)),
        ("experts tp16", lambda: bench_experts(16, [1, 64], {"default": {}}, log=log)),
        ("kda tp16", lambda: bench_kda(16, [1, 64], log=log)),
    ]
    if quick:
        plan = plan[:1]
    for name, fn in plan:
        t0 = time.perf_counter()
        try:
            rows += fn()
        except Exception as e:  # noqa: BLE001 - keep the other ops' numbers
            rows.append(Row(name, "-", "FAILED", [], 0, 0, notes=f"{type(e).__name__}: {e}"))
            log(f"{name} FAILED: {type(e).__name__}: {e}")
        log(f"[{name}: {time.perf_counter() - t0:.1f} s]")
        write_rows(rows, out_dir, "ops_moe_kda", to_markdown)
    return rows
