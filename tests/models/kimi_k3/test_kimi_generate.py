"""`latency-specialized generate` / `make-checkpoint` end to end (in-process main() and the exact demo)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from latency_specialized.cli import main

REPO = Path(__file__).resolve().parents[3]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _ids(out: str) -> list[str]:
    return re.findall(r"^\[\d+\] ids: (.*)$", out, flags=re.M)


def _demo_argv() -> list[str]:
    """The arguments `make demo` passes to the console script, read from the Makefile itself."""
    text = (REPO / "Makefile").read_text()
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", text, flags=re.M).group(1)
    words = shlex.split(recipe.replace("\\\n", " "))
    return words[words.index("generate"):]


def _run_demo() -> tuple[str, float]:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "latency_specialized.cli", *_demo_argv()], capture_output=True,
                          text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, time.perf_counter() - t


def test_demo_command_runs_under_a_minute():
    """Exactly what `make demo` runs (on the CPU: the tiny model, eagerly), as a subprocess."""
    out, wall = _run_demo()
    assert "decode: 23 steps through the program (eager: CUDA graphs need a GPU)" in out
    assert "[tiny, random weights seed 0] on cpu" in out
    assert re.search(r"trace: 23 fast steps, 2 stock steps", out)
    assert "stock x2: prefill runs the reference path (stock)" in out
    assert "attention.kda.reference" in out and "residual.attnres.reference" in out
    assert len(_ids(out)) == 2 and all(len(x.split(",")) == 24 for x in _ids(out))
    assert wall < 60, f"demo took {wall:.1f} s"


@pytest.mark.gpu
def test_demo_on_a_gpu_replays_every_decode_step_from_a_cuda_graph(capsys):
    """`make demo` on a GPU: the medium model, every site on a kernel, one graph per step - and the
    same tokens as the same program run eagerly (--graphs off)."""
    out, _ = _run_demo()
    assert "[medium, random weights seed 0] on cuda" in out
    assert "decode: 23 steps through the program (one CUDA graph per step" in out
    assert re.search(r"trace: 23 fast steps, 2 stock steps, 1 graph captures", out)
    # every site the program calls is on a kernel; the sites it skips at this bucket (Plan.skipped_sites:
    # at batch 2 the fused router+latent site, whose kernel serves batch 1 only) are counted apart
    m = re.search(r"plan: (\d+) sites on \S+ \| fast (\d+) \| reference 0 \| unserved 0 \| not called (\d+)", out)
    assert m and int(m.group(2)) + int(m.group(3)) == int(m.group(1)), out[-600:]
    assert len(_ids(out)) == 2 and all(len(x.split(",")) == 24 for x in _ids(out))
    rc, eager, _ = _run(capsys, *_demo_argv(), "--graphs", "off")
    assert rc == 0 and "(eager: --graphs off)" in eager
    assert _ids(eager) == _ids(out)


def test_graphs_and_size_choices(capsys):
    rc, _, err = _run(capsys, "generate", "--model", "kimi_k3", "--device", "cpu", "--graphs", "on", "--prompt", "hi")
    assert rc == 2 and "--graphs off" in err
    rc, out, _ = _run(capsys, "generate", "--model", "kimi_k3", "--device", "cpu", "--size", "medium",
                      "--prompt-ids", "1,2,3", "--max-tokens", "2")
    assert rc == 0 and "[medium, random weights seed 0] on cpu" in out and "4 layers, vocab 2048" in out


def test_generate_batch_with_padding_and_prompts(capsys):
    rc, out, _ = _run(capsys, "generate", "--model", "kimi_k3", "--size", "tiny", "--batch", "3", "--max-tokens", "4",
                      "--prompt", "Hello world", "--prompt", "Once upon a time there was a kernel", "--dtype", "float32")
    assert rc == 0
    assert "bucket 4" in out                      # batch 3 runs padded to the graph bucket 4
    ids = _ids(out)
    assert len(ids) == 3 and ids[0] == ids[2]     # prompts cycle: sequences 0 and 2 share a prompt (greedy)
    assert "program: 3 steps" in out


def test_sampling_is_seeded(capsys):
    args = ["generate", "--model", "kimi_k3", "--prompt-ids", "1,40,41,42", "--max-tokens", "6", "--temperature", "1.0"]
    a = _ids(_run(capsys, *args, "--seed", "3")[1])
    b = _ids(_run(capsys, *args, "--seed", "3")[1])
    c = _ids(_run(capsys, *args, "--seed", "4")[1])
    assert a == b and a != c


def test_checkpoint_generates_like_in_memory_weights(tmp_path, capsys):
    d = tmp_path / "tiny"
    rc, out, _ = _run(capsys, "make-checkpoint", "kimi_k3", str(d), "--seed", "0")
    assert rc == 0 and "config.json, model.safetensors, tokenizer.json, tokenizer_config.json" in out
    args = ["--prompt", "The quick brown fox", "--max-tokens", "6", "--batch", "2"]
    rc1, from_ck, _ = _run(capsys, "generate", "--model", "kimi_k3", "--checkpoint", str(d), *args)
    rc2, in_mem, _ = _run(capsys, "generate", "--model", "kimi_k3", "--size", "tiny", "--seed", "0", *args)
    assert rc1 == rc2 == 0
    assert _ids(from_ck) == _ids(in_mem)


def test_user_errors_exit_2_with_the_fix(tmp_path, capsys):
    rc, _, err = _run(capsys, "generate", "--model", "kimi_k3", "--size", "full", "--prompt", "hi")
    assert rc == 2 and "--checkpoint" in err
    rc, _, err = _run(capsys, "generate", "--model", "kimi_k3", "--checkpoint", str(tmp_path), "--prompt", "hi")
    assert rc == 2 and "config.json" in err
    rc, _, err = _run(capsys, "generate", "--model", "kimi_k3", "--prompt-ids", "1,x")
    assert rc == 2 and "comma-separated" in err
    rc, _, err = _run(capsys, "generate", "--model", "kimi_k3", "--prompt-ids", "1,99999")
    assert rc == 2 and "outside the vocabulary" in err
    d = tmp_path / "notok"
    assert _run(capsys, "make-checkpoint", "kimi_k3", str(d))[0] == 0
    (d / "tokenizer.json").unlink()
    rc, _, err = _run(capsys, "generate", "--model", "kimi_k3", "--checkpoint", str(d), "--prompt", "hi")
    assert rc == 2 and "--prompt-ids" in err
    rc, out, _ = _run(capsys, "generate", "--model", "kimi_k3", "--checkpoint", str(d), "--prompt-ids", "1,2,3",
                      "--max-tokens", "2")
    assert rc == 0 and len(_ids(out)) == 1


def test_graphs_auto_names_the_sites_that_keep_a_step_eager():
    """--graphs auto on a GPU captures only when no site runs a (host-syncing) torch reference."""
    from types import SimpleNamespace as NS

    import torch

    from latency_specialized.commands.generate import _decide_graphs
    from latency_specialized.errors import UserError

    def plan(*refs: bool, skipped: tuple[str, ...] = ()):
        choices = [NS(site=NS(name=f"l/site{i}"), impl=NS(is_reference=r)) for i, r in enumerate(refs)]
        return NS(choices=choices, called_choices=lambda: [c for c in choices if c.site.name not in skipped])

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert _decide_graphs("auto", gpu, plan(False, False)) == (True, "")
    use, why = _decide_graphs("auto", gpu, plan(False, True))
    assert not use and "l/site1" in why and "--graphs on" in why
    # a reference bound to a site the program does not call at this bucket does not block the capture
    assert _decide_graphs("auto", gpu, plan(False, True, skipped=("l/site1",))) == (True, "")
    assert _decide_graphs("on", gpu, plan(True)) == (True, "")      # tries anyway; a failed capture raises
    assert _decide_graphs("off", gpu, plan()) == (False, "--graphs off")
    assert _decide_graphs("auto", cpu, plan()) == (False, "CUDA graphs need a GPU")
    with pytest.raises(UserError, match="--graphs off"):
        _decide_graphs("on", cpu, plan())
