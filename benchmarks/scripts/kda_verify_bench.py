"""KDA verification step + accept on the H200 at Kimi K3 TP8 rank shapes: the Triton kernels
(``kernels/kda_verify_triton.py``, registered since session 25) against the torch references the plan runs today and
against 1 + k single-token ``attention.kda.cutedsl`` calls (what a step of 1 + k tokens would cost as single
steps), CUDA-graph replays, median of 40 after 5 warm-ups, state rows rotated over 8 disjoint sets (beyond L2).

    python3 benchmarks/scripts/kda_verify_bench.py --batch 1,8,64 --k 3,7 --out $OUT/kda_verify_bench.json

Roofline bytes of a verify + accept: the fp32 state read by the verify and read + written by the accept
(3 x B x H x D x D x 4), the tapes written and read back (2 x B x T x H x 3 x D x 4), the conv state and the
token rows once. Each variant is also checked against the reference on the timed inputs (max rel err in the
JSON): a fast wrong kernel is reported as such, not timed alone.

Besides the default launch (``triton verify + accept``), every ``candidate_configs(B, H, D)`` of the kernel module
(``triton config <name>``: fused / hoist_fb / prologue at several blocks) is timed and checked the same way; a
``summary`` row per (B, k) names the fastest correct config, its us and the default's (``choose_blocks``' pick is
then set from these). Triton compiles each distinct config once (about 15 kernels for --batch 1,8,64).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from latency_specialized.bench.ops_bench_moe_kda import time_graph  # noqa: E402
from latency_specialized.hardware import roofline_bandwidth  # noqa: E402
from latency_specialized.ops.attention.kda_verify import (kda_accept_reference, kda_verify_reference,  # noqa: E402
                                                          tape_shapes)

H, D, W, RANK = 12, 128, 4, 128
ROTATIONS = 8
MAX_OUT_REL_ERR = 1e-2
"""Max |got - want| / max |want| of a correct variant's outputs (bf16 inputs: a conv output's rounding may flip an
ulp; the default kernel measured < 2e-3)."""
MAX_STATE_REL_ERR = 1e-2
"""Of the accepted fp32 states: the replay of the variant's own tape, whose v' carries the same flips."""


def _inputs(B: int, T: int, g: torch.Generator) -> dict:
    dev, hd, S = "cuda", H * D, ROTATIONS * B
    rnd = lambda *s: torch.randn(*s, generator=g, device=dev)  # noqa: E731
    perm = torch.randperm(S, generator=g, device=dev).to(torch.int32)
    ts, tc = tape_shapes(H, D, T - 1)
    x = dict(
        rows=[perm[r * B:(r + 1) * B].contiguous() for r in range(ROTATIONS)],
        tok=[dict(mixed_qkv=rnd(B * T, 3 * hd).bfloat16(), f=rnd(B * T, RANK).bfloat16(),
                  beta_logit=rnd(B * T, H).bfloat16(), g_out=rnd(B * T, hd).bfloat16()) for _ in range(ROTATIONS)],
        # the same tokens one step at a time (contiguous [B, ...] rows: what a single decode step gets)
        conv_weight=rnd(3 * hd, W) / W ** 0.5, A_log=torch.log(0.5 + 1.5 * torch.rand(H, generator=g, device=dev)),
        dt_bias=-2.0 + 0.5 * rnd(hd), norm_weight=1.0 + 0.1 * rnd(D), f_b=(rnd(hd, RANK) / RANK ** 0.5).bfloat16(),
        conv=rnd(S, 3 * hd, W - 1).bfloat16(), state=0.3 * rnd(S, H, D, D),
        tape_state=torch.zeros(S, *ts, device=dev), tape_conv=torch.zeros(S, *tc, device=dev, dtype=torch.bfloat16),
        accepted=[torch.randint(0, T, (B,), generator=g, device=dev, dtype=torch.int32) for _ in range(ROTATIONS)])
    x["single"] = [[{n: v[i::T].contiguous() for n, v in t.items()} for i in range(T)] for t in x["tok"]]
    return x


def _check(verify, accept, x: dict, want: torch.Tensor, ref_state: torch.Tensor) -> tuple[float, float]:
    """(max rel err of the outputs, of the accepted states) of ``verify`` + ``accept`` on rotation 0 against
    the reference's; the live states restored after."""
    saved = (x["conv"].clone(), x["state"].clone())
    got = _verify_accept(verify, accept, x, 0)
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    serr = ((x["state"] - ref_state).abs().max() / ref_state.abs().max()).item()
    x["conv"].copy_(saved[0]), x["state"].copy_(saved[1])
    return err, serr


def _verify_accept(verify, accept, x: dict, r: int) -> torch.Tensor:
    t = x["tok"][r]
    out = verify(t["mixed_qkv"], x["conv"], x["conv_weight"], t["f"], x["A_log"], x["dt_bias"], t["beta_logit"],
                 t["g_out"], x["norm_weight"], x["state"], x["rows"][r], x["tape_state"], x["tape_conv"], num_heads=H,
                 f_b_weight=x["f_b"])
    accept(x["conv"], x["state"], x["rows"][r], x["accepted"][r], x["tape_state"], x["tape_conv"])
    return out


def _single_steps(x: dict, r: int, T: int) -> None:
    from latency_specialized.kernels.kda_decode import kda_decode

    for t in x["single"][r]:  # token i of every request, one single step each (the f_b gemm inside the kernel)
        kda_decode(t["mixed_qkv"], x["conv"], x["conv_weight"], t["f"], x["A_log"], x["dt_bias"], t["beta_logit"],
                   t["g_out"], x["norm_weight"], x["state"], x["rows"][r], num_heads=H, f_b_weight=x["f_b"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", default="1,8,64")
    p.add_argument("--k", default="3,7")
    p.add_argument("--out", default="kda_verify_bench.json")
    args = p.parse_args()
    from latency_specialized.kernels.kda_verify_triton import (candidate_configs, default_config, kda_accept_triton,
                                                               kda_accept_triton_with, kda_verify_triton,
                                                               kda_verify_triton_with)

    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for B in [int(b) for b in args.batch.split(",")]:
        for k in [int(v) for v in args.k.split(",")]:
            T = 1 + k
            x = _inputs(B, T, g)
            nbytes = (3 * B * H * D * D * 4 + 2 * B * T * H * 3 * D * 4 + 2 * B * 3 * H * D * (W - 1) * 2
                      + B * T * (5 * H * D + RANK + H) * 2 + H * D * RANK * 2)
            # the reference on the timed inputs (rotation 0, states restored after)
            saved = (x["conv"].clone(), x["state"].clone())
            want = _verify_accept(kda_verify_reference, kda_accept_reference, x, 0)
            ref_state = x["state"].clone()
            x["conv"].copy_(saved[0]), x["state"].copy_(saved[1])
            pairs = {"triton verify + accept": (kda_verify_triton, kda_accept_triton)}
            configs = {f"triton config {c.name}": c for c in candidate_configs(B, H, D)}
            for name, c in configs.items():
                pairs[name] = (functools.partial(kda_verify_triton_with, c),
                               functools.partial(kda_accept_triton_with, c))
            variants = {
                "torch-reference (today's plan)": lambda r: _verify_accept(kda_verify_reference, kda_accept_reference,
                                                                           x, r),
                **{name: functools.partial(_verify_accept, v, a, x) for name, (v, a) in pairs.items()},
                f"{T} single attention.kda.cutedsl steps": lambda r: _single_steps(x, r, T),
            }
            # every check before any timing: a timed variant moves the live states on (verify + accept per replay),
            # so a check after one would compare another starting state with the reference's
            checked: dict[str, tuple[dict, str]] = {}
            for name, pair in pairs.items():   # compiles it, and a wrong kernel is reported as such
                try:
                    err, serr = _check(*pair, x, want, ref_state)
                except Exception as e:  # noqa: BLE001 - reported in the results
                    checked[name] = ({}, f"{type(e).__name__}: {str(e)[:200]}")
                    continue
                ok = err <= MAX_OUT_REL_ERR and serr <= MAX_STATE_REL_ERR
                checked[name] = (dict(out_rel_err=err, state_rel_err=serr),
                                 "" if ok else f"WRONG: out rel err {err:.2e}, state rel err {serr:.2e}")
            timed = {}
            for name, fn in variants.items():
                errs, note = checked.get(name, ({}, ""))
                try:
                    us = [round(time_graph(fn, ROTATIONS), 2) for _ in range(2)]
                except Exception as e:  # noqa: BLE001 - reported in the results, never silently dropped
                    us, note = [], f"{type(e).__name__}: {str(e)[:200]}"
                best = min(us) if us else None
                if best is not None and name in configs and not note:
                    timed[name] = best
                row = dict(batch=B, k=k, rows=B * T, variant=name, us=us, bytes=nbytes,
                           roofline_us=round(nbytes / roofline_bandwidth() * 1e6, 2),
                           fraction=round(nbytes / roofline_bandwidth() * 1e6 / best, 3) if best else None, note=note,
                           **errs)
                if name in configs:
                    row["config"] = dataclasses.asdict(configs[name])
                rows.append(row)
                print(json.dumps(row), flush=True)
            default_name = f"triton config {default_config(B, H, D).name}"
            pick = min(timed, key=timed.get) if timed else None
            summary = dict(batch=B, k=k, variant="summary", best=pick, best_us=timed.get(pick),
                           best_config=dataclasses.asdict(configs[pick]) if pick else None,
                           default=default_name, default_us=timed.get(default_name),
                           speedup_vs_default=round(timed[default_name] / timed[pick], 3)
                           if pick and default_name in timed else None,
                           per_config_us=timed)
            rows.append(summary)
            print(json.dumps(summary), flush=True)
            del x
            torch.cuda.empty_cache()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, shapes=dict(H=H, D=D, W=W, rank=RANK),
                roofline_bytes_per_s=roofline_bandwidth())
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
