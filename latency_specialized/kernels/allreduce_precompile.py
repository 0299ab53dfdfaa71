"""Compile and export the fused all-reduce kernels ahead of time (no GPU needed).

:func:`precompile` writes the objects :func:`allreduce_common.get_kernel` loads when
``$LS_ALLREDUCE_KERNEL_DIR`` points at the directory, so GPU runs (and every rank process) skip
compiling. It needs both kernel modules' compile entry points, so it lives beside them, not in
``allreduce_common`` (which both kernel modules import).
"""

from __future__ import annotations

import os

from latency_specialized.kernels import allreduce_lamport, allreduce_two_stage
from latency_specialized.kernels.allreduce_common import FusedAllReduceConfig, object_path


def _precompile_one(name: str, cfg: FusedAllReduceConfig, directory: str, arch: str) -> tuple[str, str]:
    """Make sure ``directory`` holds a loadable object for (name, cfg): load it, else compile + export."""
    import cutlass.cute as cute

    path, symbol = object_path(directory, name, cfg, arch)
    if path.exists():
        try:
            getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), symbol)
            return str(path), "loaded"
        except Exception as e:  # noqa: BLE001 - rebuilt below
            status = f"rebuilt ({type(e).__name__})"
    else:
        status = "compiled"
    builders = {allreduce_lamport.KERNEL_NAME: allreduce_lamport.compile_for,
                allreduce_two_stage.KERNEL_NAME: allreduce_two_stage.compile_for}
    fn = builders[name](cfg, arch)
    tmp = path.with_suffix(f".{os.getpid()}.tmp.o")
    fn.export_to_c(str(tmp), function_name=symbol)
    os.replace(tmp, path)
    return str(path), status


def precompile(directory: str, configs: list[tuple[str, FusedAllReduceConfig]], arch: str = "sm_90a",
               workers: int = 1) -> list[tuple[str, str]]:
    """Compile and export ``(kernel_name, cfg)`` pairs into ``directory`` (no GPU needed).

    The objects are what :func:`allreduce_common.get_kernel` loads when ``$LS_ALLREDUCE_KERNEL_DIR`` points there,
    so GPU runs (and every rank process) skip compiling. Objects already there are kept if they
    load. ``workers`` > 1 compiles in that many fresh processes (cute.compile is not thread-safe).
    Returns (path, 'loaded' | 'compiled' | 'rebuilt (...)') per config.
    """
    os.makedirs(directory, exist_ok=True)
    import cutlass.cute as cute

    done: dict[int, tuple[str, str]] = {}
    for i, (name, cfg) in enumerate(configs):  # loading is ~1 ms: check everything here first
        path, symbol = object_path(directory, name, cfg, arch)
        if path.exists():
            try:
                getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), symbol)
                done[i] = (str(path), "loaded")
            except Exception:  # noqa: BLE001 - rebuilt below
                path.unlink()
    todo = [i for i in range(len(configs)) if i not in done]
    if workers <= 1 or len(todo) <= 1:
        for i in todo:
            done[i] = _precompile_one(*configs[i], directory, arch)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(workers, len(todo)), mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {i: pool.submit(_precompile_one, *configs[i], directory, arch) for i in todo}
            done.update({i: f.result() for i, f in futures.items()})
    return [done[i] for i in range(len(configs))]
