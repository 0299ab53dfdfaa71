"""Edge-code weights for the block-FP8 gemms' GPU tests: every finite e4m3 code under four scales per format, read back
through a gemm by one-hot tokens."""

from __future__ import annotations

from typing import Callable

import torch

from latency_specialized.quant.checkpoint_io import QuantizedWeight


def every_code_weight(fmt: str, ue8m0_bytes: tuple[int, int, int, int], device: str = "cuda") -> QuantizedWeight:
    """[4 blocks of rows, 256] e4m3 codes cycling through every finite code (+-0, subnormals, +-448); block row i
    scaled by ``ue8m0_bytes[i]`` (fp8-block-32) or by 1e-30 / 3.7e-3 / 1 / 6.5e30 (fp8-block-128)."""
    from latency_specialized.quant.formats import QuantFormat

    f = QuantFormat.get(fmt)
    r, c = f.block
    codes = torch.arange(256, device=device, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # no NaN codes
    K, N = 256, 4 * r
    w = codes.repeat(N * K // codes.numel() + 1)[: N * K].view(N, K).contiguous()
    nb, kb = N // r, K // c
    if f.scale == "ue8m0":
        sc = torch.tensor(ue8m0_bytes, device=device, dtype=torch.uint8)
        scale = sc.repeat_interleave(nb // 4).view(nb, 1).expand(nb, kb).contiguous().view(torch.float8_e8m0fnu)
    else:
        sc = torch.tensor([1e-30, 3.7e-3, 1.0, 6.5e30], device=device)
        scale = sc.repeat_interleave(nb // 4).view(nb, 1).expand(nb, kb).contiguous()
    return QuantizedWeight(f, (N, K), w.view(torch.float8_e4m3fn), scale, name=f"edge-{fmt}.weight")


def read_back(gemm: Callable[..., torch.Tensor], q: QuantizedWeight) -> torch.Tensor:
    """W[N, K] as ``gemm(x, q, out_dtype=fp32)`` computes it: 64 one-hot tokens at a time, y[m, n] = W[n, i + m]."""
    N, K = q.shape
    got = torch.empty(N, K, device=q.weight.device)
    eye = torch.eye(K, device=q.weight.device, dtype=torch.bfloat16)
    for i in range(0, K, 64):
        got[:, i:i + 64] = gemm(eye[i:i + 64], q, out_dtype=torch.float32).t()
    return got
