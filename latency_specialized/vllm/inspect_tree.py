"""Print the module tree vLLM builds for a checkpoint directory (dummy weights, one process).

For writing an adapter's vLLM binding: which in-tree class vLLM resolves for the architecture on
this machine, whether the engine config builds, and the module tree of the first layers::

    python -m latency_specialized.vllm.inspect_tree /path/to/checkpoint [--depth 5] [--layers 2]

Each stage that fails is reported with its error (on the CPU build the GPU-only models stop at
construction) and the exit code is 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
from typing import Any, Iterator


@contextlib.contextmanager
def _platform_setup() -> Iterator[None]:
    """On the CPU build: the stand-ins vLLM's own CPU model runner installs before building a model."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        yield
        return
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop, _torch_cuda_wrapper

    _set_torch_accelerator_to_noop()
    with _torch_cuda_wrapper():
        yield


def inspect(model_dir: str, *, depth: int = 5, layers: int = 2, dtype: str = "bfloat16", **engine_kw: Any) -> dict:
    """Stages reached ('class', 'config', 'construct') with their result or error, and the tree."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report: dict[str, Any] = {"model": model_dir, "stages": {}}
    try:
        from vllm.engine.arg_utils import EngineArgs

        cfg = EngineArgs(model=model_dir, load_format="dummy", dtype=dtype, enforce_eager=True, max_model_len=256,
                         kv_cache_memory_bytes=32 * 2**20, **engine_kw).create_engine_config()
        arch = cfg.model_config.architectures[0]
        from vllm.model_executor.models.registry import ModelRegistry

        cls = ModelRegistry._try_load_model_cls(arch)
        report["stages"]["class"] = f"{arch} -> {cls.__module__}.{cls.__qualname__}" if cls else f"{arch} -> none"
        report["stages"]["config"] = "ok"
    except Exception as e:  # noqa: BLE001 - reported as the stage's result
        report["stages"]["config"] = f"failed: {type(e).__name__}: {e}".splitlines()[0]
        return report
    try:
        from vllm.config import set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.model_executor.model_loader import get_model

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with set_current_vllm_config(cfg):
            init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                         distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
            initialize_model_parallel(1, 1)
            with _platform_setup():
                model = get_model(vllm_config=cfg)
        report["stages"]["construct"] = f"{type(model).__module__}.{type(model).__name__}"
    except Exception as e:  # noqa: BLE001 - reported as the stage's result
        report["stages"]["construct"] = f"failed: {type(e).__name__}: {e}".splitlines()[0]
        return report
    keep = tuple(f"layers.{i}." for i in range(layers))
    report["tree"] = [f"{name}: {type(m).__name__}" for name, m in model.named_modules()
                      if name.count(".") < depth and (".layers." not in f".{name}." or any(k in f"{name}." for k in keep))]
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m latency_specialized.vllm.inspect_tree", description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--depth", type=int, default=5, help="module name depth to print")
    p.add_argument("--layers", type=int, default=2, help="decoder layers to print")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--engine-kw", default="{}", help="extra EngineArgs as JSON, e.g. '{\"mamba_block_size\": 256}'")
    args = p.parse_args(argv)
    report = inspect(args.model_dir, depth=args.depth, layers=args.layers, dtype=args.dtype, **json.loads(args.engine_kw))
    print(json.dumps(report, indent=1))
    return 0 if "tree" in report else 1


if __name__ == "__main__":
    sys.exit(main())
