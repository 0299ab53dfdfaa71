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


def assert_program_binds_kept_experts(adapter: Any, ref: Any, fmt: str) -> None:
    """A CPU plan of ``ref.spec`` puts ``weight_format`` on every ``moe.experts`` site, and the program built from
    ``ref`` binds its MoE layers' experts as ``QuantizedWeight`` of ``fmt`` (not the reference's dequantised copy)."""
    plan = build_plan(SpecBoundAdapter(adapter, ref.spec), get_registry().implementations, hardware.for_arch("cpu"),
                      tp=1, batch=1, dtype="float32", variant="tiny")
    sites = [c.site for c in plan.choices if c.site.name.endswith("moe.experts")]
    assert sites and all(s.ctx.attr("weight_format") == fmt for s in sites)
    program = adapter.program(ref.spec, plans=plan, cache=ref.new_cache(1, 16), reference=ref)
    ffn = [w["ffn"] for w in program.w_layers if "w13" in w.get("ffn", {})]
    assert ffn and all(isinstance(f["w13"], quant.QuantizedWeight) and isinstance(f["w2"], quant.QuantizedWeight)
                       and f["w13"].fmt.name.split("/")[0] == fmt for f in ffn)


def generate_in_one_graph(argv: list[str], want: str, capsys: Any) -> str:
    """GPU: ``generate`` with ``argv`` (``--show-plan`` included) serves the experts by ``want`` with every decode
    step from one CUDA graph, and gives the same tokens eagerly (``--graphs off``); returns the graphed output."""
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert want in out and "one CUDA graph per step" in out
    assert main([*argv, "--graphs", "off"]) == 0
    assert ids(capsys.readouterr().out) == ids(out)
    return out
