"""PTX of the CuTe DSL kernels whose code is shared between variants, for refactors that must not
change a kernel: snapshot before, snapshot after, compare (no GPU needed; compiles for sm_90a).

    python scripts/ptx_snapshot.py /tmp/ptx_before       # on the old code
    python scripts/ptx_snapshot.py /tmp/ptx_after        # on the new code
    python scripts/ptx_snapshot.py --compare /tmp/ptx_before /tmp/ptx_after

Covers the fused all-reduce kernels (one-shot, two-stage), AttnRes, residual+RMSNorm and the gated
activation over their dtype / shape / option variants (~30 kernels, ~30 s on 2 cores), and the Triton KDA
verify / accept kernels at Kimi K3 rank shapes under every candidate config, bf16 and fp32 (36 kernels, ~2 min;
their PTX without debug lines - ``.loc``, ``.file``, labels, debug sections - which move with the source lines).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

# this tree's code, not an installed copy's (a snapshot of an older checkout must compile that checkout's
# kernels), and tests.* (the KDA verify launch builders)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _allreduce(out: Path) -> None:
    import importlib

    from latency_specialized.kernels.allreduce_common import FusedAllReduceConfig

    cfgs = [FusedAllReduceConfig("bfloat16", 7168, 8), FusedAllReduceConfig("bfloat16", 64, 2),
            FusedAllReduceConfig("float32", 5120, 4), FusedAllReduceConfig("bfloat16", 7168, 2, has_norm=False)]
    # --keep-ptx writes the PTX file into the working directory (the one of the first compile): one
    # directory for all, read while it exists
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as d:
        os.chdir(d)
        try:
            for mod in ("allreduce_lamport", "allreduce_two_stage"):
                m = importlib.import_module(f"latency_specialized.kernels.{mod}")
                for i, c in enumerate(cfgs):
                    _write(out / f"{mod}_{i}.ptx", m.compile_for(c, extra_options="--keep-ptx").__ptx__)
        finally:
            os.chdir(cwd)


def _elementwise(out: Path) -> None:
    import torch

    from latency_specialized.kernels import attnres as A
    from latency_specialized.kernels import mlp_fused as F
    from latency_specialized.kernels import rmsnorm as R
    from latency_specialized.kernels.gemm_common import ptx_of
    from latency_specialized.spec import ActivationSpec

    for dt in ("bfloat16", "float16", "float32"):
        for s, on in ((3, True), (9, False)):
            var = A.AttnResVariant(7168 if dt != "float32" else 3584, dt, s, on)
            _write(out / f"attnres_{dt}_{s}_{on}.ptx", ptx_of(A.compile_attnres(var)))
    norms = {"block_c2": (R.NormVariant(7168, "bfloat16", True, True, False, False, True), R.NormConfig(cluster=2)),
             "gated": (R.NormVariant(128, "bfloat16", False, True, False, True, True), R.NormConfig()),
             "fp32": (R.NormVariant(512, "float32", True, True, True, False, True), R.NormConfig()),
             "f16": (R.NormVariant(1536, "float16", True, True, True, False, True), R.NormConfig())}
    for name, (var, cfg) in norms.items():
        _write(out / f"norm_{name}.ptx", ptx_of(R.compile_norm(var, cfg)))
    acts = [ActivationSpec(kind="situ_glu", beta=4, beta_lin=25), ActivationSpec(kind="swiglu", clamp=10.0),
            ActivationSpec()]
    for i, act in enumerate(acts):
        for dt in (torch.bfloat16, torch.float16):
            _write(out / f"act_{i}_{str(dt).removeprefix('torch.')}.ptx", ptx_of(F.compile_act(F._act_variant(768, dt, act))))


def _kda_verify(out: Path) -> None:
    import hashlib
    import re

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import latency_specialized.kernels.kda_verify_triton as kt
    from tests.ops.test_kda_verify_triton import _kimi_launches
    from tests.triton_offline import _signature

    debug = re.compile(r"\s*(\.loc|\.file|//|\$L__|\.section|\.b8|\.b16|\.b32|\.b64)")
    runs = [(B, 4, None, torch.bfloat16) for B in (1, 8, 64)]
    runs += [(B, 12, c, dt) for B in (1, 8, 64) for c in kt.candidate_configs(B, 12, 128)
             for dt in (torch.bfloat16, torch.float32)]
    done = set()
    for B, H, config, dt in runs:
        for fn, args, kw in _kimi_launches(kt, B, H=H, config=config, dtype=dt):
            sig, const = _signature(fn, args, {k: v for k, v in kw.items() if k != "enable_fp_fusion"})
            key = (fn.fn.__name__, tuple(sorted(sig.items())), tuple(sorted(const.items())), kw["num_warps"])
            if key in done:
                continue
            done.add(key)
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": kw["num_warps"], "enable_fp_fusion": False})
            ptx = "\n".join(line for line in k.asm["ptx"].splitlines() if not debug.match(line))
            _write(out / f"{fn.fn.__name__}_{hashlib.sha1(repr(key).encode()).hexdigest()[:12]}.ptx", ptx,
                   check_header=False)


def _write(path: Path, text: str | None, check_header: bool = True) -> None:
    if not text or (check_header and not text.lstrip().startswith("//")):
        raise SystemExit(f"no PTX for {path.name}: a kernel came from the disk cache (set LS_KERNEL_CACHE_DIR "
                         "to an empty directory)")
    path.write_text(text)
    print(f"{path.name}: {len(text)} chars")


def _compare(a: Path, b: Path) -> int:
    names = sorted({p.name for p in a.glob("*.ptx")} | {p.name for p in b.glob("*.ptx")})
    bad = 0
    for n in names:
        pa, pb = a / n, b / n
        same = pa.exists() and pb.exists() and pa.read_bytes() == pb.read_bytes()
        bad += not same
        print(f"{n}: {'identical' if same else 'DIFFERS' if pa.exists() and pb.exists() else 'missing on one side'}")
    print(f"{len(names) - bad} of {len(names)} identical")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", help="directory for the snapshot")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two snapshots; exit 1 on any difference")
    args = ap.parse_args()
    if args.compare:
        return _compare(Path(args.compare[0]), Path(args.compare[1]))
    if not args.out:
        ap.error("give a snapshot directory, or --compare A B")
    os.environ.setdefault("LS_KERNEL_CACHE_DIR", tempfile.mkdtemp(prefix="ls_ptx_cache_"))  # fresh compiles only
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _allreduce(out)
    _elementwise(out)
    _kda_verify(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
