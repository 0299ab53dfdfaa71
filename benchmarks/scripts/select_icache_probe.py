"""Does the indexer's radix select pay for a cold instruction cache inside its layer?

Session 51 timed GLM-5.3's select at ~28 us a call inside its layer and ~20 alone on the layer's own logits and
arguments (``kernels/NOTES_indexer.md``). Its sm_90a code is large - 88 KB at that configuration, 169 KB with the
finer widths, 59 KB with the leading-byte counts and packed scans (offline SASS, session 52) - against an SM's
~128 KB instruction cache, and inside a layer ~20 other kernels run on every SM between two selects. Alone, in a
graph of back-to-back selects, the code stays cached on the SM that runs it.

Each case is a CUDA graph of ``--calls`` repetitions of [a kernel on every SM, then the select on fresh logits],
timed by CUDA events over replays (median), minus the same graph without the select:

- ``none``: no kernel before (the select back to back, as ``topk_bench.py`` times it);
- ``loop``: a small-code kernel on every SM (a runtime-bound FMA loop, ~the big one's duration);
- ``big``: a kernel of ``--asm-kb`` of straight-line code on every SM (inline PTX FMAs with distinct constants),
  which evicts whatever else was cached;
- ``big2``: as ``big`` with the select launched twice; the second call's time (``big2`` minus ``big``) is the
  select with its code just loaded.

``big`` against ``loop`` is the cold-code cost; the variants (``--variants``: base, packed, fine, w8, loop - the row
re-read in tiles each pass: small code) say how it scales with the code's size. Prints a table, writes ``--out`` (JSON).

    python benchmarks/scripts/select_icache_probe.py --out /tmp/icache.json
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from latency_specialized.bench.ops_bench_moe_kda import time_graph  # noqa: E402 (after the path set-up)

# packed pinned: session 53 measured these with the packed scans off, the default then (on since)
VARIANTS = dict(base=dict(packed=False), packed=dict(packed=True), fine=dict(fine=True, packed=False),
                w8=dict(warps=8, packed=False), loop=dict(resident_max=0, packed=False))


def _hex_f32(x: float) -> str:
    return "0f" + struct.pack(">f", x).hex().upper()


def _kernels(asm_kb: int):
    import triton
    import triton.language as tl

    # 16 bytes an sm_90 instruction; distinct constants so that nothing folds
    n = asm_kb * 1024 // 16
    asm = "mov.b32 $0, $1;\n" + "\n".join(
        f"fma.rn.f32 $0, $0, {_hex_f32(1.0 + i * 1e-7)}, {_hex_f32(i * 1e-9)};" for i in range(n))

    @triton.jit
    def big(x, ASM: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x + offs)
        v = tl.inline_asm_elementwise(ASM, "=f,f", [v], dtype=tl.float32, is_pure=True, pack=1)
        tl.store(x + offs, v)

    @triton.jit
    def loop(x, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x + offs)
        for i in range(n):
            v = v * 1.0000001 + 1e-9
        tl.store(x + offs, v)

    return big, loop, asm, n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--capacity", type=int, default=4416, help="block table width (GLM-5.3 at context 4096: 4,416)")
    p.add_argument("--live", type=int, default=4097)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--asm-kb", type=int, default=128, help="PTX FMAs of this many KB at 16 B each (ptxas makes ~1.8x)")
    p.add_argument("--variants", default="base,packed,fine,w8,loop")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    from latency_specialized.kernels import indexer_triton as ix

    select = ix._kernels(False)["select"]
    big, loop, asm, n_fma = _kernels(args.asm_kb)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    block = 128
    scratch = torch.zeros(sms * 2 * block, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = []
    for _ in range(args.calls):
        x = torch.randn(1, args.capacity, device="cuda", generator=g)
        x = x.clamp(min=0) + 0.5 * torch.randn(1, args.capacity, device="cuda", generator=g).clamp(min=0) ** 2
        x[:, args.live:] = float("-inf")
        logits.append(x)
    lens = torch.full((1,), args.live, dtype=torch.int32, device="cuda")
    out = torch.empty(1, args.k, dtype=torch.int32, device="cuda")

    def pre(kind: str) -> None:
        if kind in ("big", "big2"):
            big[(sms * 2,)](scratch, ASM=asm, BLOCK=block, num_warps=4)
        elif kind == "loop":
            loop[(sms * 2,)](scratch, n_fma, BLOCK=block, num_warps=4)

    rows = []
    for name in args.variants.split(","):
        kw = VARIANTS[name]

        def sel(r: int) -> None:
            ix.launch_select(select, logits[r], lens, out, args.k, args.capacity, **kw)

        result = dict(variant=name, config=ix.select_config(args.capacity, **kw)[0])
        for kind in ("none", "loop", "big", "big2"):
            def with_select(r: int, kind: str = kind) -> None:
                pre(kind)
                sel(r)
                if kind == "big2":
                    sel(r)

            def alone(r: int, kind: str = kind) -> None:
                pre(kind)

            t_all = time_graph(with_select, args.calls)
            t_pre = time_graph(alone, args.calls) if kind != "none" else 0.0
            result[kind] = round(t_all - t_pre, 2)
            result[f"{kind}_pre_us"] = round(t_pre, 2)
        result["big2_second"] = round(result["big2"] - result["big"], 2)
        rows.append(result)
        print(f"{name:7s} select after: none {result['none']:6.2f}  loop {result['loop']:6.2f}  "
              f"big {result['big']:6.2f}  second call after big {result['big2_second']:6.2f} us "
              f"(pre kernels: loop {result['loop_pre_us']:.2f}, big {result['big_pre_us']:.2f} us)", flush=True)
    args.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(0), asm_kb=args.asm_kb, calls=args.calls,
                                        capacity=args.capacity, live=args.live, k=args.k, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
