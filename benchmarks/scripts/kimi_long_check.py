"""256-step teacher-forced Kimi K3 program vs reference on the H200 at batch 1, 8, 64 (bf16): ``long_check.py``
with ``--model kimi_k3`` and the JSON named ``kimi_long_check.json`` (every option of ``long_check.py`` applies).

    python benchmarks/scripts/kimi_long_check.py --steps 256 --batches 1,8,64 --out $OUT/kimi_long_check.json
"""

import sys

from long_check import main  # this script's folder is on sys.path when it runs

if __name__ == "__main__":
    main(sys.argv[1:], model="kimi_k3", out="kimi_long_check.json")
