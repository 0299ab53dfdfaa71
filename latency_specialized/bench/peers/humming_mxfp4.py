"""Peer: stock vLLM 0.33's MXFP4 routed experts on Hopper (SM90), run through ``humming-kernels``.

What stock vLLM 0.33 runs (read in the vllm-0.33.0 wheel; NOTES.md beside this file has the details)
----------------------------------------------------------------------------------------------------
Selection. Kimi K3 ships its routed experts as compressed-tensors ``mxfp4-pack-quantized``;
``vllm/model_executor/models/config.py::KimiK3ForConditionalGenerationConfig`` rewrites the checkpoint's
``quant_method`` to ``"mxfp4"``, so the experts get ``Mxfp4Config`` -> ``Mxfp4MoEMethod``
(``vllm/model_executor/layers/quantization/mxfp4.py``), not compressed-tensors' own W4A4 MXFP4 method
(which would pick Marlin on SM90). ``Mxfp4MoEMethod.__init__`` calls
``select_deepseek_v4_mxfp4_moe_backend`` (``vllm/model_executor/layers/fused_moe/oracle/mxfp4.py``):
with ``moe_backend="auto"`` the priority list is ``_get_priority_backends()`` = [FLASHINFER_TRTLLM_MXFP4_MXFP8,
DEEPGEMM_MXFP4, MARLIN, BATCHED_MARLIN, HUMMING], reordered by ``prioritize_humming``
(``quantization/utils/humming/priority.py``: on compute capability 9.0 Humming goes just before Marlin).
The first two need SM100, so an H100/H200 gets ``Mxfp4MoeBackend.HUMMING`` with bf16 activations (W4A16;
no activation key for this checkpoint, ``VLLM_HUMMING_INPUT_QUANT_CONFIG`` unset). Of its experts classes
(``fused_moe/experts/fused_humming_moe.py``) ``HummingIndexedExperts`` is the one that accepts a
tensor-parallel deployment: ``get_humming_moe_gemm_type`` answers ``"indexed"`` without expert parallelism
(``HummingGroupedExperts``, ``grouped_contiguous``, with EP; ``BatchedHummingGroupedExperts`` with a batched
all-to-all). This peer is the indexed (TP) path.

Load (:meth:`HummingMxfp4MoE.prepare`). ``Mxfp4MoEMethod.process_weights_after_loading`` -> ``_setup_kernel``
-> ``convert_weight_to_mxfp4_moe_kernel_format`` (HUMMING) -> ``convert_to_humming_moe_kernel_format(layer,
quant_config={"quant_method": "mxfp4"})`` (``quantization/utils/humming/moe.py``), for w13 (N = 2I, K = hidden,
stacked as [I, I]) and w2 (N = hidden, K = I):

1. ``Mxfp4WeightSchema.convert_humming``: the packed bytes viewed as int32 ``[E, N, K/8]``, the ue8m0 scales as
   ``float8_e8m0fnu``; schema ``HummingWeightSchema(b_dtype=float4e2m1, bs_dtype=float8e8m0, group 32)``;
2. ``HummingInputSchema()`` (bf16, no input quantisation), checked by ``check_and_fallback_input_schema``;
3. ``humming.transform.prepare_and_transform_humming_tensors(pad_n_to_multiple=256, pad_k_to_multiple=128,
   torch_dtype=bf16)``: the ``LayerConfig``, padding, the weight repack (humming's JIT ``repack_weight``
   kernel) and the scale permutation.

Then ``HummingExpertsBase.__init__`` / ``init_humming_moe``: ``humming.tune.get_heuristics_config(gemm_type=
INDEXED)`` per sublayer (a list of ``[min_m, max_m, kernel config]``), compute config ``{"use_batch_invariant":
False, "use_f16_accum": False, "gemm_type": "indexed"}`` (the env defaults), and ``create_humming_locks``
(``vllm/utils/humming.py``: int32 zeros, 8 per SM).

Decode (:meth:`HummingMxfp4MoE.__call__`). ``FusedMoEKernel.apply`` (``fused_moe/modular_kernel.py``) with the
no-EP prepare/finalize (no quantisation: Humming defers it, ``expects_unquantized_inputs``), the output
aliased to the layer's, then ``HummingIndexedExperts.apply``:

1. ``moe_align_block_size(topk_ids, block, num_experts=E, ignore_invalid_experts=True)`` (vLLM CUDA op), with
   ``block = w13 tuning config["block_shape"][0]`` for ``valid_shape_m = M * top_k`` (64 if none matches); again
   with the w2 block when the two differ (``prepare_humming_moe_kwargs``);
2. ``process_input("w13")``: bf16 with no quantisation or Hadamard, so ``may_process_input`` returns x as is;
3. w13: ``humming.forward.humming_forward(cfg13, x, ..., sorted_ids, expert_ids, num_tokens_padded,
   top_k=top_k, valid_shape_m, compute_config, tuning_config)`` -> ``[M*top_k, 2I]`` bf16 (one GEMM launch);
4. ``process_input("w2", activation=...)``: ``humming.forward.may_process_input(cfg2, gate_up, outputs=[M*top_k,
   I], activation_type="binary_split", activation_impl=<C++ expression>)`` - the activation is a humming
   process-input kernel compiled around the expression of ``quantization/utils/humming/activation.py``
   (SiTU: ``b*tanh(a/b) * sigmoid(a) * (bl*tanh(u/bl) or u)``; SwiGLU: ``silu(a) * u``, clamped if set);
5. w2: ``humming_forward(cfg2, act, ..., top_k=1)`` -> ``[M*top_k, N]`` bf16, one row per (token, k) pair;
6. ``moe_fused_mul_sum`` (``fused_moe/moe_fused_mul_sum.py``, Triton): ``out[m] = sum_j w[m, j] * y[m, j]``
   in fp32 -> bf16, one program per token.

Stand-ins (vLLM is not installed where this runs): step 1 is ``kernels/triton_moe.moe_align`` (one Triton
program; the same ``sorted_ids`` / ``expert_ids`` / ``num_tokens_padded`` contract, buffers sized as vLLM sizes
them; humming reads only ``num_tokens_padded`` and the blocks below it), step 6 is ``topk_weighted_sum`` here
(the same math and launch shape). Steps 2-5 are humming's own calls with vLLM's arguments. The one other
difference: ``prepare(..., activation_backend="triton")`` replaces step 4 by our ``situ_and_mul`` /
``silu_and_mul`` kernels (not what vLLM runs; the default ``"humming"`` is).

What humming compiles and needs at run time (humming-kernels 0.1.20; vLLM 0.33 pins 0.1.19)
-----------------------------------------------------------------------------------------
* Kernels are JIT-compiled CUDA C++ (jinja2 templates over the package's ``include/humming/*.cuh``), one per
  (layer config, compute config, tuning interval) on first use - the GEMMs for *all* M intervals of the
  tuning list at the first call of each sublayer, the process-input (activation) kernels likewise, the
  weight-prep kernels (repack) at ``prepare``. The compiler is NVRTC, driven by the bundled ``nvrtc_compile``
  helper binary (it dlopens ``libnvrtc``), or ``nvcc`` when ``HUMMING_COMPILER=nvcc`` or
  ``cuda.bindings.nvrtc`` does not import. Either needs a CUDA toolkit of torch's CUDA major version (13 for
  cu130) with ``nvrtc.h``, ``cuda_runtime.h`` and CCCL's ``cuda/std`` headers: ``/usr/local/cuda*``,
  ``$CUDA_HOME`` / ``$CUDA_PATH``, or pip's ``nvidia/cu13`` tree. Cubins are cached in ``$HUMMING_CACHE_DIR``
  (default ``~/.humming/cache``); no C++ compiler is needed when the bundled binaries match.
* Launch: a prebuilt torch stable-ABI library (``_native/x86_64/libhumming_launcher.so``, loaded with
  ``torch.ops.load_library`` for torch >= 2.11; older torch builds it with ``torch.utils.cpp_extension``),
  registering ``torch.ops.humming.launch_kernel`` / ``launch_process_input``; weight-prep kernels launch
  through ``cuda.bindings.driver``. A prebuilt ``_device_info.abi3.so`` queries the device.
* Python: torch >= 2.7, numpy, jinja2, filelock, packaging (imported, not declared), cuda-bindings (declared:
  also triton, safetensors, tqdm, tabulate; not used on this path). :func:`humming_runtime_info` reports the
  version, commit, compiler and CUDA tree that ran.

CUDA graphs: humming's GEMM and process-input launches are capturable (persistent kernels that read
``num_tokens_padded`` on the device; tensor-map descriptors passed by value; a small scratch tensor allocated
per launch, from the graph's pool); vLLM captures them in decode. ``moe_align`` and ``topk_weighted_sum`` have
static grids. So :meth:`HummingMxfp4MoE.__call__` is capturable once it has run eagerly for the same
``(M, top_k)`` (that run compiles the kernels and allocates the per-shape buffers).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
import triton
import triton.language as tl

from latency_specialized.errors import UserError
from latency_specialized.kernels.triton_moe import (
    AlignBuffers,
    AlignSizes,
    align_bins,
    moe_align,
    silu_and_mul,
    situ_and_mul,
)

VLLM_VERSION = "0.33.0"
"""The vLLM release whose call sequence this mirrors."""
VLLM_PINNED_HUMMING = "0.1.19"
"""``humming-kernels[cu13]==0.1.19`` in vLLM 0.33.0's Requires-Dist."""
VLLM_FEATURE = ("stock vLLM 0.33's MXFP4 MoE backend on Hopper (Mxfp4MoeBackend.HUMMING, "
                "HummingIndexedExperts)")
PAD_N_TO_MULTIPLE = 256
"""``_prepare_and_transform_sublayer``'s padding of N (vllm quantization/utils/humming/moe.py)."""
PAD_K_TO_MULTIPLE = 128
"""... and of K."""
DEFAULT_BLOCK_M = 64
"""vLLM's block size when no tuning interval holds ``valid_shape_m`` (``prepare_humming_moe_kwargs``)."""
_SPARE_BLOCKS = 2
"""Extra zeroed ``expert_ids`` / sentinel ``sorted_ids`` blocks past vLLM's buffer size (never read)."""

ActivationKind = Literal["situ_glu", "swiglu"]
ActivationBackend = Literal["humming", "triton"]
_KIND_ALIASES = {"situ_glu": "situ_glu", "situ": "situ_glu", "swiglu": "swiglu", "silu": "swiglu"}


# ------------------------------------------------------------------------------------------ humming
def import_humming() -> Any:
    """``import humming``, or a UserError naming the package and the vLLM feature it stands for."""
    try:
        return importlib.import_module("humming")
    except ImportError as e:
        raise UserError(f"humming is not importable ({type(e).__name__}: {e}): pip install humming-kernels "
                        f"(humming-kernels=={VLLM_PINNED_HUMMING} is what vLLM {VLLM_VERSION} pins; offline: "
                        "pip install --no-deps --target DIR <wheel> and put DIR on PYTHONPATH). It stands for "
                        f"{VLLM_FEATURE}.") from e


def humming_runtime_info() -> dict[str, str]:
    """What humming will run with: version, commit, install path, JIT compiler, CUDA tree and NVRTC library.

    Each entry that cannot be determined reads ``"unknown (<why>)"``; only a missing humming raises.
    """
    humming = import_humming()
    info = {"package": "humming-kernels", "version": str(getattr(humming, "__version__", "unknown")),
            "path": os.path.dirname(os.path.abspath(humming.__file__)), "vllm_pins": VLLM_PINNED_HUMMING}

    def attempt(key: str, fn: Any) -> None:
        try:
            info[key] = str(fn())
        except Exception as e:  # noqa: BLE001 - reported, never fatal
            info[key] = f"unknown ({type(e).__name__}: {e})"

    attempt("commit", lambda: getattr(importlib.import_module("humming._version"), "commit_id", None))
    attempt("compiler", _humming_compiler)
    attempt("cuda_tree", lambda: importlib.import_module("humming.utils.cuda").filter_cuda_paths(
        required_headers=["nvrtc.h", "cuda_runtime.h"])["path"])
    attempt("nvrtc_library", lambda: importlib.import_module("humming.utils.nvrtc").get_nvrtc_library_path())
    attempt("cache_dir", lambda: os.environ.get("HUMMING_CACHE_DIR")
            or os.path.join(os.path.expanduser("~"), ".humming/cache/"))
    return info


def _humming_compiler() -> str:
    """humming's choice of JIT compiler (``KernelRuntime._get_compiler``'s rule, restated)."""
    forced = os.environ.get("HUMMING_COMPILER", "").lower()
    if forced in ("nvcc", "nvrtc"):
        return f"{forced} (HUMMING_COMPILER)"
    try:
        importlib.import_module("cuda.bindings.nvrtc")
        return "nvrtc"
    except Exception as e:  # noqa: BLE001
        return f"nvcc (cuda.bindings.nvrtc unavailable: {type(e).__name__})"


def _cxx_float(v: float, name: str) -> str:
    f = float(v)
    if not math.isfinite(f):
        raise UserError(f"{name} must be finite, got {v!r}")
    return f"({f!r}f)"


def humming_activation(kind: ActivationKind, beta: float | None = None, beta_lin: float | None = None,
                       clamp: float | None = None) -> dict[str, str]:
    """``activation_type`` / ``activation_impl`` for humming's process-input kernel, as vLLM 0.33 builds them
    (``get_humming_activation``): a C++ expression of the gate ``a`` and the up ``b`` (``binary_split``: the
    first half of each w13 row is the gate).

    situ_glu (vLLM ``MoEActivation.SITU``): ``beta*tanh(a/beta) * sigmoid(a) * up``, ``up = beta_lin*tanh(b/beta_lin)``
    when ``beta_lin > 0``, else ``b``. swiglu (``SILU``): ``silu(a) * b``; with ``clamp`` (vLLM's clamped SiLU,
    alpha 1, beta 0): ``a <= clamp``, ``|b| <= clamp`` first.
    """
    if kind == "situ_glu":
        b = _cxx_float(beta, "beta")  # type: ignore[arg-type]
        up = "b"
        if beta_lin is not None and beta_lin > 0:
            bl = _cxx_float(beta_lin, "beta_lin")
            up = f"{bl} * tanhf(b / {bl})"
        impl = ("[](float a, float b) {\n"
                f"    const float gate = {b} * tanhf(a / {b});\n"
                "    const float activated_gate = gate / (1.f + expf(-a));\n"
                f"    const float up = {up};\n"
                "    return activated_gate * up;\n"
                "}(a, b)")
    elif kind == "swiglu" and clamp is None:
        impl = "(a / (1.f + expf(-a))) * b"
    elif kind == "swiglu":
        c = _cxx_float(clamp, "clamp")
        impl = ("[](float a, float b) {\n"
                f"    const float gate = fminf(a, {c});\n"
                f"    const float up = fmaxf(fminf(b, {c}), -{c});\n"
                "    const float activated_gate = gate / (1.f + expf(-(1.0f) * gate));\n"
                "    return activated_gate * (up + (0.0f));\n"
                "}(a, b)")
    else:
        raise UserError(f"activation {kind!r}: use 'situ_glu' or 'swiglu'")
    return {"activation_type": "binary_split", "activation_impl": impl}


# ------------------------------------------------------------------------------------- weighted sum
@triton.jit
def _topk_weighted_sum_kernel(y_ptr, w_ptr, ids_ptr, out_ptr, N, TOPK: tl.constexpr, BLOCK_N: tl.constexpr,
                              N_TILES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    for t in range(N_TILES):
        cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
        cm = cols < N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(TOPK):
            e = tl.load(ids_ptr + row * TOPK + j)
            wj = tl.load(w_ptr + row * TOPK + j).to(tl.float32)
            take = cm & ((cols * 0 + e) >= 0)  # a skipped slot (id < 0) is never read
            v = tl.load(y_ptr + (row * TOPK + j) * N + cols, mask=take, other=0.0)
            acc += v.to(tl.float32) * wj
        tl.store(out_ptr + row * N + cols, acc.to(out_ptr.dtype.element_ty), mask=cm)


def _sum_launch(N: int, element_size: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_N, num_warps) as vLLM's ``moe_fused_mul_sum`` picks them (``_heuristic_config``)."""
    if element_size > 2:
        max_block, warps = 256, 4
    else:
        max_block, warps = 512, 2
        cap = torch.cuda.get_device_capability(device)
        if N >= 1024 and cap >= (7, 5):
            max_block, warps = 4096, (8 if cap == (7, 5) else 16)
    return max(128, min(triton.next_power_of_2(N), max_block)), warps


def topk_weighted_sum(y: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, out: torch.Tensor,
                      launch: tuple[int, int] | None = None) -> torch.Tensor:
    """out[m] = sum_j topk_weights[m, j] * y[m, j] (fp32 accumulate); slots with ``topk_ids < 0`` are skipped.

    y : [M, top_k, N] contiguous; topk_weights : [M, top_k] (fp32/bf16/fp16); topk_ids : [M, top_k] int32/int64;
    out : [M, N]. ``launch``: (BLOCK_N, num_warps), default :func:`_sum_launch`. One program per token, as
    vLLM's ``moe_fused_mul_sum`` with ``topk_ids`` given and no ``expert_map``.
    """
    M, top_k, N = y.shape
    block_n, warps = launch or _sum_launch(N, y.element_size(), y.device)
    _topk_weighted_sum_kernel[(M,)](y, topk_weights, topk_ids, out, N, TOPK=top_k, BLOCK_N=block_n,
                                    N_TILES=triton.cdiv(N, block_n), num_warps=warps, num_stages=3)
    return out


# ------------------------------------------------------------------------------------------- align
def vllm_max_tokens_padded(pairs: int, experts: int, block_m: int) -> int:
    """Length of ``sorted_ids`` that vLLM's ``moe_align_block_size`` allocates (no ``pad_sorted_ids``)."""
    n = pairs + experts * (block_m - 1)
    if pairs < experts:
        n = min(pairs * block_m, n)
    return n


def _align_buffers(pairs: int, experts: int, block_m: int, device: torch.device) -> AlignBuffers:
    """``moe_align`` outputs sized like vLLM's (plus spare blocks); ``expert_ids`` zeroed once, as vLLM's kernel
    zeroes the unused tail, so every block a kernel could read names a real expert."""
    sizes = AlignSizes(pairs=pairs, experts=experts, block_m=block_m)
    padded = max(vllm_max_tokens_padded(pairs, experts, block_m), sizes.max_padded)
    blocks = triton.cdiv(padded, block_m) + _SPARE_BLOCKS
    block_t = triton.next_power_of_2(pairs)
    fill = triton.cdiv(blocks * block_m, block_t) * block_t  # moe_align writes the sentinel in block_t chunks
    return AlignBuffers(sizes=sizes,
                        sorted_ids=torch.empty(fill, dtype=torch.int32, device=device),
                        expert_ids=torch.zeros(blocks, dtype=torch.int32, device=device),
                        num_padded=torch.empty(1, dtype=torch.int32, device=device),
                        scratch=torch.empty(align_bins(experts), dtype=torch.int32, device=device))


def _tuning_block_m(tuning: list, valid_shape_m: int) -> int | None:
    """``config["block_shape"][0]`` of the tuning interval ``(lo, hi]`` holding ``valid_shape_m``."""
    for lo, hi, config in tuning:
        if lo < valid_shape_m <= hi:
            return int(config["block_shape"][0])
    return None


# -------------------------------------------------------------------------------------------- peer
@dataclass
class _Step:
    """Per-(M, top_k) state of :meth:`HummingMxfp4MoE.__call__` (allocated on the first eager call)."""

    valid_shape_m: int
    block_m13: int
    block_m2: int
    align13: AlignBuffers
    align2: AlignBuffers
    """The same object as ``align13`` when the two blocks agree (vLLM aligns once then)."""
    gate_up: torch.Tensor
    """[M*top_k, 2I] bf16: w13 output, one row per (token, k) pair."""
    act: torch.Tensor
    """[M*top_k, I] bf16: activation output (w2 input)."""
    down: torch.Tensor
    """[M*top_k, N] bf16: w2 output per pair."""
    sum_launch: tuple[int, int]


class HummingMxfp4MoE:
    """Routed MXFP4 experts exactly as stock vLLM 0.33 runs them on SM90 (module docstring): humming's indexed
    W4A16 GEMMs and process-input activation, vLLM's align and weighted sum around them.

    Usage::

        moe = HummingMxfp4MoE().prepare(w13_packed, w13_scale, w2_packed, w2_scale,
                                        activation_kind="situ_glu", beta=4.0, beta_lin=25.0)
        out = moe(x, topk_weights, topk_ids)          # [M, N] bf16

    Weights (compressed-tensors MXFP4 layout, on the GPU): w13_packed uint8 [E, 2I, K/2] (gate rows then up
    rows; two e2m1 codes per byte, the even element in the low nibble), w13_scale ue8m0 uint8 [E, 2I, K/32],
    w2_packed uint8 [E, N, I/2], w2_scale uint8 [E, N, I/32]. Decode: x bf16 [M, K], topk_weights fp32
    [M, top_k], topk_ids int32 [M, top_k] (distinct within a row, as routing makes them).

    ``__call__`` is CUDA-graph capturable after one eager call for the same (M, top_k); it allocates nothing
    then except humming's per-launch scratch, which the graph's pool serves.
    """

    def __init__(self) -> None:
        self._prepared = False
        self._steps: dict[tuple[int, int], _Step] = {}

    # ------------------------------------------------------------------------------------ load
    def prepare(self, w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
                w2_scale: torch.Tensor, *, activation_kind: ActivationKind | str, beta: float | None = None,
                beta_lin: float | None = None, clamp: float | None = None,
                activation_backend: ActivationBackend = "humming") -> HummingMxfp4MoE:
        """One-time conversion of the checkpoint tensors to humming's layout, as vLLM does at load.

        Mirrors ``convert_to_humming_moe_kernel_format`` (vllm/model_executor/layers/quantization/utils/humming/
        moe.py, reached from ``Mxfp4MoEMethod.process_weights_after_loading`` -> ``_setup_kernel`` ->
        ``convert_weight_to_mxfp4_moe_kernel_format``), then ``HummingExpertsBase.init_humming_moe`` (tuning
        and compute configs) and ``create_humming_locks``.

        activation_kind : "situ_glu" (Kimi K3; ``beta`` required, ``beta_lin`` optional: unset or <= 0 passes
            the up half through, as vLLM's SITU) or "swiglu" (``clamp`` optional).
        activation_backend : "humming" (vLLM's: the activation inside humming's process-input kernel) or
            "triton" (our ``situ_and_mul`` / ``silu_and_mul``; not what vLLM runs).
        The inputs are not modified; humming's copies are kept (about their size again on the GPU).
        """
        kind = _KIND_ALIASES.get(str(activation_kind))
        if kind is None:
            raise UserError(f"activation_kind {activation_kind!r}: use 'situ_glu' (Kimi K3) or 'swiglu'")
        if activation_backend not in ("humming", "triton"):
            raise UserError(f"activation_backend {activation_backend!r}: use 'humming' (vLLM's) or 'triton'")
        if kind == "situ_glu":
            if beta is None or not beta > 0:
                raise UserError(f"situ_glu needs beta > 0 (Kimi K3: 4), got {beta!r}")
            if clamp is not None:
                raise UserError("clamp applies to swiglu only")
            if activation_backend == "triton" and (beta_lin is None or not beta_lin > 0):
                raise UserError("the triton situ_and_mul needs beta_lin > 0 (Kimi K3: 25)")
        else:
            if beta is not None or beta_lin is not None:
                raise UserError("beta / beta_lin apply to situ_glu only")
            if clamp is not None and not clamp > 0:
                raise UserError(f"clamp must be > 0, got {clamp!r}")
        act = humming_activation(kind, beta, beta_lin, clamp)  # type: ignore[arg-type]

        import_humming()  # first: a missing package is the error to see, also on a machine without a GPU
        E, K, inter, N = self._check_weights(w13_packed, w13_scale, w2_packed, w2_scale)
        dev = w13_packed.device

        from humming.config import GemmType
        from humming.forward import humming_forward, may_process_input
        from humming.schema import BaseWeightSchema, HummingInputSchema
        from humming.transform import prepare_and_transform_humming_tensors
        from humming.tune import get_heuristics_config

        param_dtype = torch.bfloat16
        cfgs: dict[str, Any] = {}
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        tuning: dict[str, list] = {}
        hadamard: dict[str, int] = {}
        with torch.cuda.device(dev):
            # quant_config={"quant_method": "mxfp4"} -> Mxfp4WeightSchema; input: HummingInputSchema() (bf16)
            weight_schema = BaseWeightSchema.from_config({"quant_method": "mxfp4"})
            input_schema = HummingInputSchema.from_config({})
            subs = {"w13": (w13_packed, w13_scale, 2 * inter, K, [inter, inter]),
                    "w2": (w2_packed, w2_scale, N, inter, [N])}
            for name, (w, s, n, k, n_stacks) in subs.items():
                src = {"weight": w.contiguous(), "weight_scale": s.contiguous().view(torch.uint8)}
                # _convert_sublayer_to_humming
                hw_schema, conv = weight_schema.convert_humming(tensors=src, shape_n_stacks=n_stacks,
                                                                shape_k_stacks=[k], param_dtype=param_dtype,
                                                                num_experts=E)
                hi_schema, in_tensors = input_schema.convert_humming(tensors=src, shape_n_stacks=n_stacks,
                                                                     shape_k_stacks=[k], param_dtype=param_dtype,
                                                                     num_experts=E)
                conv.update(in_tensors)
                # check_and_fallback_input_schema(allow_fallback=False): the schema as is, if compatible
                if not hi_schema.is_compatible_with(hw_schema, param_dtype):
                    raise UserError(f"humming: bf16 activations are not compatible with MXFP4 {name} weights on "
                                    f"this device ({torch.cuda.get_device_name(dev)}); {VLLM_FEATURE} needs SM90")
                # _prepare_and_transform_sublayer
                cfg, out = prepare_and_transform_humming_tensors(
                    tensors=conv, shape_n=n, shape_k=k, pad_n_to_multiple=PAD_N_TO_MULTIPLE,
                    pad_k_to_multiple=PAD_K_TO_MULTIPLE, input_schema=hi_schema, weight_schema=hw_schema,
                    has_bias=False, num_experts=E, torch_dtype=param_dtype, device=dev)
                if cfg.input_quant_mode.should_quantize:
                    raise UserError(f"humming chose input quantisation ({cfg.input_quant_mode}) for {name}: "
                                    "this peer mirrors vLLM's bf16-activation (W4A16) path only")
                cfgs[name], tensors[name], hadamard[name] = cfg, out, int(hw_schema.hadamard_block_size or 0)
                # HummingExpertsBase.init_humming_moe
                tuning[name] = get_heuristics_config(layer_config=cfg, use_f16_accum=False,
                                                     use_batch_invariant=False, gemm_type=GemmType.INDEXED)
            sm_count = torch.cuda.get_device_properties(dev).multi_processor_count

        self._forward = humming_forward
        self._may_process_input = may_process_input
        self._cfg = cfgs
        self._w = tensors
        self._tuning = tuning
        self._tuning_str = {name: json.dumps(t) for name, t in tuning.items()}
        self._hadamard = hadamard
        self._compute_str = json.dumps({"use_batch_invariant": False, "use_f16_accum": False,
                                        "gemm_type": GemmType.INDEXED.value})
        self._locks = torch.zeros(sm_count * 8, dtype=torch.int32, device=dev)  # create_humming_locks
        self._act = act
        self._act_spec = {"kind": kind, "beta": beta, "beta_lin": beta_lin, "clamp": clamp}
        self._backend = activation_backend
        self._dims = (E, K, inter, N)
        self._device = dev
        self._steps = {}
        self._prepared = True
        return self

    @staticmethod
    def _check_weights(w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
                       w2_scale: torch.Tensor) -> tuple[int, int, int, int]:
        """(E, K, I, N) of consistent compressed-tensors MXFP4 expert weights on one CUDA device."""
        ts = {"w13_packed": w13_packed, "w13_scale": w13_scale, "w2_packed": w2_packed, "w2_scale": w2_scale}
        for name, t in ts.items():
            if t.dim() != 3:
                raise UserError(f"{name}: expected 3 dims [E, rows, cols], got shape {tuple(t.shape)}")
            ok = (torch.uint8,) if "packed" in name else (torch.uint8, torch.float8_e8m0fnu)
            if t.dtype not in ok:
                raise UserError(f"{name}: expected dtype {' or '.join(map(str, ok))}, got {t.dtype}")
            if t.device.type != "cuda" or t.device != w13_packed.device:
                raise UserError(f"{name}: all weights must be on one CUDA device (humming runs on the GPU), "
                                f"got {t.device} and {w13_packed.device}")
        E, two_i, k_half = w13_packed.shape
        K, inter = 2 * k_half, two_i // 2
        N = w2_packed.shape[1]
        if two_i % 2 or K % 32 or inter % 32:
            raise UserError(f"w13_packed {tuple(w13_packed.shape)}: needs 2I rows (even) and K, I multiples of "
                            f"32 (MXFP4 blocks); got 2I={two_i}, K={K}")
        want = {"w13_scale": (E, 2 * inter, K // 32), "w2_packed": (E, N, inter // 2),
                "w2_scale": (E, N, inter // 32)}
        for name, shape in want.items():
            if tuple(ts[name].shape) != shape:
                raise UserError(f"{name}: expected shape {shape} (E={E}, K={K}, I={inter}, N={N}), "
                                f"got {tuple(ts[name].shape)}")
        return E, K, inter, N

    # ---------------------------------------------------------------------------------- decode
    def block_m(self, M: int, top_k: int) -> tuple[int, int]:
        """(w13, w2) align block sizes vLLM uses for M tokens of top_k routes (``prepare_humming_moe_kwargs``)."""
        self._need_prepared()
        valid = M * top_k
        b13 = _tuning_block_m(self._tuning["w13"], valid)
        if b13 is None:
            warnings.warn(f"humming: no tuning config for shape {valid}, using block_size={DEFAULT_BLOCK_M} "
                          "(as vLLM)", stacklevel=2)
            b13 = DEFAULT_BLOCK_M
        b2 = _tuning_block_m(self._tuning["w2"], valid) or DEFAULT_BLOCK_M
        return b13, b2

    def _step(self, M: int, top_k: int) -> _Step:
        key = (M, top_k)
        step = self._steps.get(key)
        if step is not None:
            return step
        E, _, inter, N = self._dims
        T = M * top_k
        b13, b2 = self.block_m(M, top_k)
        dev = self._device
        a13 = _align_buffers(T, E, b13, dev)
        a2 = a13 if b2 == b13 else _align_buffers(T, E, b2, dev)
        step = _Step(valid_shape_m=T, block_m13=b13, block_m2=b2, align13=a13, align2=a2,
                     gate_up=torch.empty(T, 2 * inter, dtype=torch.bfloat16, device=dev),
                     act=torch.empty(T, inter, dtype=torch.bfloat16, device=dev),
                     down=torch.empty(T, N, dtype=torch.bfloat16, device=dev),
                     sum_launch=_sum_launch(N, 2, dev))
        self._steps[key] = step
        return step

    def _process_input(self, name: str, inputs: torch.Tensor, quanted: torch.Tensor | None,
                       activation: bool) -> torch.Tensor:
        """``HummingExpertsBase.process_input`` for the bf16 path: ``may_process_input`` with an output buffer
        only when there is processing to do (for w13: none, x comes back as is)."""
        cfg = self._cfg[name]
        hadamard = self._hadamard[name]
        has_processing = cfg.input_quant_mode.should_quantize or hadamard > 1 or activation
        kwargs = dict(self._act) if activation else {}
        outputs, _, _ = self._may_process_input(cfg, inputs=inputs, outputs=quanted if has_processing else None,
                                                token_scales=None, hadamard_block_size=hadamard, layout="normal",
                                                expert_tokens=None, scatter_idx=None, num_valid_tokens=None,
                                                **kwargs)
        return outputs

    def _gemm(self, name: str, inputs: torch.Tensor, outputs: torch.Tensor, align: AlignBuffers, top_k: int,
              valid_shape_m: int) -> None:
        """``HummingExpertsBase.humming_forward`` with ``prepare_humming_moe_kwargs``' arguments."""
        w = self._w[name]
        self._forward(self._cfg[name], inputs=inputs, weight=w["weight"], weight_scale=w.get("weight_scale"),
                      zero_point=w.get("zero_point"), bias=w.get("bias"), weight_scale_2=w.get("weight_scale_2"),
                      input_scale=None, input_scale_2=None, outputs=outputs, locks=self._locks,
                      sorted_ids=align.sorted_ids, expert_ids=align.expert_ids, num_tokens_padded=align.num_padded,
                      top_k=top_k, valid_shape_m=valid_shape_m, compute_config=self._compute_str,
                      tuning_config=self._tuning_str[name])

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """Routed experts: out[m] = sum_j topk_weights[m, j] * expert_{topk_ids[m, j]}(x[m]).

        x : [M, K] bf16; topk_weights : [M, top_k] fp32; topk_ids : [M, top_k] int32 (int64 accepted);
        out : optional [M, N] bf16 destination (vLLM writes the layer's output in place). Returns [M, N] bf16.
        Host-side checks only (no device sync), so the call can be captured in a CUDA graph.
        """
        self._need_prepared()
        _, K, _, N = self._dims
        if x.dim() != 2 or x.shape[1] != K or x.dtype != torch.bfloat16 or not x.is_contiguous():
            raise UserError(f"x: expected contiguous bf16 [M, {K}], got {x.dtype} {tuple(x.shape)}")
        M = x.shape[0]
        if topk_ids.dim() != 2 or topk_ids.shape[0] != M or topk_ids.dtype not in (torch.int32, torch.int64):
            raise UserError(f"topk_ids: expected int32 [{M}, top_k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
        top_k = topk_ids.shape[1]
        if tuple(topk_weights.shape) != (M, top_k) or not topk_weights.is_floating_point():
            raise UserError(f"topk_weights: expected fp32 [{M}, {top_k}], got {topk_weights.dtype} "
                            f"{tuple(topk_weights.shape)}")
        for name, t in (("x", x), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
            if t.device != self._device or not t.is_contiguous():
                raise UserError(f"{name}: must be contiguous on {self._device}, got {t.device}")
        if out is None:
            out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
        elif tuple(out.shape) != (M, N) or out.dtype != torch.bfloat16 or not out.is_contiguous() \
                or out.device != self._device:
            raise UserError(f"out: expected contiguous bf16 [{M}, {N}] on {self._device}, got {out.dtype} "
                            f"{tuple(out.shape)} on {out.device}")
        if M == 0:
            return out
        s = self._step(M, top_k)

        # 1. moe_align_block_size (w13 block; again with the w2 block when it differs)
        a13 = moe_align(topk_ids, s.align13)
        a2 = a13 if s.align2 is s.align13 else moe_align(topk_ids, s.align2)
        # 2.-3. w13 input processing (a no-op for bf16), gate/up GEMM -> [M*top_k, 2I]
        inputs = self._process_input("w13", x, None, activation=False)
        self._gemm("w13", inputs, s.gate_up, a13, top_k, s.valid_shape_m)
        # 4. activation -> [M*top_k, I]
        if self._backend == "humming":
            act = self._process_input("w2", s.gate_up, s.act, activation=True)
        else:
            spec = self._act_spec
            if spec["kind"] == "situ_glu":
                act = situ_and_mul(s.gate_up, float(spec["beta"]), float(spec["beta_lin"]), out=s.act)
            else:
                act = silu_and_mul(s.gate_up, spec["clamp"], out=s.act)
        # 5. down GEMM, one row per pair -> [M*top_k, N]
        self._gemm("w2", act, s.down, a2, 1, s.valid_shape_m)
        # 6. moe_fused_mul_sum
        return topk_weighted_sum(s.down.view(M, top_k, N), topk_weights, topk_ids, out=out, launch=s.sum_launch)

    # ---------------------------------------------------------------------------------- report
    def describe(self) -> dict[str, Any]:
        """What this peer runs, for the bench's report (JSON-serialisable)."""
        self._need_prepared()
        E, K, inter, N = self._dims

        def layer(name: str) -> dict[str, Any]:
            c = self._cfg[name]
            return {"a_dtype": str(c.a_dtype), "b_dtype": str(c.b_dtype), "bs_dtype": str(c.bs_dtype),
                    "c_dtype": str(c.c_dtype), "shape_n": int(c.shape_n), "shape_k": int(c.shape_k),
                    "pad_shape_n": int(c.pad_shape_n), "pad_shape_k": int(c.pad_shape_k),
                    "input_quant_mode": str(c.input_quant_mode.value), "tuning_intervals": len(self._tuning[name])}

        return {
            "peer": f"vllm-{VLLM_VERSION} MXFP4 MoE on SM90 via humming (HummingIndexedExperts, W4A16)",
            "humming": humming_runtime_info(),
            "experts": E, "hidden": K, "inter": inter, "out": N,
            "activation": {**self._act_spec, "backend": self._backend,
                           "humming_expression": self._act["activation_impl"] if self._backend == "humming" else None},
            "gemm_type": "indexed",
            "w13": layer("w13"), "w2": layer("w2"),
            "block_m": {f"M={m},top_k={k}": [s.block_m13, s.block_m2] for (m, k), s in self._steps.items()},
            "stand_ins": ["moe_align_block_size -> kernels/triton_moe.moe_align",
                          "moe_fused_mul_sum -> bench/peers/humming_mxfp4.topk_weighted_sum"]
            + (["activation -> triton situ_and_mul / silu_and_mul (not vLLM's)"] if self._backend == "triton" else []),
        }

    def _need_prepared(self) -> None:
        if not self._prepared:
            raise UserError("HummingMxfp4MoE: call prepare(...) with the expert weights first")
