"""`latency-specialized generate --model qwen3_moe`: random tiny weights and a make-checkpoint directory, decoded
through the composed program; in fp32 its greedy tokens are the plain-torch reference's greedy tokens."""

from __future__ import annotations

import re

import pytest
import torch

from latency_specialized.cli import main

from latency_specialized_models.qwen3_moe.composed import random_weights
from latency_specialized_models.qwen3_moe.spec import variant_spec

from tests.models.qwen3_moe.helpers import adapter


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _ids(out: str) -> list[list[int]]:
    return [[int(x) for x in m.split(", ")] for m in re.findall(r"^\[\d+\] ids: \[(.*)\]$", out, flags=re.M)]


def _greedy(prompt: list[int], n: int, seed: int) -> list[int]:
    """The reference's own greedy continuation (whole sequence re-run every token; no program, no cache reuse)."""
    spec = variant_spec("tiny")
    ref = adapter().reference(spec, weights=random_weights(spec, seed, torch.float32))
    ids, out = list(prompt), []
    for _ in range(n):
        cache = ref.new_cache(1, len(ids))
        out.append(int(ref.prefill(cache, cache.slots[0], 0, ids)[-1].argmax()))
        ids.append(out[-1])
    return out


def test_generate_tiny_default_dtype(capsys):
    rc, out, _ = _run(capsys, "generate", "--model", "qwen3_moe", "--size", "tiny", "--prompt-ids", "1,2,3",
                      "--max-tokens", "8", "--device", "cpu", "--show-trace")
    assert rc == 0
    assert "qwen3_moe [tiny, random weights seed 0] on cpu (bfloat16), batch 1, 3 layers, vocab 128" in out
    assert "decode: 7 steps through the program (eager: CUDA graphs need a GPU)" in out
    assert re.search(r"trace: 7 fast steps, 1 stock steps", out)
    assert "program: 7 steps" in out and "moe.experts.reference" in out
    assert [len(x) for x in _ids(out)] == [8]


def test_generate_fp32_follows_the_reference(capsys):
    rc, out, _ = _run(capsys, "generate", "--model", "qwen3_moe", "--size", "tiny", "--prompt-ids", "5,9,77,3",
                      "--max-tokens", "10", "--batch", "2", "--dtype", "float32", "--seed", "3", "--device", "cpu")
    assert rc == 0
    assert _ids(out) == [_greedy([5, 9, 77, 3], 10, 3)] * 2


def test_generate_from_a_checkpoint_directory(capsys, tmp_path):
    assert main(["make-checkpoint", "qwen3_moe", str(tmp_path), "--seed", "3", "--dtype", "float32"]) == 0
    capsys.readouterr()
    rc, out, _ = _run(capsys, "generate", "--model", "qwen3_moe", "--checkpoint", str(tmp_path), "--prompt-ids",
                      "5,9,77,3", "--max-tokens", "10", "--dtype", "float32", "--device", "cpu")
    assert rc == 0 and f"qwen3_moe [checkpoint {tmp_path}] on cpu (float32)" in out
    assert _ids(out) == [_greedy([5, 9, 77, 3], 10, 3)]
    rc, _, err = _run(capsys, "generate", "--model", "qwen3_moe", "--checkpoint", str(tmp_path), "--prompt", "hi",
                      "--device", "cpu")
    assert rc == 2 and "has no tokenizer.json: pass --prompt-ids" in err


def test_a_checkpoint_tokenizer_is_used(capsys, tmp_path):
    """A tokenizer.json next to the weights (as every published checkpoint has) serves --prompt."""
    tokenizers = pytest.importorskip("tokenizers")
    assert main(["make-checkpoint", "qwen3_moe", str(tmp_path), "--seed", "3", "--dtype", "float32"]) == 0
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "hello": 5, "world": 9}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    capsys.readouterr()
    rc, out, _ = _run(capsys, "generate", "--model", "qwen3_moe", "--checkpoint", str(tmp_path), "--prompt",
                      "hello world", "--max-tokens", "4", "--dtype", "float32", "--device", "cpu")
    assert rc == 0 and "prompt 0: 'hello world' -> 2 tokens [5, 9]" in out
    assert _ids(out) == [_greedy([5, 9], 4, 3)] and "[0] text: " in out


def test_full_size_needs_a_checkpoint(capsys):
    rc, _, err = _run(capsys, "generate", "--model", "qwen3_moe", "--size", "full", "--prompt-ids", "1",
                      "--device", "cpu")
    assert rc == 2 and "pass --checkpoint DIR" in err


@pytest.mark.gpu
def test_generate_on_a_gpu_replays_cuda_graphs(capsys):
    """On a GPU the default size is medium, every site runs a kernel, each step replays one CUDA graph - and the
    tokens equal the same program run eagerly."""
    argv = ("generate", "--model", "qwen3_moe", "--prompt-ids", "1,2,3", "--max-tokens", "12", "--batch", "2")
    rc, out, _ = _run(capsys, *argv)
    assert rc == 0 and "[medium, random weights seed 0] on cuda" in out
    assert "decode: 11 steps through the program (one CUDA graph per step" in out
    assert re.search(r"plan: \d+ sites on sm_90 \| fast \d+ \| reference 0 \| unserved 0", out), out[-600:]
    rc, eager, _ = _run(capsys, *argv, "--graphs", "off")
    assert rc == 0 and _ids(eager) == _ids(out)
