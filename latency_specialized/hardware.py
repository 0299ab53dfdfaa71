"""What the backend runs on: arch, SM count, L2, memory bandwidth.

``probe()`` reads the current device (or reports ``cpu`` where there is no GPU). ``for_arch()``
returns the nominal figures of a named arch so that plans can be made for a GPU this machine
does not have (``latency-specialized explain --arch sm_90`` on a laptop).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from latency_specialized.errors import UserError


@dataclass(frozen=True)
class Hardware:
    """One device as the planner sees it."""

    arch: str
    """'cpu' or 'sm_XY' (compute capability X.Y)."""
    name: str
    """Human-readable device name."""
    sm_count: int
    """Streaming multiprocessors (CPU: cores)."""
    l2_bytes: int
    """Last-level cache the prefetch op can warm."""
    hbm_bytes_per_s: float
    """Achievable memory read bandwidth used as the roofline."""
    probed: bool
    """True when read off a real device, False when nominal."""

    @property
    def is_gpu(self) -> bool:
        return self.arch != "cpu"

    @property
    def sm_major(self) -> int:
        return int(self.arch[3:-1]) if self.is_gpu else 0


# Nominal figures for planning without the device. Bandwidths are the *achievable* ones used as
# rooflines (H200: measured 4.3 TB/s, PERF.md); others are ~90% of datasheet.
_NOMINAL: dict[str, Hardware] = {
    "cpu": Hardware("cpu", "CPU", 1, 0, 50e9, False),
    "sm_80": Hardware("sm_80", "A100 (nominal)", 108, 40 * 2**20, 1.8e12, False),
    "sm_89": Hardware("sm_89", "L40S (nominal)", 142, 96 * 2**20, 0.78e12, False),
    "sm_90": Hardware("sm_90", "H200 (nominal)", 132, 60 * 2**20, 4.3e12, False),
    "sm_100": Hardware("sm_100", "B200 (nominal)", 148, 126 * 2**20, 7.2e12, False),
    "sm_103": Hardware("sm_103", "GB300 (nominal)", 160, 126 * 2**20, 7.2e12, False),
    "sm_120": Hardware("sm_120", "RTX PRO 6000 (nominal)", 188, 128 * 2**20, 1.6e12, False),
}

KNOWN_ARCHS: tuple[str, ...] = tuple(_NOMINAL)

_BANDWIDTH_BY_NAME: tuple[tuple[str, float], ...] = (("H200", 4.3e12), ("H100 NVL", 3.5e12), ("H100", 3.0e12))
"""Achievable HBM read bandwidth of a device whose name holds the key (first match), where one arch has several
memory systems: the H200's measured 4.3 TB/s (PERF.md); an H100's ~90% of its datasheet (SXM 3.35, NVL 3.9 TB/s),
as the other nominal figures. An unlisted device of a listed arch takes the arch's figure."""


def for_arch(arch: str) -> Hardware:
    """Nominal hardware of ``arch`` for planning; raises UserError naming the known archs."""
    arch = arch.strip().lower()
    if arch.startswith("sm") and not arch.startswith("sm_"):
        arch = "sm_" + arch[2:]
    arch = arch.rstrip("af") if arch.startswith("sm_") else arch  # sm_90a / sm_100f -> base arch
    if arch not in _NOMINAL:
        raise UserError(f"unknown arch '{arch}': use one of {', '.join(KNOWN_ARCHS)}")
    return _NOMINAL[arch]


NOMINAL_SMS = 132
"""SMs assumed for launch geometry off the GPU (an H200's): compile-only and interpreter runs."""


@functools.cache
def _sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: Any) -> int:
    """SMs of a torch device, for kernels that size their grids by it (cached per device index);
    ``NOMINAL_SMS`` for a non-CUDA device."""
    import torch

    if device.type != "cuda":
        return NOMINAL_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(index)


def capability(device: Any) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA torch device (cached per device index)."""
    import torch

    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def probe(device: int | None = None) -> Hardware:
    """The current CUDA device, or the CPU when torch sees no GPU."""
    import torch

    if not torch.cuda.is_available():
        return _NOMINAL["cpu"]
    idx = torch.cuda.current_device() if device is None else device
    props = torch.cuda.get_device_properties(idx)
    arch = f"sm_{props.major}{props.minor}"
    nominal = _NOMINAL.get(arch)
    l2 = getattr(props, "L2_cache_size", 0) or (nominal.l2_bytes if nominal else 0)
    return Hardware(arch, props.name, props.multi_processor_count, int(l2), device_bandwidth(props.name, arch), True)


def device_bandwidth(name: str, arch: str) -> float:
    """Achievable HBM read bandwidth (bytes/s) of a device by its name (``_BANDWIDTH_BY_NAME``), else its arch's
    nominal figure, else 1 TB/s."""
    for key, bw in _BANDWIDTH_BY_NAME:
        if key in name:
            return bw
    nominal = _NOMINAL.get(arch)
    return nominal.hbm_bytes_per_s if nominal else 1e12


@functools.cache
def roofline_bandwidth() -> float:
    """The bandwidth rooflines divide by: this GPU's (``probe``), or the H200's (sm_90 nominal) where torch sees
    no GPU - CPU report tests and plans are made for the H200."""
    hw = probe()
    return hw.hbm_bytes_per_s if hw.is_gpu else _NOMINAL["sm_90"].hbm_bytes_per_s
