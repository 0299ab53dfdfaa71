"""Turn H200 junit files into ``tests/gpu_durations.json``: the GPU tests that took at least ``--min`` seconds, so that
``tests/conftest.py`` starts them first (longest first) and an xdist run of the suite is not left waiting on a long
test that started last.

    python benchmarks/scripts/gpu_durations.py benchmarks/results/h200/session*_junit*.xml > tests/gpu_durations.json

Later files win where a test appears in several.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET


def nodeid(classname: str, name: str) -> str:
    """pytest's node id of a junit test case (``tests.ops.test_x`` + ``test_y[a]`` -> ``tests/ops/test_x.py::...``)."""
    return classname.replace(".", "/") + ".py::" + name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("junit", nargs="+")
    ap.add_argument("--min", type=float, default=8.0, help="seconds a test must have taken to be listed")
    args = ap.parse_args()
    seconds: dict[str, float] = {}
    for path in args.junit:
        for case in ET.parse(path).iter("testcase"):
            seconds[nodeid(case.get("classname", ""), case.get("name", ""))] = float(case.get("time", 0))
    long = {k: round(v, 1) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1]) if v >= args.min}
    json.dump(long, sys.stdout, indent=0)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
