"""PTX patterns the kernels' compile tests count (on sm_90a PTX from the CuTe DSL, no GPU)."""

import re

WEIGHT_LOAD = "ld.global.nc.L1::no_allocate.L2::256B.v4.b32"
"""A 16-byte streamed weight load through the non-coherent path (no L1 allocation, 256-byte L2 prefetch)."""
COHERENT_WEIGHT_LOAD = "ld.global.L1::no_allocate.L2::256B.v4.b32"
"""The same load through the coherent path: the batches a PDL kernel requests before its wait, with ``prefetch``
(the default) - ptxas keeps these ahead of ``griddepcontrol.wait``, the non-coherent ones it moves behind."""
_ANY = re.compile(r"ld\.global(?:\.nc)?\.L1::no_allocate\.L2::256B\.v4\.b32")


def weight_loads(ptx: str) -> int:
    """Streamed weight loads of either path."""
    return len(_ANY.findall(ptx))


def last_weight_load(ptx: str) -> int:
    """Offset of the last streamed weight load of either path."""
    return max(m.start() for m in _ANY.finditer(ptx))


def loads_before_wait(ptx: str) -> int:
    """Streamed weight loads before the first ``griddepcontrol.wait``: all of them coherent (checked)."""
    head = ptx[:ptx.index("griddepcontrol.wait")]
    assert weight_loads(head) == head.count(COHERENT_WEIGHT_LOAD), "a non-coherent weight load before the wait"
    return weight_loads(head)
