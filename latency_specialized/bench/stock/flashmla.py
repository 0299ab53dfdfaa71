"""FlashMLA - what stock vLLM 0.33 runs for MLA decode on Hopper - for the stock MLA compositions.

vLLM's wheel carries FlashMLA prebuilt against torch 2.14, which cannot load beside the device's torch, so the
bench builds FlashMLA's SM90 dense decode (scheduler metadata, split-KV and combine kernels) from a checkout
(github.com/deepseek-ai/FlashMLA, its ``csrc/cutlass`` submodule populated) named by ``LS_FLASHMLA_SRC``, with the
flags of its ``setup.py`` for ``sm_90a``. Where the variable is unset the stock MLA composition runs our Triton
kernel as a stand-in, and the results' notes say which ran (``mla_note``).

``StockFlashMLA`` is the attention call as vLLM's MLA decode composes it around FlashMLA: the new latent row
written into the paged cache (``concat_and_cache_mla``: one Triton kernel here, as stock's one CUDA kernel),
``bmm`` with W_UK, ``cat`` with the rope query, FlashMLA (split-KV + combine), ``bmm`` with W_UV, the head-major
copy, the output gate in torch.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from latency_specialized.errors import UserError
from latency_specialized.kernels.mla_common import write_new_latents

SOURCE_ENV = "LS_FLASHMLA_SRC"
SOURCES = ("csrc/sm90/decode/dense/instantiations/bf16.cu", "csrc/smxx/decode/combine/combine.cu",
           "csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu")
"""FlashMLA's translation units of the SM90 dense decode (bf16)."""
HEADERS = ("csrc/api/dense_decode.h", "csrc/cutlass/include/cute/tensor.hpp")
"""Files a usable checkout must hold besides ``SOURCES`` (the second: the CUTLASS submodule is populated)."""
BLOCK_SIZE = 64
"""FlashMLA's only paged-cache block size."""
LATENT = 512
"""FlashMLA's only value width (``head_size_v``): the latent rank (kv_lora_rank) of DeepSeek-style MLA."""
BINDING = """#include <pybind11/pybind11.h>
#include "dense_decode.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("dense_decode_fwd", &dense_attn_decode_interface); }
"""
"""The one function the bench needs, bound from FlashMLA's own interface header."""
NVCC_FLAGS = ("-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-DFLASH_MLA_DISABLE_FP16",
              "-Wno-deprecated-declarations", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr",
              "--expt-extended-lambda", "--use_fast_math", "-lineinfo", "-gencode", "arch=compute_90a,code=sm_90a")
"""FlashMLA's ``setup.py`` flags for its SM90 kernels (wgmma needs ``sm_90a``)."""


def flashmla_source() -> Path | None:
    """The FlashMLA checkout named by ``LS_FLASHMLA_SRC`` (None where unset); a UserError naming what is missing
    where it is set but not usable."""
    raw = os.environ.get(SOURCE_ENV, "").strip()
    if not raw:
        return None
    src = Path(raw)
    missing = [f for f in (*SOURCES, *HEADERS) if not (src / f).is_file()]
    if missing:
        raise UserError(f"{SOURCE_ENV}={raw} is not a usable FlashMLA checkout: missing {', '.join(missing)}. "
                        "Clone github.com/deepseek-ai/FlashMLA with its csrc/cutlass submodule "
                        "(git submodule update --init csrc/cutlass), or unset the variable to run the stand-in")
    return src


@functools.cache
def load_flashmla(src: Path, build_dir: Path | None = None, jobs: int = 8):
    """Compile (or load the cached build of) FlashMLA's SM90 dense decode as a torch extension with one function,
    ``dense_decode_fwd`` (FlashMLA's ``dense_attn_decode_interface``). Needs nvcc and ninja (the H200 image has
    both); the first build takes ~1.5 min there."""
    from torch.utils.cpp_extension import load

    build_dir = Path(build_dir or Path(os.environ.get("LS_KERNEL_CACHE_DIR", "/tmp")) / "flashmla_build")
    build_dir.mkdir(parents=True, exist_ok=True)
    binding = build_dir / "flashmla_dense_binding.cu"  # nvcc, not g++: CUDA 13 keeps cuda/std in its CCCL dir
    if not binding.is_file() or binding.read_text() != BINDING:
        binding.write_text(BINDING)
    os.environ.setdefault("MAX_JOBS", str(jobs))
    csrc = src / "csrc"
    return load(name="flashmla_dense_decode", build_directory=str(build_dir), verbose=False,
                sources=[str(binding), *(str(src / s) for s in SOURCES)],
                extra_cflags=["-O3", "-std=c++20", "-DNDEBUG", "-DFLASH_MLA_DISABLE_FP16"],
                extra_cuda_cflags=list(NVCC_FLAGS),
                extra_include_paths=[str(p) for p in (csrc, csrc / "api", csrc / "kerutils/include", csrc / "sm90",
                                                      csrc / "cutlass/include", csrc / "cutlass/tools/util/include")])


_ROOFLINE = ("Roofline: the latent KV cache of 'context' tokens per sequence is read once per step (paged, block "
             "size 64).")


def mla_note() -> str:
    """What the stock MLA compositions' results must say about their attention kernel."""
    src = os.environ.get(SOURCE_ENV, "").strip()
    if src:
        return (f"MLA layers: stock runs FlashMLA (built from {src} for sm_90a: stock vLLM 0.33's MLA decode kernel "
                "on Hopper) inside vLLM's decode composition - concat_and_cache_mla (a one-kernel Triton stand-in), "
                "bmm W_UK, cat, FlashMLA split-KV + combine, bmm W_UV, head-major copy, output gate in torch "
                "(bench/stock/flashmla.py); ours runs attention.mla.triton_splitkv. " + _ROOFLINE)
    return ("MLA layers: both variants run the same MLA decode attention (attention.mla.triton_splitkv, a Triton "
            f"split-KV kernel standing in for stock's FlashMLA: {SOURCE_ENV} unset - set it to a FlashMLA checkout "
            "to run the real kernel, bench/stock/flashmla.py; ours fuses the kv_a RMSNorm into its latent write, "
            "stock runs that norm as a kernel of its own), so MLA cells compare everything around that kernel. "
            + _ROOFLINE)


def concat_and_cache_reference(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                               slot_mapping: torch.Tensor) -> None:
    """``kv_cache.view(-1, L + R)[slot] = [kv_c | k_pe]`` for every row with a slot >= 0 (torch, no host sync)."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    write_new_latents(flat, torch.cat([kv_c, k_pe], dim=-1).to(flat.dtype), slot_mapping)


@functools.cache
def _cache_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def concat_and_cache_kernel(kv_c, k_pe, cache, slots, s_c, s_pe, L: tl.constexpr, R: tl.constexpr,
                                BL: tl.constexpr, BR: tl.constexpr):
        row = tl.program_id(0)
        slot = tl.load(slots + row).to(tl.int64)
        if slot >= 0:
            lo = tl.arange(0, BL)
            tl.store(cache + slot * (L + R) + lo, tl.load(kv_c + row * s_c + lo, mask=lo < L), mask=lo < L)
            ro = tl.arange(0, BR)
            tl.store(cache + slot * (L + R) + L + ro, tl.load(k_pe + row * s_pe + ro, mask=ro < R), mask=ro < R)

    return concat_and_cache_kernel


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """One launch, one program per row (stock's ``concat_and_cache_mla``): kv_c [M, L], k_pe [M, R] (unit last
    stride), kv_cache [blocks, block, L + R] contiguous, slot_mapping [M] int (< 0: no write)."""
    import triton

    M, L = kv_c.shape
    R = k_pe.shape[1]
    assert kv_c.stride(1) == 1 and k_pe.stride(1) == 1 and kv_cache.is_contiguous()
    _cache_kernel()[(M,)](kv_c, k_pe, kv_cache, slot_mapping, kv_c.stride(0), k_pe.stride(0), L=L, R=R,
                          BL=triton.next_power_of_2(L), BR=triton.next_power_of_2(R))


class StockFlashMLA:
    """One layer's stock MLA decode call around FlashMLA, with the contract of ``mla_decode_triton`` (the stock
    layer calls either): q [B, H, nope + R], kv_c [B, L], k_pe [B, R], kv_cache [blocks, 64, L + R] bf16,
    slot_mapping [B], block_table [B, W] int32, seq_lens [B] int32, w_kv_b [H (nope + v), L] -> [B, H v].

    W_UK / W_UV are split off ``w_kv_b`` once (vLLM does it at load). FlashMLA's tile-scheduler metadata is
    computed by the first call and reused: it depends on ``seq_lens``' values, which the stock layers keep fixed
    (vLLM computes it once per step, for all layers)."""

    def __init__(self, w_kv_b: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int, module=None,
                 cache_writer=None):
        H, nope, v = num_heads, qk_nope_head_dim, v_head_dim
        L = w_kv_b.shape[1]
        if L != LATENT:
            raise UserError(f"FlashMLA decodes a latent of {LATENT} only (this layer's kv_lora_rank is {L}): "
                            f"unset {SOURCE_ENV} to run the stand-in for this shape")
        w = w_kv_b.view(H, nope + v, L)
        self.w_kv_b, self.H, self.nope, self.v, self.L = w_kv_b, H, nope, v, L
        self.w_uk = w[:, :nope].contiguous()                    # [H, nope, L]
        self.w_uv_t = w[:, nope:].transpose(1, 2).contiguous()  # [H, L, v]
        self.module = module
        self.cache_writer = cache_writer or concat_and_cache_mla
        self.meta: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, q, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, w_kv_b, *, qk_nope_head_dim,
                 v_head_dim, scale=None, gate=None, out=None) -> torch.Tensor:
        B, H, _ = q.shape
        nope, v, L = self.nope, self.v, self.L
        if w_kv_b is not self.w_kv_b or (H, qk_nope_head_dim, v_head_dim) != (self.H, nope, v):
            raise ValueError("StockFlashMLA: called with another layer's weights or shapes")
        if kv_cache.shape[1] != BLOCK_SIZE:
            raise UserError(f"FlashMLA pages the cache in blocks of {BLOCK_SIZE} (this cache: {kv_cache.shape[1]})")
        R = q.shape[-1] - nope
        scale = (nope + R) ** -0.5 if scale is None else scale
        self.cache_writer(kv_c, k_pe, kv_cache, slot_mapping)
        q_lat = torch.bmm(q[..., :nope].transpose(0, 1), self.w_uk).transpose(0, 1)            # [B, H, L]
        q_all = torch.cat([q_lat, q[..., nope:]], dim=-1).unsqueeze(1)                        # [B, 1, H, L + R]
        paged = kv_cache.view(kv_cache.shape[0], BLOCK_SIZE, 1, kv_cache.shape[-1])
        meta = self.meta or (None, None)
        o_lat, _, sched, splits = self.module.dense_decode_fwd(q_all, paged, L, seq_lens, block_table, scale, False,
                                                               meta[0], meta[1])
        if self.meta is None:
            self.meta = (sched, splits)
        o = torch.bmm(o_lat.view(B, H, L).transpose(0, 1), self.w_uv_t).transpose(0, 1)       # [B, H, v] view
        y = torch.empty(B, H * v, device=q.device, dtype=q.dtype) if out is None else out
        if gate is None:  # the head-major copy
            y.view(B, H, v).copy_(o)
        else:  # the gate's multiply writes the head-major layout
            torch.mul(o, torch.sigmoid(gate).view(B, H, v), out=y.view(B, H, v))
        return y


def stock_flashmla(w_kv_b: torch.Tensor, num_heads: int, qk_nope_head_dim: int,
                   v_head_dim: int) -> StockFlashMLA | None:
    """The layer's FlashMLA call where ``LS_FLASHMLA_SRC`` names a checkout (built on first use), else None."""
    src = flashmla_source()
    if src is None:
        return None
    return StockFlashMLA(w_kv_b, num_heads, qk_nope_head_dim, v_head_dim, module=load_flashmla(src))


__all__ = ["BLOCK_SIZE", "LATENT", "SOURCE_ENV", "StockFlashMLA", "concat_and_cache_mla", "concat_and_cache_reference",
           "flashmla_source", "load_flashmla", "mla_note", "stock_flashmla"]
