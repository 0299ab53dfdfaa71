"""What a benchmark ran on: GPU, driver, CUDA, torch, triton, cutlass-dsl, Python, git commit.

Every result file carries this record so that two runs can be compared knowingly. Fields that
cannot be read are ``None`` (never guessed). The git commit comes from ``$LS_GIT_COMMIT`` when set
(and ``$LS_GIT_DIRTY``), else from ``git`` in the source tree: a device copy of the tree may have no
``.git``, or a stale one (the H200 device copies kept the session's first commit while the tree moved
on), so whoever runs there passes the commit the tree really is.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cutlass_dsl_version() -> str | None:
    v = _version("nvidia-cutlass-dsl")
    if v:
        return v
    try:  # installed by path (device stash) without dist-info
        import cutlass

        return getattr(cutlass, "__version__", None)
    except Exception:  # noqa: BLE001
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def machine_info() -> dict[str, Any]:
    """The machine record of a result file (see the module docstring)."""
    import torch

    gpu = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        gpu = {"name": p.name, "sm": f"sm_{p.major}{p.minor}", "sms": p.multi_processor_count,
               "memory_gib": round(p.total_memory / 2**30, 1), "l2_mib": round(getattr(p, "L2_cache_size", 0) / 2**20, 1)}
    given = os.environ.get("LS_GIT_COMMIT")
    commit = given or _git("rev-parse", "HEAD")
    dirty = None if given else _git("status", "--porcelain")
    return {
        "gpu": gpu,
        "driver": _driver(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cutlass_dsl": _cutlass_dsl_version(),
        "python": platform.python_version(),
        "git_commit": commit,
        "git_dirty": (bool(dirty) if dirty is not None else os.environ.get("LS_GIT_DIRTY") == "1"),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def describe(info: dict[str, Any]) -> str:
    """One line: 'NVIDIA H200 (sm_90), driver 580.x, CUDA 13.0, torch 2.11, triton 3.6, cutlass-dsl 4.8.0, git abc1234'."""
    g = info.get("gpu") or {}
    commit = (info.get("git_commit") or "unknown")[:10] + ("+dirty" if info.get("git_dirty") else "")
    return (f"{g.get('name', 'no GPU')} ({g.get('sm', '-')}), driver {info.get('driver')}, CUDA {info.get('cuda')}, "
            f"torch {info.get('torch')}, triton {info.get('triton')}, cutlass-dsl {info.get('cutlass_dsl')}, "
            f"git {commit}")
