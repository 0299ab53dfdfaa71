"""``vllm.LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), for tests: greedy tokens of a few
concurrent prompts and - with ``latency_specialized`` - what the installed decode override runs.

Usage: ``python composed_script.py <model dir> <decode_backend> <out.json>``. The engine is built in
``__main__`` only. With our backend the worker runs in this process, so the installed override (its
decode step, the ComposedProgram, its op table and states) can be looked at directly; the facts
are written as JSON for the test to assert on.
"""

from __future__ import annotations

import json
import os
import sys

PROMPTS = ["The quick brown fox", "Hello world! How are you", "Tensor parallel ranks exchange",
           "Once upon a time there was a kernel", "Numbers: 0 1 2"]
MAX_TOKENS = 12


def _storage(t) -> tuple[int, int]:
    """(first byte, end byte) of the storage behind ``t``."""
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def _inside(t, base) -> bool:
    """``t`` is a view into ``base``'s storage (no copy of its own)."""
    lo, hi = _storage(base)
    return lo <= t.data_ptr() < hi and _storage(t) == (lo, hi)


def facts(llm) -> dict:
    from latency_specialized.ops.plan import SiteChoice
    from latency_specialized.runtime.composed import ComposedProgram
    from latency_specialized.runtime.vllm_binding import VllmComposedStep
    from latency_specialized.vllm.install import _ACTIVE

    override = _ACTIVE["override"]
    step = override.step
    program = step.program
    sites = step.sites
    vmodel = llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()
    inner = vmodel.model
    out: dict = {"step": f"{type(step).__module__}.{type(step).__qualname__}",
                 "step_is_composed_step": isinstance(step, VllmComposedStep),
                 "program": f"{type(program).__module__}.{type(program).__qualname__}",
                 "is_composed_program": isinstance(program, ComposedProgram),
                 "head_is_none": program.model.head is None, "outputs": sorted(program.outputs()),
                 "steps_run": program.steps_run, "gate_buckets": list(override.decode_gate.all_buckets()),
                 "planned_buckets": list(sites.buckets), "program_buckets": list(program.op_table.buckets)}
    # the op table bound exactly the plans' SiteChoices (the plans the SiteTable holds)
    bound = {}
    for b, plan in program.plans.items():
        table = program.op_table[b]
        bound[str(b)] = {"same_plan": plan is sites.plans[b],
                         "all_site_choices": all(isinstance(c, SiteChoice) for c in plan.choices),
                         "bound_is_choice": all(table.impls[c.site.name] is c.impl for c in plan.choices),
                         "sites": len(plan.choices)}
    out["bound"] = bound
    first = min(program.plans)
    out["served"] = {c.site.name: c.impl.name for c in program.plans[first].called_choices()}
    out["stock"] = {c.site.name: c.stock for c in program.plans[first].choices if c.stock}
    out["stock_fn_is_vllm_attention"] = all(c.impl.fn is step.attention for c in program.plans[first].choices
                                            if c.stock)
    out["calls"] = dict(program.op_table.calls)
    # weights: views of vLLM's own tensors (the retained loaded ones on the CPU build)
    from latency_specialized.runtime.vllm_weights import expert_weights, linear_weight

    views = {}
    for i, layer in enumerate(inner.layers):
        w = program.w_layers[i]
        qkv, _ = linear_weight(layer.self_attn.qkv_proj)
        views[f"{i}.attn.qkv"] = w["attn"]["qkv"].data_ptr() == qkv.data_ptr() and _inside(w["attn"]["qkv"], qkv)
        views[f"{i}.attn.o_proj"] = _inside(w["attn"]["o_proj"], linear_weight(layer.self_attn.o_proj)[0])
        views[f"{i}.attn.q_norm"] = w["attn"]["q_norm"].data_ptr() == layer.self_attn.q_norm.weight.data_ptr()
        views[f"{i}.residual.input_norm"] = \
            w["residual"]["input_norm"].data_ptr() == layer.input_layernorm.weight.data_ptr()
        if hasattr(layer.mlp, "experts"):
            w13, w2, _ = expert_weights(layer.mlp.experts.routed_experts)
            views[f"{i}.ffn.w13"] = w["ffn"]["w13"].data_ptr() == w13.data_ptr() and _inside(w["ffn"]["w13"], w13)
            views[f"{i}.ffn.w2"] = w["ffn"]["w2"].data_ptr() == w2.data_ptr()
            views[f"{i}.ffn.router"] = w["ffn"]["router"].data_ptr() == linear_weight(layer.mlp.experts.gate)[0].data_ptr()
        else:
            gu, _ = linear_weight(layer.mlp.gate_up_proj)
            views[f"{i}.ffn.gate_up"] = w["ffn"]["gate_up"].data_ptr() == gu.data_ptr() and _inside(w["ffn"]["gate_up"], gu)
    views["embed"] = program.w_embed["weight"].data_ptr() == inner.embed_tokens.weight.data_ptr()
    views["final_norm"] = program.w_final["norm"].data_ptr() == inner.norm.weight.data_ptr()
    out["weights_are_views"] = views
    # states: views of each layer's vLLM KV cache
    out["states_are_vllm_caches"] = {
        str(i): _inside(program.states.layer(i)["k"], layer.self_attn.attn.kv_cache)
        and _inside(program.states.layer(i)["v"], layer.self_attn.attn.kv_cache)
        and program.states.layer(i)["k"].data_ptr() == layer.self_attn.attn.kv_cache.data_ptr()
        for i, layer in enumerate(inner.layers)}
    out["trace"] = override.trace.summary()
    out["layout_problems"] = layout_checks(llm, vmodel)
    return out


def layout_checks(llm, vmodel) -> dict:
    """The binding's start-time layout checks on the real module tree: none as loaded, and the reason
    when a module is changed into something the pieces cannot take (each change undone after)."""
    import torch

    from latency_specialized_models.vllm_moe.spec import spec_from_config
    from latency_specialized_models.vllm_moe.vllm import layout_problems

    spec = spec_from_config(llm.llm_engine.model_config.hf_text_config)
    inner = vmodel.model
    out = {"as_loaded": layout_problems(vmodel, spec, 1)}
    impl = inner.layers[1].self_attn.attn.impl
    old = impl.sliding_window
    impl.sliding_window = 16
    out["sliding_window"] = layout_problems(vmodel, spec, 1)
    impl.sliding_window = old
    o_proj = inner.layers[0].self_attn.o_proj
    o_proj.bias = torch.nn.Parameter(torch.zeros(spec.hidden_size), requires_grad=False)
    out["bias"] = layout_problems(vmodel, spec, 1)
    o_proj.bias = None
    rope = inner.layers[0].self_attn.rotary_emb
    base = rope.base
    rope.base = base * 2
    out["rope"] = layout_problems(vmodel, spec, 1)
    rope.base = base
    out["restored"] = layout_problems(vmodel, spec, 1)
    return out


def main(model: str, backend: str, path: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    extra = {"additional_config": {"decode_backend": backend}} if backend != "auto" else {}
    llm = LLM(model=model, dtype="float32", max_model_len=512, max_num_seqs=8, enforce_eager=True,
              kv_cache_memory_bytes=64 * 2**20, seed=0, **extra)
    results = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    out = {"tokens": [list(r.outputs[0].token_ids) for r in results]}
    if backend != "auto":
        out.update(facts(llm))
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
