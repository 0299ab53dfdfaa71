"""Op bench (H200): routed experts over 4-bit weights (MXFP4 / NVFP4) against the peers and bf16.

Method as ``ops_bench_moe_kda`` (its ``time_graph``: one CUDA graph runs ``rotations`` independent routings
back to back over expert weights far beyond the L2, replayed after warm-up, median us per step, each
variant captured twice). Per batch, in one process on the same inputs:

* ``q4-gemv[...]`` / ``q4-grouped[...]``: ours (``kernels/moe_experts_q4_triton.py``) per launch variant,
  each checked against the dequantising reference before it is timed (``rel_err`` in ``extra``);
* ``mma[...]``: ours on the mma.sync kernel (``kernels/moe_experts_mma.py``, MXFP4 and NVFP4) per ``MMA_VARIANTS``
  entry (launch configs over the heuristic's, group mode), checked the same way;
* ``bf16-ours``: our bf16 experts over the same weights dequantised (what the loaders ran until now);
* ``peer-humming``: stock vLLM 0.33's MXFP4 MoE on Hopper (``bench/peers/humming_mxfp4.py``), where the
  package is importable; otherwise a row saying why.

Roofline = the distinct selected experts' stored bytes (codes + scales: ``QuantFormat.nbytes``; bf16 rows:
2 bytes a value) + activations, over the device's HBM bandwidth (``hardware.roofline_bandwidth()``).
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

import torch

from latency_specialized.bench.ops_bench_moe_kda import K3, SITU, Row, routing, twice, write_rows
from latency_specialized.hardware import roofline_bandwidth
from latency_specialized.ops.moe import experts_reference
from latency_specialized.quant.checkpoint_io import QuantizedWeight
from latency_specialized.quant.formats import QuantFormat

GEMV_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "gu2": {"gate_up": dict(block_i=2, block_w=128)},
    "gu4full": {"gate_up": dict(block_i=4, block_w=None)},
    "gu8w8": {"gate_up": dict(block_i=8, block_w=128, num_warps=8)},
    "dn16": {"down": dict(block_n=16)},
    "dn64w8": {"down": dict(block_n=64, num_warps=8)},
}
"""Launch variants of the gemv kernels (merged over ``GEMV_TUNING``)."""
GROUPED_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "n64w4s3": dict(block_n=64, num_warps=4, num_stages=3),
}
"""Launch variants of the grouped GEMMs (merged over ``GROUPED_TUNING``)."""
MMA_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "pdl": dict(gate_up=dict(pdl=True), down=dict(pdl=True)),
    "gu8": dict(gate_up=dict(wk=8)),
    "gu4c2": dict(gate_up=dict(wk=4, cb=2)),
    "gu2c2": dict(gate_up=dict(wk=2, cb=2)),
    "gu_c2a1": dict(gate_up=dict(cb=2, lookahead=1)),
    "dn16c1": dict(down=dict(wk=16, cb=1)),
    "dn16mt2": dict(down=dict(wk=16, mt=2)),
    "dn2": dict(down=dict(wk=2)),
    "dnmt1": dict(down=dict(mt=1)),
    "dn_a1": dict(down=dict(lookahead=1)),
    "route": dict(aligned=False),
    "aligned": dict(aligned=True),
    "paired": dict(paired=True),
    "paired_dn_a1": dict(paired=True, down=dict(lookahead=1)),
}
"""Variants of the mma experts: fields replaced in the heuristic's (gate_up, down) ``MmaConfig`` and the group mode
(default: ``moe_experts_mma.MIN_TOKENS_ALIGNED``). "down" is ``down_sum`` at route groups (warps = routes at once);
its lookahead there is routes requested ahead ("dn_a1": every route of a warp before the math, 128 registers).
"paired": the weights rearranged once into the paired-nibble layout (``quant.layout.paired_nibbles``: ~15% fewer
instructions in the offline SASS), the default configs."""


def random_q4_experts(E: int, N: int, K: int, fmt: str, g: torch.Generator, dev: str = "cuda") -> QuantizedWeight:
    """Random stored codes and scales ``[E, N, K]`` in ``fmt`` (uniform codes; scales near 1/sqrt(K)), on ``dev``."""
    f = QuantFormat.get(fmt)
    codes = torch.randint(0, 256, (E, N, K // 2), generator=g, device=dev, dtype=torch.uint8)
    group = f.block[1]
    # e2m1 values have rms ~2.9: a scale of ~1/(2.9 sqrt(K)) keeps each output near unit size
    target = 1.0 / (2.9 * K ** 0.5)
    if f.scale == "ue8m0":
        e = round(torch.log2(torch.tensor(target)).item()) + 127
        scale = torch.randint(e - 1, e + 2, (E, N, K // group), generator=g, device=dev, dtype=torch.uint8)
        return QuantizedWeight(f, (E, N, K), codes, scale)
    s = (torch.rand(E, N, K // group, generator=g, device=dev) * 0.5 + 0.75) * 64
    gs = torch.full((E,), target / 64, device=dev)
    return QuantizedWeight(f, (E, N, K), codes, s.to(torch.float8_e4m3fn), gs)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| over max |ref| (the bench's check before timing)."""
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def bench_q4_experts(tp: int, batches: list[int], *, fmt: str = "mxfp4", rotations: int = 8, seed: int = 0,
                     gemv_max_tokens: int = 16, log: Callable[[str], None] = print) -> list[Row]:
    """Kimi K3 routed experts at TP ``tp`` rank shapes with 4-bit weights: ours per variant, bf16 ours, the peer."""
    from latency_specialized.kernels import moe_experts_q4_triton as q4

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    E, k, K = K3["E"], K3["top_k"], K3["latent"]
    I = K3["expert_inter"] // tp
    N = K
    w13 = random_q4_experts(E, 2 * I, K, fmt, g)
    w2 = random_q4_experts(E, N, I, fmt, g)
    f = QuantFormat.get(fmt)
    q4_expert_bytes = (f.nbytes((2 * I, K)) + f.nbytes((N, I)))
    bf16_expert_bytes = 3 * I * K * 2
    peer, peer_why = _peer(fmt, w13, w2, log)
    rows: list[Row] = []
    for M in batches:
        xs = [torch.randn(M, K, generator=g, device=dev).bfloat16() for _ in range(rotations)]
        routes = [routing(M, E, k, g, dev) for _ in range(rotations)]
        distinct = statistics.mean(len(torch.unique(ids)) for _, ids in routes)
        act_bytes = M * K * 2 * 2
        nbytes = int(distinct * q4_expert_bytes + act_bytes)
        case = f"tp{tp} {fmt} M={M} E={E} k={k} K={K} I={I} ({distinct:.0f} distinct experts)"
        ref = experts_reference(xs[0], routes[0][0], routes[0][1], w13, w2, SITU)
        outs = [torch.empty(M, N, device=dev, dtype=torch.bfloat16) for _ in range(rotations)]
        plans: list[tuple[str, Callable, int, dict]] = []
        if M <= gemv_max_tokens:
            for vname, v in GEMV_VARIANTS.items():
                plans.append((f"q4-gemv[{vname}]", q4.experts_q4_gemv, 3, {"gemv": v}))
        if M >= 2:
            for vname, v in GROUPED_VARIANTS.items():
                plans.append((f"q4-grouped[{vname}]", q4.experts_q4_grouped, 5, {"grouped": v}))
        if K % 128 == 0 and I % 128 == 0:  # the mma kernels' widths (MXFP4 and NVFP4)
            for vname, v in MMA_VARIANTS.items():
                plans.append(_mma_plan(vname, v, M, k, E, K, I, N))
        for name, fn, kernels, tuning in plans:
            rows.append(_time_q4(name, fn, kernels, tuning, xs, routes, w13, w2, outs, ref, case, nbytes, rotations))
            log(f"{case} {name}: {rows[-1].us} us, roofline {rows[-1].roofline_frac:.2f}, {rows[-1].notes or ''}"
                f" {rows[-1].extra.get('rel_err', '')}")
        if peer is not None:
            rows.append(_time_peer(peer, xs, routes, outs, ref, case, nbytes, rotations))
        else:
            rows.append(Row("moe.experts", case, "peer-humming", [], 0, nbytes, notes=peer_why))
        log(f"{case} peer-humming: {rows[-1].us} us {rows[-1].notes}")
        rows.append(_time_bf16(M, xs, routes, w13, w2, outs, ref, case,
                               int(distinct * bf16_expert_bytes + act_bytes), rotations))
        log(f"{case} bf16-ours: {rows[-1].us} us {rows[-1].notes}")
    return rows


def mma_variant_configs(v: dict, M: int, k: int, E: int, K: int, I: int, N: int):
    """(gate_up config, down config, aligned) of an ``MMA_VARIANTS`` entry at a step of M tokens."""
    from dataclasses import replace

    from latency_specialized.kernels import moe_experts_mma as mm

    aligned = v.get("aligned", M >= mm.MIN_TOKENS_ALIGNED)
    c13, c2 = mm.default_configs(M, k, E, K, I, N, aligned)
    return replace(c13, **v.get("gate_up", {})), replace(c2, **v.get("down", {})), aligned


def _mma_plan(vname: str, v: dict, M: int, k: int, E: int, K: int, I: int, N: int) -> tuple[str, Callable, int, dict]:
    """One ``MMA_VARIANTS`` entry as a plan row: the wrapper with its configs and group mode bound; kernels: align (in
    aligned mode), gate_up, down, route sum."""
    from latency_specialized.kernels import moe_experts_mma as mm

    from latency_specialized.quant.layout import paired_nibbles

    c13, c2, aligned = mma_variant_configs(v, M, k, E, K, I, N)
    paired: dict = {}   # (id of w13, id of w2) -> their paired forms: rearranged once, outside the timed steps

    def fn(x, weights, ids, w13, w2, activation, **kw):
        if v.get("paired"):
            key = (id(w13), id(w2))
            if key not in paired:
                paired.clear()
                paired[key] = (paired_nibbles(w13), paired_nibbles(w2))
            w13, w2 = paired[key]
        return mm.experts_mma(x, weights, ids, w13, w2, activation, configs=(c13, c2), aligned=aligned, **kw)

    return (f"mma[{vname}]", fn, 3 + aligned, {"mma": dict(gate_up=c13.label(), down=c2.label(), aligned=aligned)})


def _time_q4(name, fn, kernels, tuning, xs, routes, w13, w2, outs, ref, case, nbytes, rotations) -> Row:
    from latency_specialized.kernels import moe_experts_q4_triton as q4

    saved = ({k: (dict(v) if isinstance(v, dict) else v) for k, v in q4.GEMV_TUNING.items()},
             dict(q4.GROUPED_TUNING))
    try:
        for part, v in tuning.get("gemv", {}).items():
            if isinstance(v, dict):
                q4.GEMV_TUNING[part].update(v)
            else:
                q4.GEMV_TUNING[part] = v
        q4.GROUPED_TUNING.update(tuning.get("grouped", {}))
        outs[0].fill_(float("nan"))
        fn(xs[0], routes[0][0], routes[0][1], w13, w2, SITU, out=outs[0])
        err = rel_err(outs[0], ref)
        extra: dict[str, Any] = dict(rel_err=round(err, 5), **{k: v for d in tuning.values() for k, v in d.items()})
        if not err < 2e-2:
            return Row("moe.experts", case, name, [], kernels, nbytes, notes=f"wrong: rel err {err:.3g}", extra=extra)

        def step(r):
            fn(xs[r], routes[r][0], routes[r][1], w13, w2, SITU, out=outs[r])

        return Row("moe.experts", case, name, twice(step, rotations), kernels, nbytes, extra=extra)
    except Exception as e:  # noqa: BLE001 - a failing variant is reported, the others still run
        return Row("moe.experts", case, name, [], kernels, nbytes, notes=f"{type(e).__name__}: {e}"[:300])
    finally:
        q4.GEMV_TUNING.clear()
        q4.GEMV_TUNING.update(saved[0])
        q4.GROUPED_TUNING.clear()
        q4.GROUPED_TUNING.update(saved[1])


def _time_bf16(M, xs, routes, w13, w2, outs, ref, case, nbytes, rotations) -> Row:
    """Our bf16 experts (the implementation the planner picks for bf16 weights at this batch)."""
    from latency_specialized.kernels import moe_experts_triton as tri
    from latency_specialized.kernels.moe_experts import experts as cute_experts

    b13, b2 = w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16)
    use_triton = M >= tri.MIN_TOKENS
    name = "bf16-ours[triton_fused]" if use_triton else "bf16-ours[cutedsl]"
    wss = [dict() for _ in xs]
    try:
        def step(r):
            w, ids = routes[r]
            if use_triton:
                tri.experts_triton(xs[r], w, ids.to(torch.int32), b13, b2, SITU, out=outs[r])
            else:
                cute_experts(xs[r], w, ids, b13, b2, SITU, out=outs[r], workspace=wss[r])

        step(0)
        err = rel_err(outs[0], ref)
        row = Row("moe.experts", case, name, twice(step, rotations), 5 if use_triton else 2, nbytes,
                  extra=dict(rel_err=round(err, 5)))
    except Exception as e:  # noqa: BLE001 - reported in the table
        row = Row("moe.experts", case, name, [], 0, nbytes, notes=f"{type(e).__name__}: {e}"[:300])
    del b13, b2
    torch.cuda.empty_cache()
    return row


def _peer(fmt: str, w13: QuantizedWeight, w2: QuantizedWeight, log) -> tuple[Any, str]:
    if fmt != "mxfp4":
        return None, f"no peer wired for {fmt}"
    try:
        from latency_specialized.bench.peers.humming_mxfp4 import HummingMxfp4MoE

        peer = HummingMxfp4MoE()
        peer.prepare(w13.weight, w13.scale, w2.weight, w2.scale, activation_kind="situ_glu", beta=SITU.beta,
                     beta_lin=SITU.beta_lin)
        return peer, ""
    except Exception as e:  # noqa: BLE001 - the table says why the peer did not run
        log(f"peer-humming unavailable: {type(e).__name__}: {e}")
        return None, f"humming unavailable: {type(e).__name__}: {e}"[:300]


def _time_peer(peer, xs, routes, outs, ref, case, nbytes, rotations) -> Row:
    try:
        ids32 = [ids.to(torch.int32) for _, ids in routes]
        y = peer(xs[0], routes[0][0], ids32[0])
        err = rel_err(y, ref)

        def step(r):
            peer(xs[r], routes[r][0], ids32[r], out=outs[r])

        return Row("moe.experts", case, "peer-humming", twice(step, rotations), 0, nbytes,
                   extra=dict(rel_err=round(err, 5)))
    except Exception as e:  # noqa: BLE001
        return Row("moe.experts", case, "peer-humming", [], 0, nbytes, notes=f"{type(e).__name__}: {e}"[:300])


def to_markdown_q4(rows: list[Row], device: str) -> str:
    """One table: every variant per case, its roofline fraction, and the peer's time over ours."""
    lines = [f"# Routed experts over 4-bit weights ({device})", "",
             "CUDA-graph replays, median us per step, two captures each; roofline = stored bytes of the distinct "
             f"selected experts + activations over {roofline_bandwidth() / 1e12:.1f} TB/s (bf16 rows: bf16 bytes). "
             "`vs peer` = peer us / ours.", "",
             "| case | impl | us (run1, run2) | kernels | roofline us | roofline frac | vs peer | rel err | notes |",
             "|---|---|---|---|---|---|---|---|---|"]
    peer = {r.case: r.best_us for r in rows if r.impl == "peer-humming" and r.us}
    for r in rows:
        us = ", ".join(f"{u:.2f}" for u in r.us) if r.us else "-"
        rf = f"{r.roofline_frac:.2f}" if r.us else "-"
        vs = f"{peer[r.case] / r.best_us:.2f}x" if (r.us and r.case in peer and r.impl != "peer-humming") else "-"
        cells = [r.case, r.impl, us, str(r.kernels or "-"), f"{r.roofline_us:.2f}", rf, vs,
                 str(r.extra.get("rel_err", "-")), r.notes]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def write(rows: list[Row], out_dir: str, stem: str = "ops_moe_experts_q4") -> None:
    write_rows(rows, out_dir, stem, to_markdown_q4)


__all__ = ["bench_q4_experts", "random_q4_experts", "rel_err", "write", "GEMV_VARIANTS",
           "GROUPED_VARIANTS"]
