"""Checks shared by the adapters' kept-experts tests (routed experts in a stored format: ``adapter.keep_experts``)."""

from __future__ import annotations

import re
from typing import Any

from latency_specialized import hardware, quant
from latency_specialized.adapter_contract import SpecBoundAdapter
from latency_specialized.cli import main
from latency_specialized.ops.plan import build_plan
from latency_specialized.plugins import get_registry


def ids(out: str) -> list[str]:
    """The generated token ids ``generate`` printed, one entry per sequence."""
    return re.findall(r"^\[\d+\] ids: (.*)$", out, flags=re.M)


def site_format(fmt: str) -> str:
    """The ``moe.experts`` sites' ``weight_format`` for experts stored as ``fmt``: e2m1 formats in the paired layout
    under ``pieces.ffn.latent_moe.PAIR_EXPERT_CODES``, the others as stored."""
    from latency_specialized.pieces.ffn import latent_moe
    from latency_specialized.quant.formats import PAIRED_SUFFIX, QuantFormat

    paired = latent_moe.PAIR_EXPERT_CODES and QuantFormat.get(fmt).element == "e2m1"
    return fmt + PAIRED_SUFFIX if paired else fmt


def assert_program_binds_kept_experts(adapter: Any, ref: Any, fmt: str) -> None:
    """A CPU plan of ``ref.spec`` puts ``weight_format`` on every ``moe.experts`` site (:func:`site_format`), and the
    program built from ``ref`` binds its MoE layers' experts as ``QuantizedWeight`` of that format (not the
    reference's dequantised copy)."""
    plan = build_plan(SpecBoundAdapter(adapter, ref.spec), get_registry().implementations, hardware.for_arch("cpu"),
                      tp=1, batch=1, dtype="float32", variant="tiny")
    sites = [c.site for c in plan.choices if c.site.name.endswith("moe.experts")]
    want = site_format(fmt)
    assert sites and all(s.ctx.attr("weight_format") == want for s in sites)
    program = adapter.program(ref.spec, plans=plan, cache=ref.new_cache(1, 16), reference=ref)
    ffn = [w["ffn"] for w in program.w_layers if "w13" in w.get("ffn", {})]
    assert ffn and all(isinstance(f["w13"], quant.QuantizedWeight) and isinstance(f["w2"], quant.QuantizedWeight)
                       and f["w13"].fmt.name == f["w2"].fmt.name == want for f in ffn)


def generate_in_one_graph(argv: list[str], want: str, capsys: Any) -> str:
    """GPU: ``generate`` with ``argv`` (``--show-plan`` included) serves the experts by ``want`` with every decode
    step from one CUDA graph, and gives the same tokens eagerly (``--graphs off``); returns the graphed output."""
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert want in out and "one CUDA graph per step" in out
    assert main([*argv, "--graphs", "off"]) == 0
    assert ids(capsys.readouterr().out) == ids(out)
    return out
