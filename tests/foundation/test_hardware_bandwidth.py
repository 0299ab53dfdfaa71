"""Roofline bandwidth by device: the name picks the memory system where one arch has several (H100 / H200)."""

from __future__ import annotations

import pytest

from latency_specialized import hardware


@pytest.mark.parametrize("name,arch,want", [
    ("NVIDIA H200", "sm_90", 4.3e12),
    ("NVIDIA H100 80GB HBM3", "sm_90", 3.0e12),
    ("NVIDIA H100 NVL", "sm_90", 3.5e12),
    ("NVIDIA GH200 480GB", "sm_90", 4.3e12),      # an unlisted name of a listed arch: the arch's figure
    ("NVIDIA B200", "sm_100", 7.2e12),
    ("Some Future GPU", "sm_999", 1e12),
])
def test_device_bandwidth_by_name_then_arch(name, arch, want):
    assert hardware.device_bandwidth(name, arch) == want


def test_roofline_bandwidth_off_the_gpu_is_the_h200s(monkeypatch):
    """CPU report tests and plans use the H200's figure (PERF.md's roofline), not the CPU's."""
    hardware.roofline_bandwidth.cache_clear()
    monkeypatch.setattr(hardware, "probe", lambda device=None: hardware.for_arch("cpu"))
    try:
        assert hardware.roofline_bandwidth() == 4.3e12
    finally:
        hardware.roofline_bandwidth.cache_clear()
