"""Several MLA decode kernel configurations in one process (H200 sweeps): each config is a list of
``bench_mla.py`` flags, run after the kernel module's tuning constants are put back to their defaults, its
results under ``OUT/mla_decode<tag>.{json,md}``::

    python benchmarks/scripts/mla_sweep.py --out $OUT --contexts 131072 --batches 1,2,4 \\
        --config base: --config s3:--stages=3 --config w4m512:--waves=4,--max-splits=512

A config is ``TAG:FLAG=VALUE,...`` (flags of bench_mla.py; empty after the colon: the defaults)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_mla  # noqa: E402  (a sibling script)

from latency_specialized.kernels import mla_decode_triton as mk  # noqa: E402



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", default="131072")
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--config", action="append", required=True, help="TAG:FLAG=VALUE,... (repeatable)")
    a, rest = ap.parse_known_args()
    # every tuning constant (upper-case int / bool) as imported: a config starts from these
    defaults = {c: v for c, v in vars(mk).items() if c.isupper() and isinstance(v, (int, bool))}
    rc = 0
    for cfg in a.config:
        tag, _, flags = cfg.partition(":")
        for c, v in defaults.items():
            setattr(mk, c, v)
        argv = ["--out", a.out, "--contexts", a.contexts, "--batches", a.batches, "--no-paged", "--skip-unfused",
                "--tag", f"_{tag}", *rest, *[f for f in flags.split(",") if f]]
        print(f"=== config {tag}: {' '.join(argv)}", flush=True)
        try:
            rc |= bench_mla.main(argv)
        except Exception as e:  # one bad config (e.g. out of shared memory) must not end the sweep
            print(f"config {tag} failed: {type(e).__name__}: {e}", flush=True)
            rc = 1
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
