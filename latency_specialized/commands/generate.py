"""`latency-specialized generate`: a standalone engine - reference prefill, then decode through the program.

Works for any adapter with the ``reference`` and ``program`` capabilities whose objects follow
this small protocol (Kimi K3 does):

* ``adapter.reference(spec, checkpoint=, seed=, dtype=, device=)`` -> a reference with ``spec``,
  ``tokenizer`` (``tokenizers.Tokenizer`` or None), ``bos_token_id``, ``new_cache(num_seqs, max_len)``
  (a cache with ``slots`` (``row``, ``blocks``), ``block_size`` and ``block_table()``) and
  ``prefill(cache, slot, start, ids) -> [T, vocab] logits``;
* ``adapter.program(spec, reference=, plans=, cache=, trace=)`` -> a runtime ``DecodeProgram``.

Prefill always runs the reference (the stock path; the trace says so). Every decode step runs the
program through the runtime's graph runner with its gate and trace: on a GPU the step is captured
into one CUDA graph and replayed (``--graphs auto``, when every site runs a kernel or a sync-free
composition - the torch references of some families read values on the host and cannot be
captured); on the CPU, eagerly. Defaults pick the device (CUDA when present) and the size (medium
on a GPU: widths the kernels serve; tiny on the CPU). Greedy by default; ``--temperature`` samples
with exponential-race noise (no host sync).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

DEMO = "latency-specialized generate --model kimi_k3 --batch 2 --max-tokens 24 --prompt 'The quick brown fox'"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate text: reference prefill, then decode steps through the program",
                       description=f"Example: {DEMO} --show-plan --show-trace")
    p.add_argument("--model", required=True, help="adapter name (see `models`) or HF architecture")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", metavar="DIR", help="Hugging Face model directory (config.json + safetensors)")
    src.add_argument("--size", choices=["tiny", "medium", "full"], default=None,
                     help="random weights of this variant (default: medium on a GPU where the adapter has one, "
                          "else tiny)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", help="prompt text (repeat for several; cycled over --batch)")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids (no tokenizer needed)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and of sampling")
    p.add_argument("--device", default="auto", help="auto (cuda when torch sees a GPU, else cpu), cpu or cuda[:N]")
    p.add_argument("--graphs", choices=["auto", "on", "off"], default="auto",
                   help="replay each decode step from a CUDA graph: auto = on a GPU when every site is "
                        "capturable; on = require it; off = eager")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="activation dtype")
    p.add_argument("--experts", choices=["native"], default=None,
                   help="native: keep the routed experts quantized as the checkpoint (or, with random weights, the "
                        "release) stores them, run by the 4-bit kernels; default: dequantised at load")
    p.add_argument("--linears", choices=["native"], default=None,
                   help="native: keep the dense projections quantized as the checkpoint (or, with random weights, the "
                        "release) stores them (block FP8), run by the FP8 gemms; default: dequantised at load")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default 1 on the CPU: tiny ops only lose from threading)")
    p.add_argument("--show-plan", action="store_true", help="print the full dispatch plan")
    p.add_argument("--show-trace", action="store_true", help="print the trace (site bindings, fast/stock steps)")
    return p


def _sample(logits, temperature: float, gen) -> Any:
    import torch

    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=gen)
    return (probs / noise).argmax(-1)  # exponential race == sampling from probs, no host sync


def _decide_graphs(mode: str, device: Any, plan: Any) -> tuple[bool, str]:
    """(use CUDA graphs, why not) from ``--graphs``, the device and the plan's implementations."""
    from latency_specialized.errors import UserError

    if mode == "off":
        return False, "--graphs off"
    if device.type != "cuda":
        if mode == "on":
            raise UserError("--graphs on needs a CUDA device: use --device cuda, or --graphs off")
        return False, "CUDA graphs need a GPU"
    # only the sites the program calls at this bucket can block a capture
    refs = sorted({c.site.name for c in plan.called_choices() if c.impl is not None and c.impl.is_reference})
    if refs and mode == "auto":
        # torch references read values on the host (sequence lengths, selected experts): not capturable
        return False, (f"{len(refs)} site(s) on torch references ({', '.join(refs[:4])}"
                       f"{' ...' if len(refs) > 4 else ''}); --graphs on tries anyway")
    return True, ""


def _parse_prompt_ids(text: str) -> list[int]:
    """``--prompt-ids`` -> token ids; UserError naming the flag when empty or not integers."""
    from latency_specialized.errors import UserError

    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--prompt-ids {text!r}: use comma-separated integers, e.g. 1,2,3") from None
    if not ids:
        raise UserError(f"--prompt-ids {text!r} holds no token id: give comma-separated integers, e.g. 1,2,3")
    return ids


def _parse_device(name: str) -> Any:
    """``--device`` -> a torch.device (cpu or cuda[:N] present here); UserError naming the flag otherwise."""
    import torch

    from latency_specialized.errors import UserError

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index):
        raise UserError(f"--device {name!r} is not supported: use --device auto, cpu or cuda[:N]")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {name} but torch sees no CUDA device: use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"--device {name}: torch sees {torch.cuda.device_count()} CUDA device(s): use "
                            f"cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return device


def run(args: argparse.Namespace) -> int:
    import torch

    from latency_specialized import hardware
    from latency_specialized.adapter_contract import SpecBoundAdapter
    from latency_specialized.errors import UserError
    from latency_specialized.ops.plan import build_plan
    from latency_specialized.plugins import get_registry
    from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
    from latency_specialized.runtime.gate import DecodeGate, StepState
    from latency_specialized.runtime.graph_runner import CUDAGraphRunner
    from latency_specialized.trace import Trace

    if args.max_tokens < 1:
        raise UserError(f"--max-tokens {args.max_tokens}: use --max-tokens >= 1 (tokens generated per sequence; "
                        "the first comes from prefill)")
    if args.batch < 1:
        raise UserError(f"--batch {args.batch}: use --batch >= 1 (sequences decoded together)")
    prompt_ids = _parse_prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None
    device = _parse_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    reg = get_registry()
    adapter = reg.adapter(args.model)
    missing = {"reference", "program"} - set(adapter.capabilities)
    if missing:
        raise UserError(f"{adapter.name} has no {' / '.join(sorted(missing))} yet: `generate` needs both "
                        f"(capabilities: {sorted(adapter.capabilities)})")
    quant_kw: dict = {}
    if args.experts:
        if "quantized_experts" not in adapter.capabilities:
            raise UserError(f"{adapter.name} cannot keep its routed experts quantized yet (--experts {args.experts}): "
                            "drop --experts (they are dequantised at load)")
        quant_kw["expert_format"] = args.experts
    if args.linears:
        if adapter.native_linears is None:
            raise UserError(f"{adapter.name} keeps its dense projections in the activation dtype only (--linears "
                            f"{args.linears}): drop --linears")
        quant_kw["linear_format"] = args.linears
    t0 = time.perf_counter()
    if args.checkpoint:
        ref = adapter.reference(None, checkpoint=args.checkpoint, dtype=args.dtype, device=device, **quant_kw)
        source = f"checkpoint {args.checkpoint}"
    else:
        size = args.size or ("medium" if device.type == "cuda" and "medium" in adapter.variants else "tiny")
        if size not in adapter.variants:
            raise UserError(f"{adapter.name} has no --size {size} (variants: {', '.join(adapter.variants)})")
        ref = adapter.reference(adapter.spec(size), seed=args.seed, dtype=args.dtype, device=device, **quant_kw)
        source = f"{size}, random weights seed {args.seed}"
    spec = ref.spec
    load_s = time.perf_counter() - t0

    # ---- prompts
    tok = ref.tokenizer
    if prompt_ids is not None:
        prompts = [prompt_ids]
        texts = [None]
    else:
        if tok is None:
            raise UserError(f"{source} has no tokenizer.json: pass --prompt-ids instead of --prompt")
        bos = [ref.bos_token_id] if ref.bos_token_id is not None else []
        prompts = [bos + tok.encode(t).ids for t in args.prompt]
        texts = list(args.prompt)
    for p in prompts:
        if not p:
            raise UserError("empty prompt: give at least one token")
        bad = [i for i in p if not 0 <= i < spec.vocab_size]
        if bad:
            raise UserError(f"token ids {bad[:5]} outside the vocabulary 0..{spec.vocab_size - 1}")
    B = args.batch
    seq_prompts = [prompts[b % len(prompts)] for b in range(B)]
    max_len = max(len(p) for p in seq_prompts) + args.max_tokens

    trace = Trace()
    gen = torch.Generator(device=device).manual_seed(args.seed)
    cache = ref.new_cache(B, max_len)
    # ---- prefill: the reference (stock) path
    t1 = time.perf_counter()
    first = []
    for b, p in enumerate(seq_prompts):
        logits = ref.prefill(cache, cache.slots[b], 0, p)[-1]
        first.append(_sample(logits.unsqueeze(0), args.temperature, gen)[0])
        trace.stock("prefill runs the reference path (stock)", batch=1, tokens=len(p))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    prefill_s = time.perf_counter() - t1

    # ---- decode: the program through the runtime runner
    hw = hardware.probe() if device.type == "cuda" else hardware.for_arch("cpu")
    plan = build_plan(SpecBoundAdapter(adapter, spec), reg.implementations, hw, tp=1, batch=B, dtype=args.dtype,
                      variant=spec.variant)
    if plan.scope_problems:
        trace.note("outside the fast-path scope: " + "; ".join(plan.scope_problems))
    program = adapter.program(spec, reference=ref, plans=plan, cache=cache, trace=trace)
    buffers = DecodeBuffers(BufferSpec(max_batch=program.max_batch, max_blocks_per_seq=len(cache.slots[0].blocks),
                                       block_size=cache.block_size, pad_state=0), device)
    tokens = torch.stack(first)
    buffers.load(tokens, [len(p) for p in seq_prompts], [s.row for s in cache.slots],
                 cache.block_table(device="cpu"))
    greedy = args.temperature <= 0
    use_graphs, why_eager = _decide_graphs(args.graphs, device, plan)
    runner = CUDAGraphRunner(program, buffers, gate=DecodeGate(max_batch=program.max_batch, buckets=(plan.bucket,)),
                             trace=trace, use_graphs=use_graphs, feed_back_tokens=greedy)
    capture_s = 0.0
    if use_graphs:
        t2 = time.perf_counter()
        try:
            runner.capture()
        except RuntimeError as e:  # a site synced with the host during capture: name it, do not hide it
            raise UserError(f"CUDA graph capture failed ({e}); run with --graphs off to decode eagerly") from e
        capture_s = time.perf_counter() - t2
    elif why_eager:
        trace.note(f"decode runs eagerly: {why_eager}")
    out = [tokens]
    step_s = []
    for _ in range(args.max_tokens - 1):
        t = time.perf_counter()
        res = runner.run(StepState(num_seqs=B), tokens=None if greedy else out[-1])
        if not res.fast:
            raise UserError(f"decode step ran stock: {res.reason}")
        nxt = res.outputs["next_tokens"].clone() if greedy else _sample(res.outputs["logits"], args.temperature, gen)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_s.append(time.perf_counter() - t)
        out.append(nxt)
    generated = torch.stack(out, dim=1).cpu().tolist()

    # ---- report
    print(f"{adapter.name} [{source}] on {device} ({args.dtype}), batch {B}, {spec.num_layers} layers, "
          f"vocab {spec.vocab_size} (loaded in {load_s * 1e3:.0f} ms)")
    for i, p in enumerate(prompts):
        label = repr(texts[i]) if texts[i] is not None else "ids"
        print(f"prompt {i}: {label} -> {len(p)} tokens {p}")
    print(f"prefill: reference path (stock), {B} sequence(s), {sum(map(len, seq_prompts))} tokens, "
          f"{prefill_s * 1e3:.1f} ms")
    if step_s:
        ms = [s * 1e3 for s in step_s]
        how = f"one CUDA graph per step, captured in {capture_s:.1f} s" if use_graphs else f"eager: {why_eager}"
        print(f"decode: {len(ms)} steps through the program ({how}), {statistics.median(ms):.2f} ms/step median "
              f"(mean {statistics.fmean(ms):.2f}, min {min(ms):.2f}), bucket {plan.bucket}")
    else:
        print("decode: no steps (--max-tokens 1: the one token came from prefill)")
    for b, ids in enumerate(generated):
        print(f"[{b}] ids: {ids}")
        if tok is not None:
            print(f"[{b}] text: {tok.decode(ids)!r}")
    c = plan.counts()
    served = sorted({ch.impl.name for ch in plan.choices if ch.impl is not None})
    print(f"plan: {c['sites']} sites on {plan.hardware.arch} | fast {c['fast']} | reference {c['reference']} | "
          f"unserved {c['unserved']} | not called {c['not_called']} | {len(served)} implementations")
    if getattr(program, "calls", None):
        print(f"program: {program.steps_run} steps, {sum(program.calls.values())} op calls over "
              f"{len(program.calls)} sites")
    if args.show_plan:
        print(plan.to_text(refusals=True))
    if args.show_trace:
        print(trace.to_text(last=8))
        print("  sites bound per implementation: "
              + ", ".join(f"{impl} x{n}" for impl, n in sorted(trace.impl_calls.items())))
    return 0
