"""Baseline for the fused all-reduce: NCCL all_reduce + separate residual add + RMSNorm, one process per GPU.

    torchrun-free: python benchmarks/scripts/nccl_allreduce_norm.py --world 2 --out results.json

Times (CUDA events over CUDA-graph replays of 20 calls, median of 15) the stock composition for
tokens 1..64 x hidden 7168/5120/8192/6144 in bf16. Multicast stays off (NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDENS = (7168, 5120, 8192, 6144)
TOKENS = (1, 2, 4, 8, 16, 32, 64)


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    for hidden in HIDDENS:
        w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        for m in TOKENS:
            x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)

            def step():
                y = x.clone()
                dist.all_reduce(y)
                h = y + res
                hf = h.float()
                return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()).to(torch.bfloat16)

            for _ in range(5):
                step()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                step()
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(g):
                for _ in range(20):
                    step()
            times = []
            for _ in range(15):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                dist.barrier()
                a.record()
                g.replay()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) * 1000 / 20)
            rows.append({"hidden": hidden, "tokens": m, "us": statistics.median(times)})
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"world": world, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "nccl": ".".join(map(str, torch.cuda.nccl.version())), "rows": rows}, f, indent=1)
        for r in rows:
            print(f"nccl+norm W={world} hidden={r['hidden']} M={r['tokens']}: {r['us']:.2f} us")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=torch.cuda.device_count())
    p.add_argument("--out", default="nccl_allreduce_norm.json")
    a = p.parse_args()
    port = 29500 + os.getpid() % 1000
    mp.spawn(_rank, args=(a.world, port, a.out), nprocs=a.world)


if __name__ == "__main__":
    main()
