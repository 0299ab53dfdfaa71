"""A PTX interpreter for the CPU tests: runs what a CuTe DSL kernel compiles to, thread by thread, on CPU memory.

Why: the CuTe DSL compiles on this CPU machine (offline sm_90a PTX), but nothing here executes it; GPU time comes
in short, uncertain loans. Interpreting the PTX checks what the kernel computes - its address arithmetic, masks,
decode, MMA fragment layouts, cross-warp reductions and stores - against a torch reference, with every load and
store bounds-checked against the buffers the test allocated (an illegal address on the GPU is an error here).

Scope: the instruction subset our kernels emit (integer / fp32 / bf16x2 arithmetic, ``prmt``, loads and stores to
global and shared memory, predicates and branches, ``bar.sync``, ``shfl.sync``, ``mma.sync`` m16n8k16 bf16 with fp32
accumulators; ``griddepcontrol`` is a no-op: one kernel runs at a time). Anything else raises NotImplementedError
naming the instruction, so a kernel that needs more fails loudly instead of computing something else. Not modelled:
timing, memory ordering between CTAs (CTAs run one after another), approximate-instruction error (``ex2.approx`` and
friends compute exactly: tests compare with tolerances).

Execution: each thread is interpreted until it reaches a collective (``bar.sync``, ``shfl.sync``, ``mma.sync``) or
exits; a collective runs once every thread it involves waits at it (the whole warp at the same instruction for
``shfl`` / ``mma``, every live thread of the CTA for ``bar.sync``), else the run stops as a deadlock.

Kernel parameters: a tensor argument is passed as a struct - its address, the dynamic extents of its shape (int32
each), then its dynamic strides (int64, 8-byte aligned) - which :func:`tensor_param` packs; scalars are int32.
"""

from __future__ import annotations

import bisect
import functools
import math
import re
import struct
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import torch

MASK = {8: 0xFF, 16: 0xFFFF, 32: 0xFFFFFFFF, 64: 0xFFFFFFFFFFFFFFFF}


# ------------------------------------------------------------------------------------------------ values
def f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", float(np.float32(v))))[0]


def bf16_to_f32(h: int) -> float:
    return f32((h & 0xFFFF) << 16)


def f32_to_bf16(bits: int) -> int:
    """Round-to-nearest-even of fp32 bits to bf16 bits (NaN kept quiet)."""
    if (bits & 0x7F800000) == 0x7F800000 and bits & 0x7FFFFF:
        return ((bits >> 16) | 0x40) & 0xFFFF
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def f16_to_f32(h: int) -> float:
    return float(np.frombuffer(struct.pack("<H", h & 0xFFFF), dtype=np.float16)[0])


def f32_to_f16(v: float) -> int:
    return struct.unpack("<H", np.float16(v).tobytes())[0]


def signed(v: int, bits: int) -> int:
    v &= MASK[bits]
    return v - (1 << bits) if v >> (bits - 1) else v


def fround(x: float) -> float:
    """x rounded to fp32 (overflow to inf)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


# ------------------------------------------------------------------------------------------------ memory
class Memory:
    """Global memory: buffers at fake, widely spaced addresses; every access must fall inside one buffer."""

    def __init__(self) -> None:
        self._bases: list[int] = []
        self._bufs: list[bytearray] = []
        self._next = 1 << 32

    def put(self, t: torch.Tensor) -> int:
        """Copy a CPU tensor's bytes in (contiguous storage of its elements); its device address."""
        data = bytearray(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()) if t.numel() else \
            bytearray()
        return self.put_bytes(data)

    def put_bytes(self, data: bytearray) -> int:
        base = self._next
        self._bases.append(base)
        self._bufs.append(data)
        self._next += (len(data) + (1 << 20)) // (1 << 16) * (1 << 16) + (1 << 20)
        return base

    def _find(self, addr: int, n: int) -> tuple[bytearray, int]:
        i = bisect.bisect_right(self._bases, addr) - 1
        if i >= 0:
            off = addr - self._bases[i]
            if off + n <= len(self._bufs[i]):
                return self._bufs[i], off
        raise MemoryError(f"illegal address: {n} bytes at {addr:#x}")

    def read(self, addr: int, n: int) -> bytes:
        buf, off = self._find(addr, n)
        return bytes(buf[off:off + n])

    def write(self, addr: int, data: bytes) -> None:
        buf, off = self._find(addr, len(data))
        buf[off:off + len(data)] = data

    def tensor(self, addr: int, like: torch.Tensor) -> torch.Tensor:
        """The buffer at ``addr`` read back as a tensor of ``like``'s shape and dtype."""
        n = like.numel() * like.element_size()
        raw = torch.frombuffer(bytearray(self.read(addr, n)), dtype=torch.uint8)
        return raw.view(like.dtype).reshape(like.shape).clone()


def tensor_param(addr: int, dyn_shape: tuple[int, ...] = (), dyn_strides: tuple[int, ...] = ()) -> bytes:
    """A tensor argument's parameter struct: address, dynamic extents (int32), dynamic strides (int64)."""
    out = struct.pack("<Q", addr) + b"".join(struct.pack("<i", s) for s in dyn_shape)
    if dyn_strides:
        out += b"\0" * (-len(out) % 8) + b"".join(struct.pack("<q", s) for s in dyn_strides)
    return out + b"\0" * (-len(out) % 8)


# ------------------------------------------------------------------------------------------------ parsing
@dataclass
class Instr:
    guard: str | None
    neg: bool
    op: str
    args: list
    text: str
    head: str = ""
    mods: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.head, *self.mods = self.op.split(".")


@dataclass
class Kernel:
    name: str
    params: list[str]
    code: list[Instr]
    labels: dict[str, int]
    block: tuple[int, int, int] | None


_TOKEN = re.compile(r"\s*(\{[^{}]*\}|\[[^\]]*\]|[^,]+)")


def _split_operands(s: str) -> list[str]:
    return [t.strip() for t in _TOKEN.findall(s) if t.strip()]


def parse(ptx: str, entry: str | None = None) -> Kernel:
    """The (first, or named) ``.entry`` of a PTX module, its parameters in order, its instructions and labels."""
    text = re.sub(r"//[^\n]*", "", ptx)
    m = None
    for m in re.finditer(r"\.entry\s+(\w+)\s*\(([^)]*)\)", text):
        if entry is None or m.group(1) == entry:
            break
    if m is None:
        raise ValueError("no .entry in the PTX")
    name, plist = m.group(1), m.group(2)
    params = [re.findall(r"(\w+)(?:\[\d+\])?\s*$", p.strip())[0] for p in plist.split(",") if p.strip()]
    rest = text[m.end():]
    reqntid = re.match(r"\s*(?:\.\w+[^{]*?)?\.reqntid\s+(\d+)\s*,\s*(\d+)\s*,\s*(\d+)", rest)
    block = tuple(int(v) for v in reqntid.groups()) if reqntid else None
    body = rest[rest.index("{") + 1:]
    # the body ends at the brace matching the first one
    depth, end = 1, 0
    for i, ch in enumerate(body):
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            end = i
            break
    body = body[:end]
    code: list[Instr] = []
    labels: dict[str, int] = {}
    # statements: split on ';' (vector operands hold no ';'); labels end with ':'; scope braces are dropped
    for raw in body.split(";"):
        s = raw.strip()
        while True:
            s = s.lstrip("{} \t\n")
            lm = re.match(r"^([$\w]+):", s)
            if not lm:
                break
            labels[lm.group(1)] = len(code)
            s = s[lm.end():]
        s = s.strip()
        while s.endswith("}") and s.count("}") > s.count("{"):
            s = s[:-1].strip()  # a scope's closing brace, not a vector operand's
        if not s or s.startswith("."):
            continue  # declarations (.reg, .shared, ...)
        guard, neg = None, False
        gm = re.match(r"^@(!?)(%?\w+)\s+", s)
        if gm:
            neg, guard = gm.group(1) == "!", gm.group(2)
            s = s[gm.end():]
        parts = s.split(None, 1)
        code.append(Instr(guard, neg, parts[0], _split_operands(parts[1]) if len(parts) > 1 else [], s))
    return Kernel(name, params, code, labels, block)


# ------------------------------------------------------------------------------------------------ threads
@dataclass
class Thread:
    tid: tuple[int, int, int]
    linear: int
    regs: dict = field(default_factory=dict)
    pc: int = 0
    done: bool = False
    waiting: str | None = None  # collective kind at self.pc


class Emulator:
    """Runs one kernel over a grid; ``mem`` is the global memory its pointer parameters point into."""

    def __init__(self, ptx: str, mem: Memory, entry: str | None = None, smem_bytes: int = 48 * 1024,
                 max_steps: int = 50_000_000):
        self.k = parse(ptx, entry)
        self.mem = mem
        self.smem_bytes = smem_bytes
        self.max_steps = max_steps
        self.steps = 0

    # -- launch
    def launch(self, grid: tuple[int, int, int], params: list[bytes | int], block: tuple[int, int, int] | None = None
               ) -> None:
        block = block or self.k.block
        if block is None:
            raise ValueError("block size: pass block= (the PTX has no .reqntid)")
        if len(params) != len(self.k.params):
            raise ValueError(f"{len(self.k.params)} parameters expected, got {len(params)}")
        self.param = {}
        for name, p in zip(self.k.params, params):
            self.param[name] = p if isinstance(p, bytes) else struct.pack("<i", p)
        self.grid, self.block = grid, block
        for cz in range(grid[2]):
            for cy in range(grid[1]):
                for cx in range(grid[0]):
                    self._run_cta((cx, cy, cz))

    def _run_cta(self, ctaid: tuple[int, int, int]) -> None:
        bx, by, bz = self.block
        self.ctaid = ctaid
        self.smem = bytearray(self.smem_bytes)
        threads = [Thread((x, y, z), x + bx * (y + by * z)) for z in range(bz) for y in range(by) for x in range(bx)]
        while True:
            for t in threads:
                if not t.done and t.waiting is None:
                    self._run_until_collective(t)
            live = [t for t in threads if not t.done]
            if not live:
                return
            progressed = False
            for w in range(0, len(threads), 32):
                warp = threads[w:w + 32]
                kinds = {(t.waiting, t.pc) for t in warp if not t.done}
                if len(kinds) == 1:
                    kind, pc = next(iter(kinds))
                    if kind in ("mma", "shfl"):
                        if any(t.done for t in warp):
                            raise RuntimeError(f"{kind} at pc {pc} with exited lanes in warp {w // 32}")
                        self._collective(kind, self.k.code[pc], warp)
                        for t in warp:
                            t.waiting, t.pc = None, t.pc + 1
                        progressed = True
            if not progressed and all(t.waiting == "bar" for t in live):
                pcs = {t.pc for t in live}
                if len(pcs) != 1:
                    raise RuntimeError(f"bar.sync reached at different instructions: {sorted(pcs)}")
                for t in live:
                    t.waiting, t.pc = None, t.pc + 1
                progressed = True
            if not progressed:
                state = sorted({(t.waiting, t.pc) for t in live})
                raise RuntimeError(f"deadlock in CTA {ctaid}: threads wait at {state[:8]}")

    # -- operands
    def _special(self, t: Thread, name: str) -> int:
        base, _, dim = name.partition(".")
        i = "xyz".index(dim) if dim else 0
        if base == "%tid":
            return t.tid[i]
        if base == "%ntid":
            return self.block[i]
        if base == "%ctaid":
            return self.ctaid[i]
        if base == "%nctaid":
            return self.grid[i]
        if base == "%laneid":
            return t.linear % 32
        if base in ("%cluster_ctarank", "%cluster_nctarank"):
            return 0 if base == "%cluster_ctarank" else 1
        raise NotImplementedError(f"special register {name}")

    def val(self, t: Thread, s: str, bits: int = 32) -> int:
        if s in t.regs:
            return t.regs[s]
        c = s[0]
        if c.isdigit() or c == "-":
            if s.startswith(("0f", "0F")) and len(s) == 10:
                return int(s[2:], 16)
            if s.startswith(("0d", "0D")) and len(s) == 18:
                return int(s[2:], 16)
            return int(s, 0) & MASK[max(bits, 32)]
        if s.startswith("%") and ("." in s or s in ("%laneid",)):
            return self._special(t, s)
        if s.startswith("__dynamic_shmem") or s.startswith("__shared"):
            return 0
        raise KeyError(f"read of unset register {s} at pc {t.pc}: {self.k.code[t.pc].text}")

    def addr(self, t: Thread, s: str) -> tuple[str | None, int]:
        inner = s.strip()[1:-1].strip()
        m = re.match(r"^([^+\-]+?)\s*(?:([+\-])\s*(\w+))?$", inner)
        base, sign, off = m.group(1).strip(), m.group(2), m.group(3)
        o = int(off, 0) * (-1 if sign == "-" else 1) if off else 0
        if base in self.param:
            return base, o
        return None, self.val(t, base, 64) + o

    # -- the interpreter
    def _run_until_collective(self, t: Thread) -> None:
        code = self.k.code
        while True:
            if t.pc >= len(code):
                t.done = True
                return
            ins = code[t.pc]
            self.steps += 1
            if self.steps > self.max_steps:
                raise RuntimeError("step limit: an endless loop?")
            if ins.guard is not None:
                p = bool(self.val(t, ins.guard))
                if p == ins.neg:
                    t.pc += 1
                    continue
            head = ins.head
            if head in ("ret", "exit"):
                t.done = True
                return
            if head == "bra":
                t.pc = self.k.labels[ins.args[0]]
                continue
            if head in ("bar", "barrier"):
                t.waiting = "bar"
                return
            if head == "mma":
                t.waiting = "mma"
                return
            if head == "shfl":
                t.waiting = "shfl"
                return
            self._execute(t, ins, head)
            t.pc += 1

    def _execute(self, t: Thread, ins: Instr, head: str) -> None:  # noqa: C901 (one dispatch)
        op, a = ins.op, ins.args
        mods = ins.mods
        ty = mods[-1] if mods else "b32"
        bits = _bits(ty)
        R = t.regs
        if head in ("griddepcontrol", "fence", "membar", "prefetch"):
            return
        if head == "mov":
            R[a[0]] = self.val(t, a[1], bits) & MASK[max(bits, 8)] if ty != "pred" else self.val(t, a[1])
            return
        if head == "ld":
            return self._load(t, ins, mods)
        if head == "st":
            return self._store(t, ins, mods)
        if head == "cvt" and op == "cvt.sat.f32.f32":
            return self._float(t, ins, head, mods)
        if head == "cvt":
            return self._cvt(t, ins, mods)
        if head == "setp":
            return self._setp(t, ins, mods)
        if head == "selp":
            R[a[0]] = self.val(t, a[1], bits) if self.val(t, a[3]) else self.val(t, a[2], bits)
            return
        if ty == "pred":
            x = [bool(self.val(t, s)) for s in a[1:]]
            R[a[0]] = {"and": lambda: x[0] and x[1], "or": lambda: x[0] or x[1], "xor": lambda: x[0] != x[1],
                       "not": lambda: not x[0]}[head]()
            return
        if ty in ("f32", "f64"):
            return self._float(t, ins, head, mods)
        if ty == "bf16x2":
            return self._bf16x2(t, ins, head)
        if head == "prmt":
            R[a[0]] = _prmt(self.val(t, a[1]), self.val(t, a[2]), self.val(t, a[3]))
            return
        self._integer(t, ins, head, mods, ty, bits)

    def _integer(self, t, ins, head, mods, ty, bits) -> None:
        a, R = ins.args, t.regs
        sgn = ty.startswith("s")
        v = [self.val(t, s, bits) for s in a[1:]]
        m = MASK[bits]
        if sgn:
            sv = [signed(x, bits) for x in v]
        else:
            sv = [x & m for x in v]
        if head == "add":
            r = sv[0] + sv[1]
        elif head == "sub":
            r = sv[0] - sv[1]
        elif head in ("mul", "mad"):
            wide = "wide" in mods
            p = sv[0] * sv[1]
            if "hi" in mods:
                p >>= bits
            if head == "mad":
                c = self.val(t, a[3], 2 * bits if wide else bits)
                p += signed(c, 2 * bits if wide else bits) if sgn else c
            R[a[0]] = p & MASK[2 * bits if wide else bits]
            return
        elif head == "shl":
            r = (v[0] << min(v[1] & 0xFFFFFFFF, bits)) if v[1] < bits else 0
        elif head == "shr":
            n = min(v[1] & 0xFFFFFFFF, bits)
            r = (sv[0] >> n) if sgn else ((v[0] & m) >> n)
        elif head == "and":
            r = v[0] & v[1]
        elif head == "or":
            r = v[0] | v[1]
        elif head == "xor":
            r = v[0] ^ v[1]
        elif head == "not":
            r = ~v[0]
        elif head == "neg":
            r = -sv[0]
        elif head == "min":
            r = min(sv[0], sv[1])
        elif head == "max":
            r = max(sv[0], sv[1])
        elif head == "abs":
            r = abs(sv[0])
        elif head == "div":
            r = int(sv[0] / sv[1]) if sv[1] else m
        elif head == "rem":
            r = int(math.fmod(sv[0], sv[1])) if sv[1] else m
        elif head == "popc":
            r = bin(v[0] & m).count("1")
        elif head == "bfe":
            pos, ln = v[1] & 0xFF, v[2] & 0xFF
            r = (sv[0] >> pos) & ((1 << ln) - 1) if ln else 0
            if sgn and ln and (r >> (ln - 1)) & 1:
                r -= 1 << ln
        else:
            raise NotImplementedError(f"PTX instruction {ins.text!r}")
        R[a[0]] = r & m

    def _float(self, t, ins, head, mods) -> None:
        a, R = ins.args, t.regs
        x = [f32(self.val(t, s)) for s in a[1:]]
        ftz = "ftz" in mods

        def flush(v: float) -> float:
            return 0.0 * math.copysign(1.0, v) if ftz and v != 0 and abs(v) < 1.1754943508222875e-38 else v

        x = [flush(v) for v in x]
        mode = next((m for m in mods if m in ("rm", "rp", "rz")), None)
        if mode and head in ("add", "sub", "mul", "fma", "mad") and all(math.isfinite(v) for v in x):
            e = [Fraction(v) for v in x]
            exact = {"add": lambda: e[0] + e[1], "sub": lambda: e[0] - e[1], "mul": lambda: e[0] * e[1]}.get(
                head, lambda: e[0] * e[1] + e[2])()
            R[a[0]] = f32_bits(flush(_round_directed(exact, mode)))
            return
        with np.errstate(all="ignore"):
            if head == "copysign":  # d = b with the sign of a
                r = math.copysign(x[1], x[0])
            elif head == "cvt":
                r = 0.0 if math.isnan(x[0]) else min(max(x[0], 0.0), 1.0)
            elif head == "add":
                r = fround(np.float64(x[0]) + x[1])
            elif head == "sub":
                r = fround(np.float64(x[0]) - x[1])
            elif head == "mul":
                r = fround(np.float64(x[0]) * x[1])
            elif head in ("fma", "mad"):
                r = fround(np.float64(x[0]) * x[1] + x[2])
            elif head == "div":
                r = fround(np.float64(x[0]) / x[1]) if x[1] else math.copysign(math.inf, x[0]) * math.copysign(
                    1.0, x[1]) if x[0] else math.nan
            elif head == "rcp":
                r = fround(1.0 / np.float64(x[0])) if x[0] else math.copysign(math.inf, x[0])
            elif head == "sqrt":
                r = fround(math.sqrt(x[0])) if x[0] >= 0 else math.nan
            elif head == "rsqrt":
                r = fround(1.0 / math.sqrt(x[0])) if x[0] > 0 else (math.inf if x[0] == 0 else math.nan)
            elif head == "ex2":
                r = fround(2.0 ** x[0]) if x[0] < 1024 else math.inf
            elif head == "lg2":
                r = fround(math.log2(x[0])) if x[0] > 0 else (-math.inf if x[0] == 0 else math.nan)
            elif head == "tanh":
                r = fround(math.tanh(x[0]))
            elif head == "max":
                r = max(x[0], x[1]) if not (math.isnan(x[0]) or math.isnan(x[1])) else (
                    x[1] if math.isnan(x[0]) else x[0])
            elif head == "min":
                r = min(x[0], x[1]) if not (math.isnan(x[0]) or math.isnan(x[1])) else (
                    x[1] if math.isnan(x[0]) else x[0])
            elif head == "neg":
                r = -x[0]
            elif head == "abs":
                r = abs(x[0])
            else:
                raise NotImplementedError(f"PTX instruction {ins.text!r}")
        R[a[0]] = f32_bits(flush(r))

    def _bf16x2(self, t, ins, head) -> None:
        a = ins.args
        x = [self.val(t, s) for s in a[1:]]
        out = 0
        for half in (0, 16):
            h = [bf16_to_f32(v >> half) for v in x]
            if head == "mul":
                r = np.float64(h[0]) * h[1]
            elif head == "add":
                r = np.float64(h[0]) + h[1]
            elif head == "sub":
                r = np.float64(h[0]) - h[1]
            elif head == "fma":
                r = np.float64(h[0]) * h[1] + h[2]
            else:
                raise NotImplementedError(f"PTX instruction {ins.text!r}")
            out |= _round_bf16(float(r)) << half
        t.regs[a[0]] = out

    def _cvt(self, t, ins, mods) -> None:
        a, R = ins.args, t.regs
        rnd = [m for m in mods if m in ("rn", "rz", "rm", "rp", "rni", "rzi", "rmi", "rpi")]
        types = [m for m in mods if m not in rnd and m not in ("ftz", "sat", "relu", "satfinite")]
        dst, src = types[0], types[1]
        if dst == "bf16x2" and src == "f32":  # d = {a -> high, b -> low}
            hi, lo = (_round_bf16(f32(self.val(t, s))) for s in a[1:3])
            R[a[0]] = hi << 16 | lo
            return
        v = self.val(t, a[1], _bits(src))
        if src in ("f32", "bf16", "f16", "f64"):
            x = f32(v) if src == "f32" else bf16_to_f32(v) if src == "bf16" else f16_to_f32(v) if src == "f16" \
                else struct.unpack("<d", struct.pack("<Q", v))[0]
            if dst == "f32":
                R[a[0]] = f32_bits(x)
            elif dst == "bf16":
                R[a[0]] = _round_bf16(x)
            elif dst == "f16":
                R[a[0]] = f32_to_f16(x)
            elif dst[0] in "su":
                r = {"rni": round, "rzi": math.trunc, "rmi": math.floor, "rpi": math.ceil}.get(
                    rnd[0] if rnd else "rzi", math.trunc)(x) if math.isfinite(x) else 0
                R[a[0]] = r & MASK[_bits(dst)]
            else:
                raise NotImplementedError(f"PTX instruction {ins.text!r}")
            return
        sv = signed(v, _bits(src)) if src.startswith("s") else v & MASK[_bits(src)]
        if dst == "f32":
            R[a[0]] = f32_bits(sv)
        elif dst[0] in "sub":
            R[a[0]] = sv & MASK[max(_bits(dst), 8)]
        else:
            raise NotImplementedError(f"PTX instruction {ins.text!r}")

    def _setp(self, t, ins, mods) -> None:
        a = ins.args
        cmp, ty = mods[0], mods[-1]
        bits = _bits(ty)
        x = [self.val(t, s, bits) for s in a[1:3]]
        if ty.startswith("f"):
            x = [f32(v) for v in x]
        elif ty.startswith("s"):
            x = [signed(v, bits) for v in x]
        else:
            x = [v & MASK[bits] for v in x]
        r = {"eq": x[0] == x[1], "ne": x[0] != x[1], "lt": x[0] < x[1], "le": x[0] <= x[1], "gt": x[0] > x[1],
             "ge": x[0] >= x[1], "lo": x[0] < x[1], "ls": x[0] <= x[1], "hi": x[0] > x[1], "hs": x[0] >= x[1],
             "equ": x[0] == x[1], "neu": x[0] != x[1] or math.isnan(x[0]) or math.isnan(x[1]),
             "ltu": not (x[0] >= x[1]), "leu": not (x[0] > x[1]), "gtu": not (x[0] <= x[1]),
             "geu": not (x[0] < x[1])}[cmp]
        if len(a) > 3:  # setp.cmp.bool: combined with a predicate
            c = bool(self.val(t, a[3].lstrip("!"))) != a[3].startswith("!")
            r = {"and": r and c, "or": r or c, "xor": r != c}[mods[1]]
        dsts = a[0].split("|")
        t.regs[dsts[0]] = r
        if len(dsts) > 1:
            t.regs[dsts[1]] = not r

    def _space(self, mods: list[str]) -> str:
        for s in ("param", "shared", "global", "local", "const"):
            if s in mods:
                return s
        return "global"

    def _load(self, t, ins, mods) -> None:
        a = ins.args
        ty = mods[-1]
        width = _bits(ty) // 8
        vec = next((int(m[1:]) for m in mods if m in ("v2", "v4", "v8")), 1)
        dsts = a[0].strip("{}").split(",") if vec > 1 else [a[0]]
        space = self._space(mods)
        pname, addr = self.addr(t, a[1])
        n = width * vec
        if space != "param" and addr % n:
            raise MemoryError(f"misaligned {n}-byte load at {addr:#x}: {ins.text}")
        if space == "param":
            raw = self.param[pname][addr:addr + n]
            if len(raw) != n:
                raise MemoryError(f"parameter {pname} read past its end ({addr}+{n})")
        elif space == "shared":
            if addr < 0 or addr + n > len(self.smem):
                raise MemoryError(f"shared memory read at {addr} + {n} past {len(self.smem)} bytes")
            raw = bytes(self.smem[addr:addr + n])
        elif space == "global":
            raw = self.mem.read(addr, n)
        else:
            raise NotImplementedError(f"PTX instruction {ins.text!r}")
        for i, d in enumerate(dsts):
            v = int.from_bytes(raw[i * width:(i + 1) * width], "little")
            if ty.startswith("s") and width < 4:
                v = signed(v, 8 * width) & MASK[32]
            t.regs[d.strip()] = v

    def _store(self, t, ins, mods) -> None:
        a = ins.args
        ty = mods[-1]
        width = _bits(ty) // 8
        vec = next((int(m[1:]) for m in mods if m in ("v2", "v4", "v8")), 1)
        srcs = a[1].strip("{}").split(",") if vec > 1 else [a[1]]
        data = b"".join((self.val(t, s.strip(), 8 * width) & MASK[max(8 * width, 8)]).to_bytes(width, "little")
                        for s in srcs)
        _, addr = self.addr(t, a[0])
        space = self._space(mods)
        if addr % len(data):
            raise MemoryError(f"misaligned {len(data)}-byte store at {addr:#x}: {ins.text}")
        if space == "shared":
            if addr < 0 or addr + len(data) > len(self.smem):
                raise MemoryError(f"shared memory write at {addr} + {len(data)} past {len(self.smem)} bytes")
            self.smem[addr:addr + len(data)] = data
        elif space == "global":
            self.mem.write(addr, data)
        else:
            raise NotImplementedError(f"PTX instruction {ins.text!r}")

    # -- collectives
    def _collective(self, kind: str, ins: Instr, warp: list[Thread]) -> None:
        if kind == "shfl":
            return self._shfl(ins, warp)
        if ins.op != "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32":
            raise NotImplementedError(f"PTX instruction {ins.text!r}")
        regs = [[s.strip() for s in arg.strip("{}").split(",")] for arg in ins.args]
        A = np.zeros((16, 16))
        B = np.zeros((16, 8))
        C = np.zeros((16, 8))
        for lane, t in enumerate(warp):
            g, q = lane // 4, lane % 4
            av = [self.val(t, r) for r in regs[1]]
            for i, (row, col) in enumerate([(g, 2 * q), (g + 8, 2 * q), (g, 2 * q + 8), (g + 8, 2 * q + 8)]):
                A[row, col], A[row, col + 1] = bf16_to_f32(av[i]), bf16_to_f32(av[i] >> 16)
            bv = [self.val(t, r) for r in regs[2]]
            for i, k in enumerate((2 * q, 2 * q + 8)):
                B[k, g], B[k + 1, g] = bf16_to_f32(bv[i]), bf16_to_f32(bv[i] >> 16)
            cv = [f32(self.val(t, r)) for r in regs[3]]
            C[g, 2 * q], C[g, 2 * q + 1], C[g + 8, 2 * q], C[g + 8, 2 * q + 1] = cv
        D = A @ B + C
        for lane, t in enumerate(warp):
            g, q = lane // 4, lane % 4
            for r, v in zip(regs[0], (D[g, 2 * q], D[g, 2 * q + 1], D[g + 8, 2 * q], D[g + 8, 2 * q + 1])):
                t.regs[r] = f32_bits(fround(v))

    def _shfl(self, ins: Instr, warp: list[Thread]) -> None:
        mode = ins.op.split(".")[2]
        dst = ins.args[0].split("|")
        vals = [self.val(t, ins.args[1]) for t in warp]
        out = []
        for lane, t in enumerate(warp):
            b = self.val(t, ins.args[2]) & 0x1F
            c = self.val(t, ins.args[3])
            seg = (c >> 8) & 0x1F
            cval = c & 0x1F
            max_lane = (lane & seg) | (cval & ~seg & 0x1F)
            min_lane = lane & seg
            if mode == "idx":
                j = min_lane | (b & ~seg & 0x1F)
                ok = j <= max_lane
            elif mode == "up":
                j = lane - b
                ok = j >= max_lane
            elif mode == "down":
                j = lane + b
                ok = j <= max_lane
            else:  # bfly
                j = lane ^ b
                ok = j <= max_lane
            out.append((vals[j] if ok else vals[lane], ok))
        for t, (v, ok) in zip(warp, out):
            t.regs[dst[0]] = v
            if len(dst) > 1:
                t.regs[dst[1]] = ok


@functools.lru_cache(maxsize=None)
def _bits(ty: str) -> int:
    if ty == "pred":
        return 32
    m = re.search(r"(\d+)", ty)
    if not m:
        return 32
    n = int(m.group(1))
    return 32 if ty.endswith("x2") else n


def _round_directed(x: Fraction, mode: str) -> float:
    """The exact value ``x`` rounded to fp32 toward -inf ("rm"), +inf ("rp") or zero ("rz")."""
    r = np.float32(float(x))
    if not np.isfinite(r):
        return float(r)
    down = mode == "rm" or (mode == "rz" and x > 0)
    if down and Fraction(float(r)) > x:
        r = np.nextafter(r, np.float32(-np.inf))
    elif not down and Fraction(float(r)) < x:
        r = np.nextafter(r, np.float32(np.inf))
    return float(r)


def _round_bf16(x: float) -> int:
    """x (a float64) rounded to fp32, then to bf16 bits (nearest even; overflow to inf)."""
    if math.isnan(x):
        return 0x7FC0
    if abs(x) > 3.4028234663852886e38 and not math.isinf(x):  # past fp32's largest finite: numpy rounds it
        with np.errstate(over="ignore"):
            return f32_to_bf16(struct.unpack("<I", np.float32(x).tobytes())[0])
    return f32_to_bf16(struct.unpack("<I", struct.pack("<f", x))[0])


def _prmt(a: int, b: int, sel: int) -> int:
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        byte = pool[s & 7]
        if s & 8:  # sign replicate
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


__all__ = ["Emulator", "Memory", "parse", "tensor_param", "f32", "bf16_to_f32", "f32_to_bf16"]
