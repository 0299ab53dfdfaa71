"""Kimi K3 program vs reference on the H200 (``long_check.py`` with ``--model kimi_k3`` and the JSON named
``kimi_long_check.json``; every option of ``long_check.py`` applies: ``--dtypes bf16,fp32``, ``--floor-steps``,
``--state-every``, ``--repeat-batches`` ...).

    python benchmarks/scripts/kimi_long_check.py --steps 256 --batches 1,8,64 --out $OUT/kimi_long_check.json
    python benchmarks/scripts/kimi_long_check.py --dtypes bf16,fp32 --runs 1:4000:0,8:4000:0 --floor-steps 500 \\
        --repeat-batches 1,8,64 --repeat-steps 1000 --out $OUT/kimi_long_check_4k.json
"""

import sys

from long_check import main  # this script's folder is on sys.path when it runs

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], model="kimi_k3", out="kimi_long_check.json"))
