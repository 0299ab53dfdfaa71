"""Pack compiled-kernel caches into one archive a device call can carry, and unpack it there (standard library only:
it runs before the device's environment is set up).

    python benchmarks/scripts/compile_cache_pack.py pack OUT.tar.xz --triton DIR --cute DIR [--budget-mib 15]
    python benchmarks/scripts/compile_cache_pack.py unpack ARCHIVE --triton DIR --cute ROOT

Triton: of each cache entry only what a cache hit loads - the group file (``__grp__*.json``), the metadata JSON and
the cubin; the intermediate IRs and PTX stay behind, and so do launcher stubs (host code built for this machine's
libraries: the device builds its own). The group file names its members by absolute path, so ``unpack`` rewrites
them to where they land. CuTe DSL: the object files of one fingerprint directory of ``$LS_KERNEL_CACHE_DIR``
(``kernels.compile_cache``), kept under that name - on a machine whose fingerprint differs they are never read.
``--budget-mib`` bounds the archive (the first device call carries the CuTe DSL part A, ~33 MiB, beside the tree):
CuTe DSL objects go first (a few tens of KB each, seconds to compile), then Triton entries until the budget is met;
what did not fit is counted, and with ``--rest FILE`` archived there for a later call (unpacked the same way).
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import sys
import tarfile
from pathlib import Path

KEEP = (".json", ".cubin")


def triton_entries(cache: Path) -> list[list[Path]]:
    """Per cache entry (a directory with a group file), the files a cache hit reads."""
    out = []
    for grp in sorted(cache.glob("*/__grp__*.json")):
        members = [Path(p) for p in json.loads(grp.read_text()).get("child_paths", {}).values()]
        files = [grp] + [grp.parent / m.name for m in members if m.suffix in KEEP and (grp.parent / m.name).exists()]
        if any(f.suffix == ".cubin" for f in files):
            out.append(files)
    return out


def pack(out: Path, triton: Path | None, cute: Path | None, budget: int, rest: Path | None = None) -> str:
    """Archive CuTe DSL objects, then Triton entries, into ``out`` up to ``budget`` bytes: all of them where they
    fit, else the longest prefix that does (found by compressing, since entries compress far better together than
    alone). ``rest``: a second archive of what did not fit (for the next call, which has room of its own)."""
    groups: list[tuple[str, list[tuple[Path, str]]]] = []
    if cute is not None and cute.is_dir():
        groups += [("cute", [(o, f"cute/{cute.name}/{o.name}")]) for o in sorted(cute.glob("*.o"))]
    if triton is not None and triton.is_dir():
        groups += [("triton", [(f, f"triton/{f.parent.name}/{f.name}") for f in files])
                   for files in triton_entries(triton)]

    def archive(chosen: list[tuple[str, list[tuple[Path, str]]]]) -> bytes:
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w") as tar:
            for _, files in chosen:
                for path, name in files:
                    tar.add(path, arcname=name)
        return lzma.compress(raw.getvalue(), preset=6)

    n, data = len(groups), archive(groups)
    while len(data) > budget and n > 0:
        # shrink the prefix in proportion to the overshoot (a little more, so one or two rounds usually do)
        n = min(n - 1, int(n * budget / len(data) * 0.97))
        data = archive(groups[:n])
    out.write_bytes(data)

    def count(chosen: list[tuple[str, list[tuple[Path, str]]]]) -> dict[str, int]:
        return {k: sum(kind == k for kind, _ in chosen) for k in ("cute", "triton")}

    taken, left = count(groups[:n]), count(groups[n:])
    report = (f"{out}: {len(data) / 2**20:.1f} MiB, CuTe DSL objects {taken['cute']} (+{left['cute']} over budget), "
              f"Triton entries {taken['triton']} (+{left['triton']} over budget)")
    if rest is not None:
        rest_data = archive(groups[n:])
        rest.write_bytes(rest_data)
        report += f"; the rest -> {rest}: {len(rest_data) / 2**20:.1f} MiB"
    return report


def unpack(archive: Path, triton: Path, cute: Path) -> str:
    n = {"cute": 0, "triton": 0}
    with tarfile.open(archive, mode="r:xz") as tar:
        for member in tar.getmembers():
            kind, rest = member.name.split("/", 1)
            if not member.isfile() or kind not in n or ".." in Path(rest).parts:
                continue
            dest = (triton if kind == "triton" else cute) / rest
            dest.parent.mkdir(parents=True, exist_ok=True)
            data = tar.extractfile(member).read()
            if kind == "triton" and dest.name.startswith("__grp__"):
                grp = json.loads(data)
                grp["child_paths"] = {k: str(dest.parent / Path(p).name) for k, p in grp["child_paths"].items()
                                      if Path(p).suffix in KEEP}
                data = json.dumps(grp).encode()
            dest.write_bytes(data)
            n[kind] += dest.name.startswith("__grp__") if kind == "triton" else 1
    return f"{archive}: {n['cute']} CuTe DSL objects -> {cute}, {n['triton']} Triton entries -> {triton}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("out", type=Path)
    p.add_argument("--triton", type=Path, help="Triton cache directory")
    p.add_argument("--cute", type=Path, help="one fingerprint directory of the CuTe DSL disk cache")
    p.add_argument("--budget-mib", type=float, default=15.0)
    p.add_argument("--rest", type=Path, help="a second archive of what the budget left out")
    u = sub.add_parser("unpack")
    u.add_argument("archive", type=Path)
    u.add_argument("--triton", type=Path, required=True, help="the Triton cache directory to fill")
    u.add_argument("--cute", type=Path, required=True, help="the CuTe DSL disk cache's root ($LS_KERNEL_CACHE_DIR)")
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        print(pack(args.out, args.triton, args.cute, int(args.budget_mib * 2**20), args.rest))
    else:
        print(unpack(args.archive, args.triton.expanduser(), args.cute))
    return 0


if __name__ == "__main__":
    sys.exit(main())
