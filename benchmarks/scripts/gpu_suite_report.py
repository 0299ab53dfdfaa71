"""What `h200_suite.sh` does after its pytest runs: merge the per-test records, and find the failures that were the
GPU running out of memory (workers sharing one card), so that those tests run again with fewer workers.

    python benchmarks/scripts/gpu_suite_report.py merge PEAKS_DIR OUT.json   # per-worker records -> one file + summary
    python benchmarks/scripts/gpu_suite_report.py oom JUNIT.xml... > ids.txt  # node ids failed / errored by OOM
    python benchmarks/scripts/gpu_suite_report.py records PEAKS_DIR OUT.json.gz  # the kernels compiled, merged

A record (``tests/conftest.py``, ``LS_GPU_PEAKS``) is ``{node id: {gib, s, triton_s, triton_n, triton_hits, cute_s,
cute_n}}``. An out-of-memory failure says nothing about the code under test only when the test passes alone: the
suite script reruns them and its log keeps both runs, so a report can say which passed on the rerun.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

OOM = re.compile(r"OutOfMemoryError|CUDA out of memory|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation|"
                 r"CUBLAS_STATUS_ALLOC_FAILED|out of memory", re.IGNORECASE)
"""What torch, the driver, cuBLAS and the CuTe DSL / Triton runtimes say when an allocation fails."""
ROOT = Path(__file__).resolve().parents[2]


def nodeid(classname: str, name: str, root: Path = ROOT) -> str:
    """pytest's node id of a junit case: the longest prefix of ``classname`` that is a test file, then any classes
    (``tests.ops.test_x.TestY`` + ``test_z[a]`` -> ``tests/ops/test_x.py::TestY::test_z[a]``)."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (root / path).is_file():
            return "::".join([path, *parts[cut:], name])
    return classname.replace(".", "/") + ".py::" + name


def oom_failures(junit_paths: list[Path], root: Path = ROOT) -> list[str]:
    """Node ids whose failure or error (setup / teardown included) reads as an allocation failure, in file order."""
    ids: dict[str, None] = {}
    for path in junit_paths:
        for case in ET.parse(path).iter("testcase"):
            for bad in [*case.iter("failure"), *case.iter("error")]:
                if OOM.search(bad.get("message", "") or "") or OOM.search(bad.text or ""):
                    ids[nodeid(case.get("classname", ""), case.get("name", ""), root)] = None
    return list(ids)


def merge(folder: Path) -> dict[str, dict[str, float]]:
    """Every worker's record in ``folder`` (``peaks_*.json``), largest memory first; a bare number (records before
    the compile clock) reads as ``{"gib": number}``."""
    out: dict[str, dict[str, float]] = {}
    for f in sorted(folder.glob("peaks_*.json")):
        for k, v in json.loads(f.read_text()).items():
            out[k] = v if isinstance(v, dict) else {"gib": float(v)}
    return dict(sorted(out.items(), key=lambda kv: -kv[1].get("gib", 0.0)))


def summary(records: dict[str, dict[str, float]], top: int = 8) -> str:
    """Totals (test seconds, compile seconds by kind) and the files that compiled longest / held the most memory."""
    if not records:
        return "no records"
    tot = collections.Counter()
    by_file = collections.Counter()
    for k, r in records.items():
        for f in ("s", "triton_s", "triton_n", "triton_hits", "cute_s", "cute_n"):
            tot[f] += r.get(f, 0)
        by_file[k.split("::")[0]] += r.get("triton_s", 0) + r.get("cute_s", 0)
    lines = [f"{len(records)} tests, {tot['s']:.0f} s of test time: compiling {tot['triton_s']:.0f} s Triton "
             f"({tot['triton_n']:.0f} kernels, {tot['triton_hits']:.0f} cache hits), {tot['cute_s']:.0f} s CuTe DSL "
             f"({tot['cute_n']:.0f} kernels)"]
    lines += [f"  compile {s:7.1f} s  {f}" for f, s in by_file.most_common(top)]
    lines += [f"  peak {r.get('gib', 0):6.2f} GiB  {k}" for k, r in list(records.items())[:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="merge the per-worker records of a folder into one file; print a summary")
    m.add_argument("folder", type=Path)
    m.add_argument("out", type=Path)
    t = sub.add_parser("records", help="merge the per-worker compile records (Triton, CuTe DSL) of a folder")
    t.add_argument("folder", type=Path)
    t.add_argument("out", type=Path)
    o = sub.add_parser("oom", help="print the node ids that failed or errored by running out of GPU memory")
    o.add_argument("junit", nargs="+", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "merge":
        records = merge(args.folder)
        args.out.write_text(json.dumps(records, indent=0))
        for f in args.folder.glob("peaks_*.json"):  # the device returns at most 8 files from $OUT
            f.unlink()
        print(f"records of {len(records)} GPU tests -> {args.out}")
        print(summary(records))
    elif args.cmd == "records":
        from latency_specialized.testing import compile_records

        files = sorted(args.folder.glob("compile_records_*.json"))
        merged = compile_records.merge(compile_records.load(f) for f in files)
        compile_records.save(merged, args.out)
        for f in files:
            f.unlink()
        print(f"compile records of {len(files)} workers -> {args.out}: "
              + ", ".join(f"{len(v)} {k}" for k, v in merged.items()))
    else:
        ids = oom_failures([p for p in args.junit if p.is_file()])
        sys.stdout.write("".join(f"{i}\n" for i in ids))


if __name__ == "__main__":
    main()
