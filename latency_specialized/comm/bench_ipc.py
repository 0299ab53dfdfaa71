"""Timing of the fused all-reduce kernels on ONE GPU - NOT representative of NVLink.

    python -m latency_specialized.comm.bench_ipc --out DIR [--worlds 2 4 8] [--tokens 1 2 4 ...]

Two set-ups, both on the single test GPU, reported separately:

* ``multi_process``: W processes share the GPU through CUDA IPC (the real communicator). Their
  CUDA contexts time-slice: a rank's kernel spins until the scheduler runs its peers' contexts,
  so these numbers measure context switching, not the kernel.
* ``single_process``: the W ranks are W streams of one process (plain device buffers, same
  kernels, captured in one CUDA graph), so every rank's CTAs run at once. "Peer" stores are
  local HBM writes and W ranks share one GPU's SMs and bandwidth: a lower bound on the work,
  still not an NVLink figure. Only cells whose W x M CTAs fit on the SMs at once are run
  (every CTA spins on the others').

Writes ``allreduce_single_gpu_ipc.json`` and ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from latency_specialized.comm import layout as L

ALGOS = ("one_shot", "two_stage")
EPS = 1e-5


def _fns():
    from latency_specialized.kernels.allreduce_lamport import allreduce_lamport
    from latency_specialized.kernels.allreduce_two_stage import allreduce_two_stage

    return {"one_shot": allreduce_lamport, "two_stage": allreduce_two_stage}


def _inputs(M: int, n: int, dtype: torch.dtype, device, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    p = torch.randn(M, n, generator=g).to(dtype).to(device)
    r = torch.randn(M, n, generator=g).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).to(device)
    return p, r, w


def _time_events(fn, reps: int) -> float:
    """Milliseconds per rep of ``fn`` (enqueued back to back) between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def bench_rank(rank: int, world_size: int, tokens: list[int], eager_iters: int, graph_calls: int, graph_reps: int,
               hidden: int) -> list[dict]:
    """Per-rank body of the multi-process benchmark (inside run_world)."""
    import torch.distributed as dist

    from latency_specialized.comm.symmetric import SymmetricMemoryCommunicator

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    comm = SymmetricMemoryCommunicator(None, hidden=hidden, dtype="bfloat16", max_tokens=max(tokens), device=dev)
    fns, rows = _fns(), []
    for algo in ALGOS:
        for M in tokens:
            p, r, w = _inputs(M, hidden, torch.bfloat16, dev, 1000 * rank + M)
            call = lambda: fns[algo](p, r, w, EPS, comm=comm)  # noqa: E731
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            eager_ms = _time_events(call, eager_iters)
            wall_eager_ms = (time.perf_counter() - t0) * 1e3 / eager_iters
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(graph_calls):
                    call()
            g.replay()
            torch.cuda.synchronize()
            dist.barrier()
            graph_ms = _time_events(g.replay, graph_reps) / graph_calls
            rows.append({"world_size": world_size, "algo": algo, "tokens": M,
                         "message_bytes": L.message_bytes(M, hidden, "bfloat16"),
                         "eager_us": 1e3 * eager_ms, "eager_wall_us": 1e3 * wall_eager_ms, "graph_us": 1e3 * graph_ms})
            del g
    torch.cuda.synchronize()
    comm.destroy()
    return rows


def bench_single_process(world_size: int, tokens: list[int], graph_calls: int, graph_reps: int,
                         hidden: int) -> list[dict]:
    """W ranks as W streams of this process, one CUDA graph per cell."""
    from latency_specialized.comm.symmetric import SymmetricMemoryCommunicator
    from latency_specialized.kernels.allreduce_common import FusedAllReduceConfig

    dev = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    threads, _ = FusedAllReduceConfig("bfloat16", hidden, world_size).threads_and_vpt
    fits = [M for M in tokens if world_size * M <= sms]  # one CTA per SM at least: all resident
    world = SymmetricMemoryCommunicator.single_process_world(world_size, hidden=hidden, dtype="bfloat16",
                                                             max_tokens=max(fits), device=dev)
    streams = [torch.cuda.Stream(dev) for _ in range(world_size)]
    fns, rows = _fns(), []
    for algo in ALGOS:
        for M in fits:
            ins = [_inputs(M, hidden, torch.bfloat16, dev, 1000 * r + M) for r in range(world_size)]

            def step(n: int) -> None:
                main = torch.cuda.current_stream()
                for r, s in enumerate(streams):
                    s.wait_stream(main)
                    with torch.cuda.stream(s):
                        for _ in range(n):
                            fns[algo](*ins[r], EPS, comm=world[r])
                for s in streams:
                    main.wait_stream(s)

            step(2)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step(graph_calls)
            g.replay()
            torch.cuda.synchronize()
            ms = _time_events(g.replay, graph_reps) / graph_calls
            rows.append({"world_size": world_size, "algo": algo, "tokens": M,
                         "message_bytes": L.message_bytes(M, hidden, "bfloat16"), "graph_us": 1e3 * ms,
                         "threads_per_cta": threads})
            del g
    torch.cuda.synchronize()
    return rows


def crossover(rows: list[dict], key: str) -> dict[int, int | None]:
    """Per world size: the smallest message (bytes) from which two-stage is faster, or None."""
    out: dict[int, int | None] = {}
    for W in sorted({r["world_size"] for r in rows}):
        cells = {(r["algo"], r["tokens"]): r for r in rows if r["world_size"] == W}
        faster = [cells[("two_stage", M)]["message_bytes"] for (a, M) in sorted(cells)
                  if a == "one_shot" and ("two_stage", M) in cells
                  and cells[("two_stage", M)][key] < cells[("one_shot", M)][key]]
        out[W] = min(faster) if faster else None
    return out


def _markdown(result: dict) -> str:
    lines = ["# Fused all-reduce + residual + RMSNorm on ONE H200 (NOT representative of NVLink)", "",
             f"Machine: {result['device']}; hidden {result['hidden']} bf16; torch {result['torch']}; "
             f"{result['date']}.", "",
             "**Read this first.** All ranks share one GPU. In `multi_process` the W ranks are processes "
             "exchanging CUDA IPC handles (the real communicator); their contexts time-slice, so a "
             "rank's kernel waits for the scheduler to run its peers: these times measure context "
             "switching, not the kernel, and say nothing about NVLink latency. In `single_process` the "
             "ranks are W streams of one process running the same kernels concurrently (one CUDA graph); "
             "peer stores are local HBM writes and the ranks share the SMs and HBM bandwidth. Neither is "
             "an NVLink figure; the TP=4/8 one-shot limits in `kernels/allreduce_common.py` are not derived from them.",
             ""]
    for mode, key in (("multi_process", "graph_us"), ("single_process", "graph_us")):
        rows = result[mode]
        if not rows:
            continue
        lines += [f"## {mode}", ""]
        if mode == "multi_process":
            lines += ["| W | tokens | message KiB | one-shot eager us | one-shot graph us | two-stage eager us | "
                      "two-stage graph us |", "|---|---|---|---|---|---|---|"]
        else:
            lines += ["| W | tokens | message KiB | one-shot graph us | two-stage graph us |", "|---|---|---|---|---|"]
        cells = {(r["world_size"], r["algo"], r["tokens"]): r for r in rows}
        for W, M in sorted({(r["world_size"], r["tokens"]) for r in rows}):
            o, t = cells.get((W, "one_shot", M)), cells.get((W, "two_stage", M))
            kib = (o or t)["message_bytes"] / 1024
            if mode == "multi_process":
                lines.append(f"| {W} | {M} | {kib:.0f} | {o['eager_us']:.1f} | {o['graph_us']:.1f} | "
                             f"{t['eager_us']:.1f} | {t['graph_us']:.1f} |")
            else:
                lines.append(f"| {W} | {M} | {kib:.0f} | {o['graph_us']:.1f} | {t['graph_us']:.1f} |")
        cross = result["crossover_bytes"][mode]
        lines += ["", "Two-stage faster from (graph times): " + ", ".join(
            f"W={W}: {'never in range' if b is None else f'{b / 1024:.0f} KiB'}" for W, b in cross.items()), ""]
    return "\n".join(lines) + "\n"


def standard_configs(worlds=(2, 4, 8)) -> list:
    """(kernel name, config) of everything the GPU tests and this benchmark run."""
    from latency_specialized.kernels import allreduce_lamport, allreduce_two_stage
    from latency_specialized.kernels.allreduce_common import FusedAllReduceConfig

    return [(name, FusedAllReduceConfig(dtype, n, W, has_norm))
            for W in worlds for name in (allreduce_lamport.KERNEL_NAME, allreduce_two_stage.KERNEL_NAME)
            for dtype, n in (("bfloat16", 7168), ("float32", 2048)) for has_norm in (True, False)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="directory for the JSON / Markdown results")
    ap.add_argument("--precompile", metavar="DIR", help="only compile+export the kernels into DIR and exit")
    ap.add_argument("--workers", type=int, default=1, help="compile processes for --precompile")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8], help="single-process world sizes")
    ap.add_argument("--mp-worlds", type=int, nargs="+", default=None,
                    help="multi-process world sizes (default: --worlds)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--eager-iters", type=int, default=20)
    ap.add_argument("--graph-calls", type=int, default=5)
    ap.add_argument("--graph-reps", type=int, default=4)
    ap.add_argument("--sp-graph-calls", type=int, default=20)
    ap.add_argument("--sp-graph-reps", type=int, default=20)
    ap.add_argument("--skip-multi-process", action="store_true")
    ap.add_argument("--timeout", type=float, default=180.0, help="watchdog per multi-process world (s)")
    args = ap.parse_args(argv)
    if args.precompile:
        from latency_specialized.kernels.allreduce_precompile import precompile

        t0 = time.perf_counter()
        done = precompile(args.precompile, standard_configs(tuple(args.worlds)), workers=args.workers)
        for path, status in done:
            print(f"{status:>9}  {Path(path).name}")
        print(f"precompiled {len(done)} kernels in {time.perf_counter() - t0:.1f} s", flush=True)
        return 0
    if not args.out:
        ap.error("--out is required (or --precompile)")
    from latency_specialized.comm.worlds import run_world

    result = {"device": torch.cuda.get_device_name(0), "hidden": args.hidden, "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "multi_process": [], "single_process": [],
              "notes": "single GPU: not representative of NVLink (see the markdown)"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        result["crossover_bytes"] = {m: crossover(result[m], "graph_us") for m in ("multi_process", "single_process")}
        (out / "allreduce_single_gpu_ipc.json").write_text(json.dumps(result, indent=1))
        (out / "allreduce_single_gpu_ipc.md").write_text(_markdown(result))

    if not args.skip_multi_process:  # first: it also sizes the GPU test session
        for W in args.mp_worlds or args.worlds:
            t0 = time.perf_counter()
            per_rank = run_world(bench_rank, W, args.tokens, args.eager_iters, args.graph_calls, args.graph_reps,
                                 args.hidden, timeout=args.timeout)
            # the slowest rank bounds the collective: report the max over ranks per cell
            for cells in zip(*per_rank):
                row = dict(cells[0])
                for k in ("eager_us", "eager_wall_us", "graph_us"):
                    row[k] = max(c[k] for c in cells)
                result["multi_process"].append(row)
            print(f"multi-process W={W}: {time.perf_counter() - t0:.1f} s", flush=True)
            save()
    for W in args.worlds:
        t0 = time.perf_counter()
        result["single_process"] += bench_single_process(W, args.tokens, args.sp_graph_calls, args.sp_graph_reps,
                                                         args.hidden)
        print(f"single-process W={W}: {time.perf_counter() - t0:.1f} s", flush=True)
        save()
    save()
    print((out / "allreduce_single_gpu_ipc.md").read_text())
    return 0


if __name__ == "__main__":
    from latency_specialized.comm.symmetric import disable_multicast_env

    disable_multicast_env()
    raise SystemExit(main())
