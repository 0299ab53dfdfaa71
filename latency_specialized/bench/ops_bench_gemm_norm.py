"""Benchmark cases of the gemm and norm kernels (Kimi K3 per-rank shapes) + the gemm dispatch table.

gemm: every distinct (N, K) projection of the adapter's decode step at each TP shard, at every M:
cuBLAS (``torch.matmul`` into a preallocated output, the stock path) against each of our kernels
in a few configs. :func:`build_gemm_table` turns the rows into ``kernels/tuning/h200_gemm.json``:
per (N, K, M) the fastest implementation, which must beat cuBLAS by more than ``margin`` (run
noise) to be chosen.

norm: fused residual + RMSNorm at the hidden size and the other norm widths, against the torch
composition (``x + r`` then ``F.rms_norm``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

from latency_specialized.bench.op_cases import BenchSettings, OpCase, register_cases

EPS = 1e-5
TABLE_MARGIN = 0.03


def gemm_shapes(model: str, tps: Iterable[int]) -> dict[tuple[int, int], list[str]]:
    """Distinct (N, K) of the model's gemm sites per TP shard -> the sites that use them, the gemms inside other
    implementations included (``Implementation.inner``: the fused MLP's gate/up and down, named ``site/role``):
    the planner picks those from the same table, so a shape missing there leaves them on cuBLAS."""
    from latency_specialized.plugins import get_registry
    from latency_specialized.spec import ParallelSpec

    reg = get_registry()
    adapter = reg.adapter(model)
    spec = adapter.spec("full")
    shapes: dict[tuple[int, int], list[str]] = {}
    for tp in tps:
        for site in adapter.op_sites(spec.shard(tp), ParallelSpec(tp=tp), 1, "sm_90", "bfloat16"):
            gemms = [(site.name, site.ctx)] if site.family == "gemm" else []
            for impl in reg.implementations.family(site.family):
                if impl.inner is not None and impl.supports(site.ctx) is True:
                    gemms += [(f"{site.name}/{role}", ctx) for role, ctx in impl.inner(site.ctx)
                              if ctx.family == "gemm"]
            for name, ctx in gemms:
                where = f"{name}@tp{tp}"
                sites = shapes.setdefault((ctx.dim("N"), ctx.dim("K")), [])
                if where not in sites:
                    sites.append(where)
    return shapes


def shapes_missing_from_table(model: str, tps: Iterable[int], ms: Iterable[int],
                              table: dict[str, Any] | None = None) -> tuple[tuple[int, int], ...]:
    """The model's gemm shapes (``gemm_shapes``) without a measured cell in the dispatch table at one of the token
    counts ``ms`` (their buckets): the planner serves those by cuBLAS, whatever a kernel would do there."""
    from latency_specialized.kernels import tuning

    table = table if table is not None else tuning.load_table()
    return tuple(s for s in sorted(gemm_shapes(model, tps)) if any(tuning.entry(*s, m, table) is None for m in ms))


def gemm_variant_configs(n: int, k: int, m: int, quick: bool = False) -> list[tuple[str, Any]]:
    """(implementation name, config) pairs timed for one cell."""
    from latency_specialized.kernels import gemm_gemv, gemm_small_m, gemm_splitk
    from latency_specialized.kernels.gemm_gemv import GemvConfig
    from latency_specialized.kernels.gemm_small_m import SMEM_LIMIT, MmaConfig

    out: list[tuple[str, Any]] = []
    if m <= gemm_gemv.MAX_M and k % 8 == 0:
        cfgs = [GemvConfig(rows_per_warp=1), GemvConfig(rows_per_warp=2)]
        if m == 1:
            cfgs.append(GemvConfig(rows_per_warp=1, pdl=False))
        if k >= 4096:   # long rows: more loads in flight per lane, or persistent CTAs leaving PDL room
            cfgs += [GemvConfig(rows_per_warp=1, batch=16), GemvConfig(rows_per_warp=2, ctas_per_sm=2)]
            if m <= 2:  # software-pipelined stream: 1-3 batches ahead, all issued before the PDL wait
                cfgs += [GemvConfig(rows_per_warp=1, lookahead=1), GemvConfig(rows_per_warp=2, lookahead=1),
                         GemvConfig(rows_per_warp=1, batch=4, lookahead=3)]
        else:
            cfgs += [GemvConfig(rows_per_warp=1, ctas_per_sm=4), GemvConfig(rows_per_warp=2, ctas_per_sm=2)]
            if m <= 2 and k >= 1024:  # short rows: a whole row is one batch; more rows per warp instead
                cfgs.append(GemvConfig(rows_per_warp=4))
        if n <= 4096:  # few rows: K split over 2-4 warps puts more loads in flight
            cfgs += [c for c in (GemvConfig(k_split=2), GemvConfig(k_split=4), GemvConfig(warps=8, k_split=4),
                                 GemvConfig(warps=8, k_split=4, batch=4, lookahead=1))
                     if c.splits(k)]
        # twins with the other PDL prologue (prefetch: the first batches through the coherent path, so that they
        # really precede the PDL wait in SASS; the default since session 35)
        cfgs += [dataclasses.replace(c, prefetch=not c.prefetch) for c in cfgs[:2]]
        out += [(gemm_gemv.NAME, c) for c in (cfgs[:1] + cfgs[-2:-1] if quick else cfgs)]
    if k % 32:
        return out
    chunks = k // 32
    if m <= gemm_small_m.MAX_M:
        base = gemm_small_m.default_config(n, k, m)
        cfgs = [base, dataclasses.replace(base, prefetch=not base.prefetch)]
        alt_wk = base.wk * 2 if base.wk * 2 <= min(8, chunks) else base.wk // 2
        if alt_wk >= 1 and alt_wk != base.wk:
            per = math.ceil(chunks / alt_wk)
            alt = dataclasses.replace(base, wk=alt_wk, cb=max(1, min(base.cb, per)))
            if alt.smem_bytes() <= SMEM_LIMIT:
                cfgs.append(alt)
        if chunks >= 128:   # long K: 8 chunks (16 loads of 16 B per thread) in flight
            cfgs.append(dataclasses.replace(base, cb=8))
        elif base.wk * base.sk > 1:   # short K: persistent CTAs, room for the next kernel's prologue
            cfgs.append(dataclasses.replace(base, ctas_per_sm=1))
        out += [(gemm_small_m.NAME, c) for c in (cfgs[:2] if quick else cfgs)]
    if m <= gemm_splitk.MAX_M:
        nt = max(1, math.ceil(m / 8))
        mt = 2 if nt >= 4 else 1
        cfgs = []
        if m > gemm_small_m.MAX_M:
            cfgs.append(gemm_splitk.splitk_config(n, k, m))
        for sk in (2, 4, 8):
            wk = 4
            if wk * sk * 2 > chunks:
                continue
            per = math.ceil(chunks / (wk * sk))
            c = MmaConfig(nt=nt, mt=mt, wk=wk, sk=sk, cb=max(1, min(4 if mt == 1 else 2, per)))
            if c not in cfgs and c.smem_bytes() <= SMEM_LIMIT:
                cfgs.append(c)
        out += [(gemm_splitk.NAME, c) for c in cfgs[: (1 if quick else 3)]]
    return out


def _label(impl: str, cfg: Any) -> str:
    return f"{impl.split('.')[-1]}[{cfg.label()}]"


@register_cases("gemm")
def gemm_cases(settings: BenchSettings):
    import torch

    from latency_specialized.bench.op_cases import n_sets
    from latency_specialized.kernels import gemm_gemv, gemm_small_m, gemm_splitk

    runners = {gemm_gemv.NAME: gemm_gemv.gemm_gemv, gemm_small_m.NAME: gemm_small_m.gemm_small_m,
               gemm_splitk.NAME: gemm_splitk.gemm_splitk}
    shapes = gemm_shapes(settings.model, settings.tps)
    if settings.shapes:
        missing = [s for s in settings.shapes if s not in shapes]
        if missing:
            from latency_specialized.errors import UserError

            raise UserError(f"--shapes {missing} are not gemm shapes of {settings.model} at TP {settings.tps} "
                            f"(have {sorted(shapes)})")
        shapes = {s: shapes[s] for s in settings.shapes}
    for (n, k), sites in sorted(shapes.items(), key=lambda kv: -kv[0][0] * kv[0][1]):
        wbytes = n * k * 2
        pool: dict[int, Any] = {}  # weight copies, shared by every M of this shape, made on first use

        def weight(i: int, n=n, k=k, pool=pool, nw=n_sets(wbytes, settings)) -> Any:
            j = i % nw
            if j not in pool:
                g = torch.Generator(device="cuda").manual_seed(1000 + j)
                pool[j] = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
            return pool[j]

        label = sites[0] + (f" (+{len(sites) - 1})" if len(sites) > 1 else "")
        for m in settings.ms:
            def make(i: int, m=m, k=k, n=n, weight=weight) -> dict[str, Any]:
                g = torch.Generator(device="cuda").manual_seed(7 * i + m)
                x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
                return {"x": x, "w": weight(i), "out": torch.empty(m, n, device="cuda", dtype=torch.bfloat16)}

            variants: dict[str, Any] = {"cublas": lambda d: torch.matmul(d["x"], d["w"].t(), out=d["out"])}
            meta: dict[str, dict[str, Any]] = {"cublas": {"impl": "gemm.cublas"}}
            units = []
            for impl, cfg in gemm_variant_configs(n, k, m, settings.quick):
                name = _label(impl, cfg)
                fn = runners[impl]
                variants[name] = lambda d, fn=fn, cfg=cfg: fn(d["x"], d["w"], out=d["out"], config=cfg)
                meta[name] = {"impl": impl, "config": dataclasses.asdict(cfg)}
                if impl == gemm_gemv.NAME:
                    units.append((gemm_gemv.compile_gemv, (k, m, cfg, False)))
                else:
                    units.append((gemm_small_m.compile_mma, (k, cfg, False)))
            yield OpCase(family="gemm", op=label, shape={"N": n, "K": k}, m=m,
                         bytes=wbytes + 2 * m * (k + n), make=make, variants=variants, baseline="cublas",
                         reference=lambda d: d["x"].float() @ d["w"].float().t(), tolerance=1e-2,
                         compile_units=units, meta=meta)


def build_gemm_table(rows: list[dict[str, Any]], environment: dict[str, Any], margin: float = TABLE_MARGIN) -> dict:
    """The dispatch table (kernels/tuning/__init__.py layout) from gemm bench rows."""
    from latency_specialized.kernels.tuning import M_BUCKETS, table_key

    entries: dict[str, Any] = {}
    for r in rows:
        if r["m"] not in M_BUCKETS:
            continue
        times: dict[str, float] = {}
        configs: dict[str, Any] = {}
        notes: dict[str, str] = {}
        for name, v in r["variants"].items():
            impl = v.get("impl", name)
            if "us" not in v:
                notes.setdefault(impl, f"{name}: {v.get('error', 'not timed')}"[:160])
                continue
            if impl not in times or v["us"] < times[impl]:
                times[impl] = round(v["us"], 3)
                if "config" in v:
                    configs[impl] = v["config"]
        if "gemm.cublas" not in times:
            continue
        best = min(times, key=times.get)
        winner = best if times[best] < times["gemm.cublas"] * (1 - margin) else "gemm.cublas"
        for impl in list(notes):
            if impl in times:
                notes.pop(impl)
        e = {"winner": winner, "times_us": times, "configs": configs, "sites": r["op"]}
        if notes:
            e["notes"] = notes
        entries[table_key(r["shape"]["N"], r["shape"]["K"], r["m"])] = e
    return {"device": environment.get("device"), "arch": "sm_90", "margin": margin, "m_buckets": list(M_BUCKETS),
            "method": "bench-ops: CUDA-graph replays, weights rotated over >= 150 MB, median of groups, 2 passes",
            "environment": environment, "entries": entries}


# ---------------------------------------------------------------------------------- norm
NORM_SITES = (
    # label, N, residual, gate, rows per token
    ("attn/ffn norm + residual (hidden)", 7168, True, False, 1),
    ("moe.latent_norm", 3584, False, False, 1),
    ("attn.q_a_norm", 1536, False, False, 1),
    ("attn.kv_a_norm", 512, False, False, 1),
    ("kda gated head norm (12 heads, tp8)", 128, False, True, 12),
)


@register_cases("norm")
def norm_cases(settings: BenchSettings):
    import torch

    from latency_specialized.kernels import rmsnorm
    from latency_specialized.ops.norm import rmsnorm_reference

    for label, n, residual, gate, per_tok in NORM_SITES:
        w = (1.0 + 0.1 * torch.randn(n, device="cuda")).to(torch.bfloat16) if torch.cuda.is_available() else None
        for m in settings.ms:
            rows = m * per_tok

            def make(i: int, rows=rows, n=n, residual=residual, gate=gate, w=w) -> dict[str, Any]:
                g = torch.Generator(device="cuda").manual_seed(31 * i + rows)
                d = {"x": torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16), "w": w,
                     "out": torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)}
                if residual:
                    d["r"] = torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16)
                if gate:
                    d["g"] = torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16)
                return d

            def torch_norm(d, n=n) -> Any:
                h = d["x"] + d["r"] if "r" in d else d["x"]
                y = torch.nn.functional.rms_norm(h, (n,), d["w"], EPS)
                if "g" in d:
                    y = y * torch.sigmoid(d["g"])
                return y

            variants: dict[str, Any] = {"torch": torch_norm}
            if residual:  # context: one plain torch elementwise kernel moving 3/4 of these bytes
                variants["ref: torch add only"] = lambda d: torch.add(d["x"], d["r"], out=d["out"])
            units = []
            clusters = (1,) if n // 8 <= rmsnorm.WARP_MODE_MAX_VECS else (1, 2, 4)
            for cs in clusters:
                cfg = rmsnorm.NormConfig(cluster=cs)

                def ours(d, cfg=cfg) -> Any:
                    y = rmsnorm.rmsnorm_cute(d["x"], d["w"], EPS, residual=d.get("r"), gate=d.get("g"),
                                             out=d["out"], config=cfg)
                    return y[0] if isinstance(y, tuple) else y

                variants[f"cutedsl[c{cs}]"] = ours
                var = rmsnorm.NormVariant(n, "bfloat16", residual, True, False, gate, True)
                units.append((rmsnorm.compile_norm, (var, cfg)))

            def ref(d) -> Any:
                y = rmsnorm_reference(d["x"], d["w"], EPS, residual=d.get("r"), gate=d.get("g"))
                return y[0] if isinstance(y, tuple) else y

            tensors = 1 + (2 if residual else 0) + (1 if gate else 0) + 1  # x, r, h, g, y
            yield OpCase(family="norm", op=label, shape={"N": n, "rows": rows}, m=m,
                         bytes=2 * (rows * n * tensors + n), make=make, variants=variants, baseline="torch",
                         reference=ref, tolerance=1e-2, compile_units=units,
                         meta={"torch": {"impl": "torch add + F.rms_norm"}},
                         checks={"ref: torch add only": lambda d: (d["x"].float() + d["r"].float())})


ATTNRES_SITES = (  # (label, N, sources, output norm): Kimi K3's widest mix (a full block of 8 + partial)
    ("attnres mix (9 sources) + norm", 7168, 9, True),
    ("attnres mix (2 sources) + norm", 7168, 2, True),
)


@register_cases("norm")
def attnres_cases(settings: BenchSettings):
    import torch

    from latency_specialized.kernels import attnres
    from latency_specialized.plugins import get_registry

    if not torch.cuda.is_available():
        return
    # the family's reference as registered (Kimi K3's adapter provides it): reached through the registry
    attnres_mix_reference = get_registry().implementations.reference("residual.attnres").fn
    for label, n, s, out_norm in ATTNRES_SITES:
        nw = (1.0 + 0.1 * torch.randn(n, device="cuda")).to(torch.bfloat16)
        q = (torch.randn(n, device="cuda") * n ** -0.5).to(torch.bfloat16)
        ow = (1.0 + 0.1 * torch.randn(n, device="cuda")).to(torch.bfloat16) if out_norm else None
        for m in settings.ms:
            def make(i: int, m=m, n=n, s=s) -> dict[str, Any]:
                g = torch.Generator(device="cuda").manual_seed(37 * i + m)
                return {"src": torch.randn(s, m, n, device="cuda", generator=g).to(torch.bfloat16),
                        "out": torch.empty(m, n, device="cuda", dtype=torch.bfloat16)}

            def ref(d, s=s, nw=nw, q=q, ow=ow) -> Any:
                return attnres_mix_reference(d["src"].float(), s, nw.float(), q.float(), EPS,
                                             out_norm_weight=None if ow is None else ow.float(), out_eps=EPS)

            def torch_mix(d, s=s, nw=nw, q=q, ow=ow) -> Any:  # the reference's torch composition, bf16
                return attnres_mix_reference(d["src"], s, nw, q, EPS, out_norm_weight=ow, out_eps=EPS)

            variants: dict[str, Any] = {"torch": torch_mix}
            units = []
            for cs in attnres.CLUSTER_SIZES:
                if not attnres.fits(n, 2, cs):
                    continue
                cfg = attnres.AttnResConfig(cluster=cs)
                variants[f"cutedsl[c{cs}]"] = (lambda d, s=s, nw=nw, q=q, ow=ow, cfg=cfg: attnres.attnres_cute(
                    d["src"], s, nw, q, EPS, out_norm_weight=ow, out_eps=EPS, out=d["out"], config=cfg))
                units.append((attnres.compile_attnres, (attnres.AttnResVariant(n, "bfloat16", s, out_norm, cluster=cs),)))
            yield OpCase(family="norm", op=label, shape={"N": n, "sources": s}, m=m,
                         bytes=2 * (s * m * n + m * n + (3 if out_norm else 2) * n), make=make, variants=variants,
                         baseline="torch", reference=ref, tolerance=1e-2, compile_units=units,
                         meta={"torch": {"impl": "attnres_mix_reference (torch ops, bf16)"}})
