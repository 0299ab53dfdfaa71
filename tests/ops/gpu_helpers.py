"""Helpers shared by the GPU op tests (imported as a sibling module by pytest's rootdir import)."""

from __future__ import annotations

import zlib

import torch


def seeded_generator(seed: int | str, device: str = "cuda") -> torch.Generator:
    """A device generator; string seeds hash with crc32 (stable across processes, unlike hash())."""
    if isinstance(seed, str):
        seed = zlib.crc32(seed.encode())
    return torch.Generator(device=device).manual_seed(seed)


def graph_replay(fn) -> torch.cuda.CUDAGraph:
    """Capture ``fn`` in a CUDA graph (after one warm-up call on a side stream) and replay it once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return g


def random_experts(E: int, N: int, K: int, g: torch.Generator, dtype: torch.dtype = torch.bfloat16,
                   device: str = "cuda") -> torch.Tensor:
    """``[E, N, K]`` normal weights scaled by ``K ** -0.5``, in ``dtype``, drawn a few experts at a time: no fp32 draw
    of a whole rank's experts beside the result (Kimi K3 TP8's gate_up alone would be 9.9 GB of it)."""
    out = torch.empty(E, N, K, dtype=dtype, device=device)
    step = max(1, (256 << 20) // (N * K * 4))     # <= 256 MB of fp32 per draw
    for e in range(0, E, step):
        n = min(step, E - e)
        out[e:e + n] = (torch.randn(n, N, K, generator=g, device=device) * K ** -0.5).to(dtype)
    return out


def quantized_rows(name: str, N: int, K: int, fmt: str, device: str = "cuda"):
    """A random [N, K] weight whose rows span two decades of magnitude, stored as ``fmt`` (QuantizedWeight)."""
    from latency_specialized.quant.checkpoint_io import quantize_weight

    g = seeded_generator(name, device)
    w = torch.randn(N, K, generator=g, device=device) * K ** -0.5
    return quantize_weight(f"{name}.weight", w * torch.logspace(-1, 1, N, device=device).unsqueeze(1), fmt)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max())


def check_gemm_into_poisoned_slice(gemm, x: torch.Tensor, w, r: torch.Tensor, ref: torch.Tensor, tol: float,
                                   **kw) -> torch.Tensor:
    """``gemm(x, w, residual=r, out=<a NaN-poisoned column slice of a wider tensor>, **kw)``: written in place, fully,
    nothing outside touched, within ``tol`` of ``ref``, and bit-identical when called again (deterministic)."""
    M, N = r.shape
    wide = torch.full((M, N + 16), float("nan"), device=r.device, dtype=torch.bfloat16)
    out = wide[:, 8:8 + N]
    y = gemm(x, w, residual=r, out=out, **kw)
    assert y.data_ptr() == out.data_ptr() and torch.isfinite(y).all(), kw
    assert wide[:, :8].isnan().all() and wide[:, 8 + N:].isnan().all(), kw
    assert rel_err(y, ref) <= tol, (kw, rel_err(y, ref))
    assert torch.equal(gemm(x, w, residual=r, **kw), y), kw
    return y
