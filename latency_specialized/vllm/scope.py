"""The start-time scope check of a vLLM deployment, collective across ranks.

``deployment_of(vllm_config)`` reads what the adapter's :class:`DecodeScope` is checked against
(arch, TP, dtype, speculative tokens, CUDA graphs). ``engine_problems`` lists the vLLM features the
decode override cannot coexist with whatever the adapter. ``gather_problems`` makes the verdict
collective: every rank contributes its list, every rank gets the union, so all ranks fail together
with one message listing every missing requirement (a rank-local failure would hang the others in
their next collective).
"""

from __future__ import annotations

from typing import Any

from latency_specialized.errors import ScopeError
from latency_specialized.spec import Deployment

AUTO_HINT = "or run stock vLLM with --decode-backend auto"


class DeploymentScopeError(ScopeError):
    """A vLLM deployment asked for latency_specialized outside what the model's adapter supports."""

    def __init__(self, model: str, problems: list[str]):
        super().__init__(model, problems)
        self.args = (f"{self.args[0]} ({AUTO_HINT})",)

    def __str__(self) -> str:
        return str(self.args[0])


def torch_dtype_name(dtype: Any) -> str:
    """'bfloat16' for torch.bfloat16 (and for the string 'bfloat16')."""
    return str(dtype).replace("torch.", "")


def cuda_graphs_on(vllm_config: Any) -> bool:
    """Whether vLLM will capture CUDA graphs of the forward (never on the CPU build)."""
    if getattr(vllm_config.model_config, "enforce_eager", False):
        return False
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    return mode is not None and getattr(mode, "name", "NONE") != "NONE"


def deployment_of(vllm_config: Any, arch: str) -> Deployment:
    """The Deployment this vLLM config asks for (batch 1: the per-step batch is gated at run time)."""
    spec_cfg = vllm_config.speculative_config
    spec_tokens = int(getattr(spec_cfg, "num_speculative_tokens", 0) or 0) if spec_cfg is not None else 0
    dtype = torch_dtype_name(vllm_config.model_config.dtype)
    return Deployment.model_construct(  # dtype may be one the scope refuses: keep it, report it
        arch=arch, tp=vllm_config.parallel_config.tensor_parallel_size, batch=1, dtype=dtype,
        spec_tokens=spec_tokens, cuda_graphs=cuda_graphs_on(vllm_config))


def engine_problems(vllm_config: Any) -> list[str]:
    """vLLM features the decode override cannot run with (one phrase each, naming the fix)."""
    out: list[str] = []
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1:
        out.append(f"pipeline parallelism ({pc.pipeline_parallel_size} stages) not supported "
                   f"(use --pipeline-parallel-size 1)")
    if pc.data_parallel_size > 1:
        out.append(f"data parallelism ({pc.data_parallel_size} replicas) not supported (use --data-parallel-size 1)")
    if getattr(pc, "decode_context_parallel_size", 1) > 1:
        out.append("decode context parallelism not bound yet (use --decode-context-parallel-size 1)")
    if vllm_config.lora_config is not None:
        out.append("LoRA adapters not supported by the decode program (drop --enable-lora)")
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    if cuda_graphs_on(vllm_config) and mode is not None and getattr(mode, "has_full_cudagraphs", lambda: False)():
        out.append(f"CUDA graph mode {mode.name} captures the whole forward, decode gate included "
                   "(use --compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}' or --enforce-eager)")
    return out


def merge_problem_lists(per_rank: list[list[str]]) -> list[str]:
    """Union of every rank's problems, in first-seen order; a problem only some ranks have names them."""
    order: list[str] = []
    ranks: dict[str, list[int]] = {}
    for rank, problems in enumerate(per_rank):
        for p in problems:
            if p not in ranks:
                order.append(p)
                ranks[p] = []
            if rank not in ranks[p]:
                ranks[p].append(rank)
    world = len(per_rank)
    return [p if len(ranks[p]) == world else f"{p} (ranks {', '.join(map(str, ranks[p]))})" for p in order]


def gather_problems(problems: list[str], group: Any = None) -> list[str]:
    """Every rank's problems, merged, returned on every rank (``group``: a torch.distributed group).

    Without an initialised process group (or with one rank) this is the local list.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return merge_problem_lists([list(problems)])
    world = dist.get_world_size(group)
    if world == 1:
        return merge_problem_lists([list(problems)])
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, list(problems), group=group)
    return merge_problem_lists([list(p) for p in per_rank])
