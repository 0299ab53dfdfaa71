"""sm_90a SASS of a PTX module without a GPU, through the ptxas / nvdisasm / cuobjdump that Triton ships.

For reading what the assembler made of a CuTe DSL kernel: instruction mix and order (e.g. where the PDL wait
``ACQBULK`` landed relative to the weight loads), registers. The PTX ``.version`` is lowered to 8.4, which that
ptxas (12.9) reads; the instructions are unchanged. The GPU's own toolchain may be newer: what this shows is
evidence about a ptxas, not a measurement.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass


@dataclass
class Sass:
    text: str
    """nvdisasm's listing."""
    ops: collections.Counter
    """Opcode -> count (static)."""
    order: list[str]
    """Opcodes in program order (predicate guards dropped), with the load flavour kept (``LDG.E.NA...``)."""
    regs: int


def tools_dir() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def sass_of(ptx: str) -> Sass:
    tools = tools_dir()
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(re.sub(r"\.version \d+\.\d+", ".version 8.4", ptx))
        subprocess.run([f"{tools}/ptxas", "-arch=sm_90a", "-O3", src, "-o", cubin], check=True,
                       capture_output=True)
        text = subprocess.run([f"{tools}/nvdisasm", "-c", cubin], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([f"{tools}/cuobjdump", "--dump-resource-usage", cubin], capture_output=True,
                               text=True).stdout
    ops: collections.Counter = collections.Counter()
    order = []
    for line in text.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)", line)
        if m:
            ops[m.group(1)] += 1
            order.append(m.group(1) + m.group(2))
    return Sass(text, ops, order, int(re.search(r"REG:(\d+)", usage).group(1)))


__all__ = ["Sass", "sass_of", "tools_dir"]
