"""``vllm.LLM(additional_config=...)`` in a subprocess, for tests: generate once, write the token ids.

Usage: ``python llm_script.py <model dir> <additional_config JSON> <out.json>``. The engine is built in
``__main__`` only (vLLM's CPU workers may re-import this file).
"""

from __future__ import annotations

import json
import sys


def main(model: str, additional_config: str, out: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", max_model_len=512, max_num_seqs=8, enforce_eager=True,
              kv_cache_memory_bytes=64 * 2**20, seed=0, additional_config=json.loads(additional_config))
    result = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    with open(out, "w") as f:
        json.dump({"token_ids": list(result[0].outputs[0].token_ids)}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
