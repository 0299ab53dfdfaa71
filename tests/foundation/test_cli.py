"""CLI: models, explain, and one-line errors naming the fix (exit 2, no traceback) for user mistakes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from latency_specialized.cli import main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "latency_specialized.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_models_lists_the_four_builtin_adapters(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("kimi_k3", "deepseek_v41_flash", "muse_spark", "glm53"):
        assert name in out
    assert "FAILED" not in out


def test_explain_kimi_tp8_prints_every_site_with_reasons(capsys):
    assert main(["explain", "--model", "kimi_k3", "--tp", "8", "--batch", "4", "--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan: kimi_k3 (full) on sm_90")
    for site in ("kda+moe/attn.kda", "mla+moe/attn.mla", "kda+moe/moe.experts", "kda+dense/mlp", "lm_head"):
        assert site in out
    assert "unserved: 0" in out


def test_explain_the_release_formats_names_the_kernels_that_read_them(capsys):
    """``--experts native --linears native``: GLM-5.3 as released (FP8 everywhere the checkpoint is): the block-FP8
    gemms serve the kept projections (inside the fused MLPs too),
    the FP8 experts kernel the experts; the full layers' qkv_a splits its bf16 indexer-weights tail into a bf16 gemm."""
    assert main(["explain", "--model", "glm53", "--tp", "8", "--arch", "sm_90", "--experts", "native", "--linears",
                 "native", "--no-refusals"]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines() if "/" in ln.split(" -> ")[0]}
    for site in ("mla+moe/attn.o_proj", "mla.reuse+moe/attn.qkv_a_proj"):
        assert "-> gemm.fp8_w8a16_mma" in lines[site] and "weight_format=fp8-block-128" in lines[site]
    # q_b: the plain FP8 gemm behind the q_a norm site (the Triton norm-prologue variant measured slower: NORM_MAX_M 0)
    assert "-> gemm.fp8_w8a16_mma" in lines["mla+moe/attn.q_b_proj"]
    assert "-> moe.experts.fp8_triton" in lines["mla+moe/moe.experts"]
    assert "weight_format=fp8-block-128" in lines["mla+moe/attn.qkv_a_proj"]
    assert "weight_format" not in lines["mla+moe/attn.qkv_a_proj.plain"] and "N=32" in lines["mla+moe/attn.qkv_a_proj.plain"]


def test_explain_json(capsys):
    import json

    assert main(["explain", "--model", "kimi_k3", "--tp", "16", "--batch", "64", "--arch", "sm_100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tp"] == 16 and data["bucket"] == 64 and data["in_scope"]


@pytest.mark.parametrize("args,message", [
    (["explain", "--model", "llama9"], "error: unknown model 'llama9': installed adapters are"),
    (["explain", "--model", "kimi_k3", "--tp", "5", "--arch", "sm_90"],
     "error: TP=5 not supported: kimi_k3 needs 96 KDA heads divisible by TP"),
    (["explain", "--model", "kimi_k3", "--batch", "65", "--arch", "sm_90"],
     "error: kimi_k3: outside the latency_specialized scope: batch 65 beyond the scope (use 1..64; "
     "larger batches run stock)"),
    (["explain", "--model", "kimi_k3", "--arch", "sm_42"], "error: unknown arch 'sm_42': use one of cpu, sm_80"),
    (["explain", "--model", "kimi_k3", "--arch", "sm_90", "--linears", "native"],
     "error: kimi_k3 keeps its dense projections in the activation dtype only: drop --linears"),
])
def test_user_errors_are_one_line_and_name_the_fix(args, message):
    out = _run(*args)
    assert out.returncode == 2
    assert out.stderr.startswith(message), out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_argparse_errors_exit_nonzero():
    out = _run("explain")
    assert out.returncode == 2 and "--model" in out.stderr


# ------------------------------------------------------------------ issue 19: one line, exit 2, names the fix
def _error_line(capsys, args: list[str]) -> str:
    """Run the CLI in-process; assert exit 2 with exactly one stderr line, and return it."""
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck") / "kimi_tiny"
    assert main(["make-checkpoint", "kimi_k3", str(d)]) == 0
    return d


@pytest.mark.parametrize("indexed", [False, True], ids=["listing", "index.json"])
def test_truncated_safetensors_names_the_file(capsys, tmp_path, tiny_checkpoint, indexed):
    import json
    import shutil

    from safetensors import safe_open

    d = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, d)
    st = d / "model.safetensors"
    if indexed:  # the tensor files are then opened only when a tensor is read
        with safe_open(str(st), framework="pt") as h:
            (d / "model.safetensors.index.json").write_text(
                json.dumps({"weight_map": {k: st.name for k in h.keys()}}))
    with st.open("r+b") as f:
        f.truncate(st.stat().st_size // 2)
    line = _error_line(capsys, ["generate", "--model", "kimi_k3", "--checkpoint", str(d), "--prompt-ids", "1,2",
                                "--max-tokens", "1", "--device", "cpu"])
    assert line.startswith(f"error: {st}: not a readable safetensors file (")
    assert line.endswith("the file is truncated or corrupt; download or write it again")


@pytest.mark.parametrize("extra,message", [
    (["--prompt-ids", ""], "error: --prompt-ids '' holds no token id: give comma-separated integers, e.g. 1,2,3"),
    (["--prompt-ids", " , "], "error: --prompt-ids ' , ' holds no token id: give comma-separated integers"),
    (["--prompt-ids", "1,x"], "error: --prompt-ids '1,x': use comma-separated integers, e.g. 1,2,3"),
    (["--prompt-ids", "1", "--device", "tpu"],
     "error: --device 'tpu' is not supported: use --device auto, cpu or cuda[:N]"),
    (["--prompt-ids", "1", "--device", "meta"],
     "error: --device 'meta' is not supported: use --device auto, cpu or cuda[:N]"),
    (["--prompt-ids", "1", "--max-tokens", "0"], "error: --max-tokens 0: use --max-tokens >= 1 (tokens generated"),
    (["--prompt-ids", "1", "--batch", "0"], "error: --batch 0: use --batch >= 1 (sequences decoded together)"),
])
def test_generate_flag_errors_name_the_flag(capsys, extra, message):
    assert _error_line(capsys, ["generate", "--model", "kimi_k3", *extra]).startswith(message)


def test_generate_cuda_device_without_a_gpu(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = _error_line(capsys, ["generate", "--model", "kimi_k3", "--prompt-ids", "1", "--device", "cuda:0"])
    assert line == "error: --device cuda:0 but torch sees no CUDA device: use --device cpu"


def test_make_checkpoint_onto_a_file(capsys, tmp_path):
    f = tmp_path / "taken"
    f.write_text("keep me")
    line = _error_line(capsys, ["make-checkpoint", "kimi_k3", str(f)])
    assert line == (f"error: {f} is a file: give make-checkpoint a directory (it writes config.json, "
                    "model.safetensors and the tokenizer into it)")
    assert f.read_text() == "keep me"


def test_make_checkpoint_below_a_file(capsys, tmp_path):
    f = tmp_path / "taken"
    f.write_text("")
    line = _error_line(capsys, ["make-checkpoint", "kimi_k3", str(f / "sub")])
    assert line == f"error: cannot create {f / 'sub'}: Not a directory: give make-checkpoint a writable directory"


def test_make_checkpoint_into_a_read_only_directory(capsys, tmp_path, monkeypatch):
    # root writes into a chmod 0500 directory (CI runs as root), so the access check is what is faked:
    # the command must ask the OS whether it may write and refuse with one line when it may not
    import os

    d = tmp_path / "ro"
    d.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(d) else real(p, mode, **kw))
    line = _error_line(capsys, ["make-checkpoint", "kimi_k3", str(d)])
    assert line == f"error: cannot write into {d}: permission denied: give make-checkpoint a writable directory"
    assert list(d.iterdir()) == []


def test_make_checkpoint_onto_a_read_only_mount(capsys, tmp_path, monkeypatch):
    # a write that fails with EROFS (a read-only mount) mid-way is one line too, not a traceback
    import errno

    from latency_specialized.plugins import get_registry

    adapter = get_registry().adapter("kimi_k3")

    def fail(*a, **kw):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(type(adapter), "write_checkpoint", fail)
    line = _error_line(capsys, ["make-checkpoint", "kimi_k3", str(tmp_path / "out")])
    assert line == (f"error: cannot write the checkpoint into {tmp_path / 'out'}: Read-only file system: "
                    "give make-checkpoint a writable directory")


_SCOPE = "error: kimi_k3: outside the latency_specialized scope: "


@pytest.mark.parametrize("extra,reason,plan_printed", [
    (["--arch", "sm_80"], "arch sm_80 not supported (use one of cpu, sm_90, sm_100, sm_103)", True),
    (["--dtype", "float16"], "dtype float16 not supported (use bfloat16, float32)", True),
    (["--spec-tokens", "2"], "2 speculative tokens not supported (use one of [0, 3, 7])", True),
    (["--batch", "65"], "batch 65 beyond the scope (use 1..64; larger batches run stock)", False),
])
def test_explain_out_of_scope_exits_2_for_every_cause(capsys, extra, reason, plan_printed):
    rc = main(["explain", "--model", "kimi_k3", "--tp", "8", "--arch", "sm_90", *extra])
    out, err = capsys.readouterr()
    assert rc == 2, err
    assert err.strip().splitlines() == [_SCOPE + reason]
    if plan_printed:  # what would run anyway, with the same reason
        assert out.startswith("plan: kimi_k3 (full) on ")
        assert f"OUT OF SCOPE (stock path would run): {reason}" in out
    else:  # no graph bucket holds the batch: no plan
        assert out == ""


def test_explain_out_of_scope_lists_every_reason(capsys):
    line = _error_line(capsys, ["explain", "--model", "kimi_k3", "--tp", "8", "--arch", "sm_90", "--batch", "65",
                                "--dtype", "float16", "--spec-tokens", "1"])
    assert line == (_SCOPE + "batch 65 beyond the scope (use 1..64; larger batches run stock); "
                    "dtype float16 not supported (use bfloat16, float32); "
                    "1 speculative tokens not supported (use one of [0, 3, 7])")


def test_explain_out_of_scope_json_still_prints_the_plan(capsys):
    import json

    rc = main(["explain", "--model", "kimi_k3", "--tp", "8", "--arch", "sm_90", "--dtype", "float16", "--json"])
    out, err = capsys.readouterr()
    assert rc == 2 and err.startswith(_SCOPE + "dtype float16")
    data = json.loads(out)
    assert not data["in_scope"] and data["scope_problems"] == ["dtype float16 not supported (use bfloat16, float32)"]


@pytest.mark.parametrize("extra", [[], ["--ab", "base"]], ids=["sweep", "ab"])
def test_bench_context_without_mla_is_an_error(capsys, extra):
    line = _error_line(capsys, ["bench", "--kinds", "kda", "--context", "4096", *extra])
    assert line == ("error: --context 4096 sets the MLA cells' context but --kinds kda has no mla: add it "
                    "(--kinds kda,mla) or drop --context")


def test_bench_context_with_mla_passes_and_no_gpu_names_a_cuda_gpu(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = _error_line(capsys, ["bench", "--kinds", "kda,mla", "--context", "4096"])
    assert line == ("error: bench needs a CUDA GPU and torch sees none: run it where one is visible "
                    "(bench --compare A.json B.json needs no GPU)")
    line = _error_line(capsys, ["bench-ops", "--ops", "norm"])
    assert line == ("error: bench-ops needs a CUDA GPU and torch sees none: run it where one is visible "
                    "(bench-ops --list and --compile-records need no GPU)")


def test_bench_ops_writes_its_compile_records_without_a_gpu(tmp_path, capsys, monkeypatch):
    """The gemm cases' CuTe DSL kernels as compile records (one per timed config), units again on reading back."""
    import torch

    from latency_specialized.bench.ops_bench_gemm_norm import gemm_variant_configs
    from latency_specialized.testing import compile_records, cute_units

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "r.json.gz"
    assert main(["bench-ops", "--ops", "gemm", "--model", "kimi_k3", "--tp", "8", "--m", "1,4", "--shapes",
                 "7168:1536", "--compile-records", str(out)]) == 0
    recs = compile_records.load(out)
    # one record per distinct kernel: a GEMV compiles per M, the mma kernels serve every M with one compile
    distinct = {(impl, cfg, m if impl == "gemm.cutedsl_gemv" else None)
                for m in (1, 4) for impl, cfg in gemm_variant_configs(7168, 1536, m)}
    assert recs["triton"] == [] and len(recs["cute"]) == len(distinct)
    units, stale = cute_units.units(recs["cute"])
    assert not stale and {fn.__name__ for fn, _ in units} == {"compile_gemv", "compile_mma"}
    assert "CuTe DSL compile records of gemm (kimi_k3, TP 8, M 1,4)" in capsys.readouterr().out


@pytest.mark.parametrize("extra,context", [([], None), (["--kinds", "mla", "--context", "512"], "512")])
def test_bench_ab_passes_context_only_when_given(capsys, monkeypatch, tmp_path, extra, context):
    from latency_specialized.bench import ab

    seen = {}

    def fake_run_ab(variants, argv, out_dir, **kw):
        seen["argv"] = list(argv)
        return {}

    monkeypatch.setattr(ab, "run_ab", fake_run_ab)
    monkeypatch.setattr(ab, "summarize", lambda variants, results: "summary")
    assert main(["bench", "--ab", "base", "--out", str(tmp_path), *extra]) == 0
    argv = seen["argv"]
    if context is None:  # a child given --context without mla would refuse it
        assert "--context" not in argv
    else:
        assert argv[argv.index("--context") + 1] == context


def test_bench_ab_passes_spec_tokens_and_routing(monkeypatch, tmp_path):
    """--ab with --spec-tokens / --routing: every variant's child bench gets them (verification cells are keyed
    by k in the summary); without them the children get neither flag."""
    from latency_specialized.bench import ab

    seen = []
    monkeypatch.setattr(ab, "run_ab", lambda variants, argv, out_dir, **kw: seen.append(list(argv)) or {})
    monkeypatch.setattr(ab, "summarize", lambda variants, results: "summary")
    assert main(["bench", "--ab", "base", "--ab", "cute:latency_specialized.kernels.moe_experts_triton.MIN_TOKENS=16",
                 "--spec-tokens", "0,7", "--routing", "shared", "--out", str(tmp_path)]) == 0
    assert main(["bench", "--ab", "base", "--out", str(tmp_path)]) == 0
    with_k, plain = seen
    assert with_k[with_k.index("--spec-tokens") + 1] == "0,7" and with_k[with_k.index("--routing") + 1] == "shared"
    assert "--spec-tokens" not in plain and "--routing" not in plain
