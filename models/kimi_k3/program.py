"""The Kimi K3 decode program: one decode step composed only from op-family calls.

Every call goes through the plan (``plan.impl(site)``) of the step's batch bucket, so the same
program runs the plain-torch references on a CPU and whatever faster implementations a GPU plan
picks. It implements the runtime's ``DecodeProgram`` protocol (``prepare`` / ``step`` /
``state_tensors`` / ``outputs``), reading its per-step inputs from the static
:class:`~latency_specialized.runtime.buffers.DecodeBuffers` (tokens, KV slots, sequence lengths,
block tables, state rows) and writing static outputs, so the graph runner can capture it.

Per step (rows ``[:bucket]``; padded rows read/write state row 0 and write no KV slot):

1. the embedding goes into source 0 of the static AttnRes buffer ``sources[R, bucket, hidden]``
   (source-major: each source is a contiguous slab); the other sources (one per block of layers)
   start empty each step;
2. per layer ``i`` (block ``k = i // block_size``, partial source ``k + 1``): AttnRes mix + input norm
   -> attention (KDA or MLA) -> all-reduce + add into the partial row -> AttnRes mix + post-attention
   norm -> dense MLP or latent MoE -> all-reduce + add into the partial row;
3. final AttnRes mix -> final norm -> LM head -> ``logits`` and greedy ``next_tokens``.

Glue that is not an op family: the embedding gather, slicing the fused projections (views),
``sources`` slab copies and the fp32 cast of the router input - all static-shaped device ops.
Host syncs: none in the program itself. The CPU references of ``attention.mla`` (reads
``seq_lens``) and ``moe.experts`` (loops over the selected experts) sync, so a step served by
them cannot be captured into a CUDA graph; GPU implementations of those families must not sync
(on GPUs MLA is served by ``attention.mla.triton_splitkv``, a split-KV kernel, or where its shape
limits refuse by ``attention.mla.torch_paged``, a sync-free torch composition).

Tensor parallelism (TP = the plans' TP = ``comm.world_size``): the program takes the full weights
and keeps its rank's shard (tp.py); the cache must be the rank's shard too (``tp.shard_cache``).
Row-parallel outputs (o_proj, MLP/expert down-projections) are partial sums that the all-reduce
sites complete; the experts' latent output is all-reduced together with the latent RMSNorm; the
latent up-projection writes only the rank's hidden slice (added to the shared experts' partial,
so the FFN all-reduce counts it once); the LM head's vocabulary slices are all-gathered (glue).
Router and latent down-projection are split across ranks (``ops/tp_moe.py``): each rank scores
its experts and projects its latent channels, and one all-gather joins both (stock vLLM
replicates them on every rank). Where a kernel serves ``moe.gate_down`` (batch 1 on the H200)
both come from one weight stream ``[W_gate; W_down]`` and the two gemm sites are skipped.

``weights_sharded=True`` takes weights that already are this rank's shard (``tp.shard_weights``
names and shapes) - the bench draws rank-shaped random weights directly, as the full model's
would not fit one GPU.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from latency_specialized.errors import UserError
from latency_specialized.ops.plan import Plan
from latency_specialized.ops.tp_moe import gather_parts, shard_range
from latency_specialized.runtime.communicators import SiteCommunicators
from latency_specialized.runtime.program import DictOpTable
from latency_specialized.runtime.side_stream import SideStream
from latency_specialized.spec import DenseMLPSpec, KDAAttentionSpec, MLAAttentionSpec, MoESpec
from latency_specialized.trace import Trace

from latency_specialized_models.kimi_k3.cache import KimiK3Cache
from latency_specialized_models.kimi_k3.sites import in_proj_rows
from latency_specialized_models.kimi_k3.spec import KimiK3Spec
from latency_specialized_models.kimi_k3.tp import shard_weights


@dataclass
class _Layer:
    """Weights of one layer arranged the way the op families take them (fused where vLLM fuses)."""

    res_norm: torch.Tensor
    res_query: torch.Tensor
    in_norm: torch.Tensor
    mlp_res_norm: torch.Tensor
    mlp_res_query: torch.Tensor
    post_norm: torch.Tensor
    attn: dict[str, torch.Tensor]
    ffn: dict[str, torch.Tensor]


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (the padded width of a fused projection)."""
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _arrange(spec: KimiK3Spec, w: Mapping[str, torch.Tensor]) -> list[_Layer]:
    layers = []
    for layer in spec.layers:
        p = f"model.layers.{layer.index}."
        s = p + "self_attn."
        a = layer.attention
        if isinstance(a, KDAAttentionSpec):
            attn = {
                # in_proj rows: q | k | v | g_out | f_a | beta, zero-padded to 16 rows (vLLM in_proj_qkvgfab)
                "in": _pad_rows(torch.cat([w[s + "q_proj.weight"], w[s + "k_proj.weight"], w[s + "v_proj.weight"],
                                           w[s + "g_proj.weight"], w[s + "f_a_proj.weight"], w[s + "b_proj.weight"]]),
                                in_proj_rows(a)),
                "f_b": w[s + "f_b_proj.weight"],
                "conv": torch.cat([w[s + f"{n}_conv1d.weight"][:, 0] for n in ("q", "k", "v")]),
                "A_log": w[s + "A_log"], "dt_bias": w[s + "dt_bias"], "o_norm": w[s + "o_norm.weight"],
                "o": w[s + "o_proj.weight"],
            }
        else:
            assert isinstance(a, MLAAttentionSpec)
            gated = a.output_gate == "sigmoid"
            if a.q_lora_rank:
                # [q_a | kv_a] as vLLM's fused_qkv_a_proj, and the output-gate rows too: all read the same h
                attn = {"qkv_a": torch.cat([w[s + "q_a_proj.weight"], w[s + "kv_a_proj_with_mqa.weight"]]
                                           + ([w[s + "g_proj.weight"]] if gated else [])),
                        "q_a_norm": w[s + "q_a_layernorm.weight"], "q_b": w[s + "q_b_proj.weight"]}
            else:
                attn = {"kv_a": w[s + "kv_a_proj_with_mqa.weight"], "q": w[s + "q_proj.weight"]}
                if gated:
                    attn["g"] = w[s + "g_proj.weight"]
            attn.update({"kv_a_norm": w[s + "kv_a_layernorm.weight"], "kv_b": w[s + "kv_b_proj.weight"],
                         "o": w[s + "o_proj.weight"]})
        f = layer.ffn
        if isinstance(f, DenseMLPSpec):
            m = p + "mlp."
            ffn = {"gate_up": torch.cat([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]]),
                   "down": w[m + "down_proj.weight"]}
        else:
            assert isinstance(f, MoESpec)
            m = p + "block_sparse_moe."
            ffn = {
                "gate": w[m + "gate.weight"], "bias": w[m + "gate.e_score_correction_bias"],
                "w13": torch.stack([torch.cat([w[m + f"experts.{e}.w1.weight"], w[m + f"experts.{e}.w3.weight"]])
                                    for e in range(f.num_experts)]),
                "w2": torch.stack([w[m + f"experts.{e}.w2.weight"] for e in range(f.num_experts)]),
            }
            if f.latent_dim:
                # router rows, then latent-down rows, in one tensor (the moe.gate_down site streams both
                # in one kernel); "gate" and "down" are views of it for the two gemm sites
                gate_down = torch.cat([ffn["gate"], w[m + "routed_expert_down_proj.weight"]])
                n_gate = ffn["gate"].shape[0]
                ffn.update(gate_down=gate_down, gate=gate_down[:n_gate], down=gate_down[n_gate:])
                ffn["up"] = w[m + "routed_expert_up_proj.weight"]
                if spec.latent_moe_norm:
                    ffn["latent_norm"] = w[m + "routed_expert_norm.weight"]
            if f.num_shared_experts:
                sh = m + "shared_experts."
                ffn["shared_gate_up"] = torch.cat([w[sh + "gate_proj.weight"], w[sh + "up_proj.weight"]])
                ffn["shared_down"] = w[sh + "down_proj.weight"]
        layers.append(_Layer(w[p + "self_attention_res_norm.weight"], w[p + "self_attention_res_proj.weight"][0],
                             w[p + "input_layernorm.weight"], w[p + "mlp_res_norm.weight"],
                             w[p + "mlp_res_proj.weight"][0], w[p + "post_attention_layernorm.weight"], attn, ffn))
    return layers


SHARED_FORK_LATE_MAX_BATCH = 1
"""Largest bucket whose shared experts fork onto their side stream only after the router's inputs
(logits, latent) are computed, instead of at the start of the MoE block. Early, the shared experts'
33 MB (TP8) compete for DRAM and SMs with the small router/latent projection that the routed path
waits on (H200 profile at batch 1: that 8 MB kernel took 15 us beside them); late, they fill the
router kernel's idle DRAM instead. H200 layer A/B (TP8 shard, same machine, two runs each): batch 1
KDA 110.4 / 111.9 -> 108.6 / 109.4 us, MLA 120.9 / 120.5 -> 119.3 / 119.0 us; batch 2 KDA lost 3.3-6.9 us,
batch 8 KDA gained 11 us but MLA lost 5 us: late at batch 1 only. 0: always early."""

ROUTER_SIDE_MIN_BATCH = 2
"""Smallest bucket whose router GEMM runs on its own stream beside the latent down-projection. H200
layer bench (TP8 shard): batch 2-64 gained 2.7-9 us per layer; batch 1 lost ~1.7 us (its router GEMM
then starts only after the AttnRes kernel completes instead of early under PDL, and the router waits
on two branches), so batch 1 keeps them in one stream."""


class KimiK3Program:
    """Decode step of Kimi K3 over a :class:`KimiK3Cache`, bound to plans per batch bucket.

    Parameters
    ----------
    spec : the unsharded architecture.
    weights : full weights by official name (the dict the reference reads); the rank keeps its shard.
    plans : one Plan or {bucket: Plan}, all for this model at TP = ``comm.world_size`` (1 without comm).
    cache : the decode state the step updates in place: the reference's cache at TP=1 (prefill fills
        it), the rank's ``tp.shard_cache`` at TP > 1.
    trace : records the implementation bound to every site.
    comm : communicator of the all-reduce sites and the LM-head gather (None: single rank).
    """

    def __init__(self, spec: KimiK3Spec, weights: Mapping[str, torch.Tensor], plans: Plan | Mapping[int, Plan],
                 cache: KimiK3Cache, *, trace: Trace | None = None, comm: Any = None, weights_sharded: bool = False):
        plans = {plans.bucket: plans} if isinstance(plans, Plan) else dict(plans)
        if not plans:
            raise UserError("the Kimi K3 program needs at least one plan (build_plan for its batch)")
        tp = next(iter(plans.values())).parallel.tp
        world = comm.world_size if comm is not None else 1
        if tp != world:
            raise UserError(f"plans are for TP={tp} but the communicator has {world} rank(s): build the plans "
                            "with the communicator's world size")
        if spec.tp != 1:
            raise UserError("pass the unsharded spec and full weights: the program keeps its rank's shard")
        if any(isinstance(l.ffn, MoESpec) and not l.ffn.latent_dim for l in spec.layers):
            raise UserError(f"{spec.name}: the program implements the latent MoE only (routed_expert_hidden_size "
                            "set, as in Kimi K3); this config has plain MoE layers - use the reference")
        for bucket, plan in plans.items():
            if plan.model != spec.name or plan.parallel.tp != tp or plan.bucket != bucket:
                raise UserError(f"plan {plan.model} TP={plan.parallel.tp} bucket {plan.bucket} does not fit "
                                f"{spec.name} at TP={tp}, bucket {bucket}")
            if plan.tokens != bucket:
                raise UserError(f"plan of bucket {bucket} has {plan.tokens} tokens per step: speculative tokens are "
                                "not supported by the Kimi K3 program yet (use spec_tokens=0)")
        self.spec = spec
        self.tp, self.rank = tp, (comm.rank if comm is not None else 0)
        self.rank_spec = spec.shard(tp) if tp > 1 else spec
        self.cache = cache
        self.comm = comm
        for i, st in cache.state.items():
            a = self.rank_spec.layers[i].attention
            if st.shape[1] != a.num_heads:
                raise UserError(f"cache holds {st.shape[1]} KDA heads in layer {i}, rank needs {a.num_heads}: "
                                "pass this rank's shard (tp.shard_cache)")
        self.trace = trace if trace is not None else Trace()
        self.max_batch = max(plans)
        self.plans = plans
        self.calls: Counter[str] = Counter()
        """Op-site calls made by ``step`` (proof that the program, not the reference, ran)."""
        self.steps_run = 0
        """Completed ``step`` calls."""
        self.census: Any = None
        """A runtime.census.KernelCensus while a bench counts kernels per site (None otherwise)."""
        self._ops: dict[int, dict[str, Callable[..., Any]]] = {}
        self._strided_ok: dict[int, set[str]] = {}
        """Per bucket, the sites whose implementation takes strided rows (no copy of a column slice)."""
        self._strided_out: dict[int, set[str]] = {}
        """Per bucket, the sites whose implementation writes a column slice of a wider tensor in place."""
        self._skipped: dict[int, dict[str, str]] = {}
        """Per bucket, the sites not called and why (``Plan.skipped_sites``): the sites a served
        ``moe.gate_down`` fuses (or that site itself where only its reference would serve), and the
        q_a norm where the q_b gemm's implementation normalises its input (``norm_prologue``)."""
        for bucket, plan in sorted(plans.items()):
            self._ops[bucket] = {c.site.name: self._counted(c.site.name, plan.impl(c.site.name)) for c in plan.choices}
            self._strided_ok[bucket] = {c.site.name for c in plan.choices if c.impl is not None and c.impl.strided_rows}
            self._strided_out[bucket] = {c.site.name for c in plan.choices if c.impl is not None and c.impl.strided_out}
            self._skipped[bucket] = plan.skipped_sites()
            for c in plan.choices:
                assert c.impl is not None  # plan.impl above raised otherwise
                self.trace.site(c.site.name, c.impl.name, f"bucket {bucket}")
        dtype = weights["model.embed_tokens.weight"].dtype
        dev = weights["model.embed_tokens.weight"].device
        self.dtype, self.device = dtype, dev
        self.embed = weights["model.embed_tokens.weight"]
        head = self.embed if spec.tie_word_embeddings else weights["lm_head.weight"]
        self.head = head.chunk(tp)[self.rank].contiguous() if (tp > 1 and (spec.tie_word_embeddings or not weights_sharded)) else head
        self.final = {"norm": weights["model.output_attn_res_norm.weight"],
                      "query": weights["model.output_attn_res_proj.weight"][0], "out": weights["model.norm.weight"]}
        for layer in spec.layers:
            if isinstance(layer.ffn, MoESpec) and tp > 1:
                shard_range(layer.ffn.num_experts, 0, tp, f"{spec.name} router experts (split across ranks)")
                shard_range(layer.ffn.latent_dim or spec.hidden_size, 0, tp, f"{spec.name} latent channels")
        rank_weights = dict(weights) if weights_sharded else shard_weights(spec, dict(weights), self.rank, tp)
        self.layers = _arrange(self.rank_spec, rank_weights)
        H = spec.hidden_size
        self.h_lo, self.h_hi = self.rank * H // tp, (self.rank + 1) * H // tp
        """The rank's hidden slice (latent up-projection rows)."""
        # Static buffers (rows = the largest bucket); NaN-filled outputs make unwritten rows visible.
        self.sources = torch.zeros(spec.attnres_rows, self.max_batch, spec.hidden_size, dtype=dtype, device=dev)
        self.logits = torch.full((self.max_batch, spec.vocab_size), float("nan"), dtype=torch.float32, device=dev)
        self.next_tokens = torch.zeros(self.max_batch, dtype=torch.int64, device=dev)
        latent = max((l.ffn.latent_dim or 0) for l in spec.layers if isinstance(l.ffn, MoESpec)) or H
        self.zeros = torch.zeros(self.max_batch, latent, dtype=dtype, device=dev)
        """Residual input of the latent all-reduce (it has no residual: x + 0 == x exactly)."""
        # Shared experts run on a side stream when the plan marks their site so and there is a GPU
        # (forked/joined by events: inside a graph capture that is a parallel branch).
        want_side = dev.type == "cuda" and any(
            c.site.name.endswith("moe.shared") and c.site.ctx.attr("side_stream") for p in plans.values()
            for c in p.choices)
        self.side = SideStream(dev) if want_side else None
        # The router GEMM runs beside the latent down-projection (both read only the normed h), on a
        # higher-priority stream: it leads to the router and the experts, the critical path.
        self.router_side = SideStream(dev, priority=-1) if dev.type == "cuda" else None
        # Last (it may allocate peer-mapped memory): the communicator of every all-reduce site - ``comm``
        # where the plan's implementation runs on it, else a symmetric-memory workspace (CUDA IPC) built
        # over comm's process group where the plan picked a fused kernel; a site no communicator here can
        # serve fails the build, naming the fix. Collective: every rank builds the same plans.
        self.site_comms = SiteCommunicators(plans, comm, dev)
        """(bucket, site) -> communicator of the all-reduce sites; ``close()`` releases what it built."""

    def _counted(self, site: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        calls = self.calls

        def call(*args: Any, **kw: Any) -> Any:
            calls[site] += 1
            return fn(*args, **kw)

        return call

    @property
    def op_table(self) -> DictOpTable:
        """The bound ops, bucket -> site -> callable: census, benches and recorders instrument them through
        ``op_table.wrap(hook)`` (``hook(site, bucket, fn) -> fn``), never through this program's members."""
        return DictOpTable(self._ops)

    # ------------------------------------------------------------------ DecodeProgram protocol
    def prepare(self, bucket: int) -> None:
        """Warm every implementation of the bucket's plan (compile hooks) before any capture."""
        plan = self.plans.get(bucket)
        if plan is None:
            raise UserError(f"no plan for bucket {bucket} (have {sorted(self.plans)}): build one for that batch")
        for c in plan.choices:
            if c.impl is not None and c.impl.prepare is not None:
                c.impl.prepare(c.site.ctx)

    def close(self) -> None:
        """Release the communication workspaces this program built (collective: every rank calls it, after
        its last step). The program cannot step afterwards."""
        self.site_comms.close()

    def state_tensors(self) -> Sequence[torch.Tensor]:
        return self.cache.tensors()

    def outputs(self) -> Mapping[str, torch.Tensor]:
        return {"logits": self.logits, "next_tokens": self.next_tokens}

    @torch.no_grad()
    def step(self, buffers: Any, bucket: int) -> None:
        """One decode step over rows ``[:bucket]`` of ``buffers`` (a DecodeBuffers)."""
        ops = self._ops.get(bucket)
        if ops is None:
            raise UserError(f"no plan for bucket {bucket} (have {sorted(self._ops)}): build one for that batch")
        spec, b = self.spec, bucket
        eps, bs = spec.norm.eps, spec.attnres_block
        meta = {"tokens": buffers.tokens[:b], "slots": buffers.slot_mapping[:b], "seq_lens": buffers.seq_lens[:b],
                "block_table": buffers.block_tables[:b], "rows": buffers.state_indices[:b]}
        src = self.sources[:, :b]
        src.zero_()  # partial-block sources start empty: 0 + x == x exactly
        src[0].copy_(self.embed.index_select(0, meta["tokens"]))
        for layer, L in zip(self.rank_spec.layers, self.layers):
            i, kind = layer.index, layer.kind
            k = i // bs
            pre = k + 1 if i % bs == 0 else k + 2   # at a block start the partial source is still empty
            h = ops[f"{kind}/attn.attnres"](src, pre, L.res_norm, L.res_query, eps, out_norm_weight=L.in_norm,
                                            out_eps=eps)
            if isinstance(layer.attention, KDAAttentionSpec):
                a = self._kda(ops, kind, i, layer.attention, L.attn, h, meta)
            else:
                a = self._mla(ops, kind, i, layer.attention, L.attn, h, meta)
            # the sum goes straight back into the partial-block source (residual_out aliases residual)
            ops[f"{kind}/attn.allreduce"](a, src[k + 1], None, eps, comm=self.site_comms(b, f"{kind}/attn.allreduce"),
                                          out=(None, src[k + 1]))
            h = ops[f"{kind}/ffn.attnres"](src, k + 2, L.mlp_res_norm, L.mlp_res_query, eps,
                                           out_norm_weight=L.post_norm, out_eps=eps)
            if isinstance(layer.ffn, DenseMLPSpec):
                m = ops[f"{kind}/mlp"](h, L.ffn["gate_up"], L.ffn["down"], layer.ffn.activation)
            else:
                m = self._moe(ops, kind, layer.ffn, L.ffn, h)
            ops[f"{kind}/ffn.allreduce"](m, src[k + 1], None, eps, comm=self.site_comms(b, f"{kind}/ffn.allreduce"),
                                         out=(None, src[k + 1]))
        h = ops["final.attnres"](src, spec.attnres_rows, self.final["norm"], self.final["query"], eps)
        h = ops["final_norm"](h, self.final["out"], eps)
        logits = ops["lm_head"](h, self.head)
        if self.tp > 1:   # vocabulary slices of every rank, in rank order
            logits = self._communicate("lm_head.all_gather", b, self.comm.all_gather, logits, dim=-1)
        self.logits[:b].copy_(logits)
        self.next_tokens[:b].copy_(logits.argmax(-1))
        self.steps_run += 1

    def _rows(self, site: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` (a column slice) as the site's implementation takes it: as is where it reads strided
        rows, else contiguous - a copy kernel at M > 1 (at M = 1 a slice already is contiguous)."""
        return x if site in self._strided_ok.get(x.shape[0], ()) or x.is_contiguous() else x.contiguous()

    def _communicate(self, site: str, bucket: int, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """A communication call outside the op table, counted as ``site`` when a census runs."""
        if self.census is None:
            return fn(*args, **kw)
        with self.census.site(site, bucket):
            return fn(*args, **kw)

    # ------------------------------------------------------------------ blocks
    def _kda(self, ops, kind: str, i: int, a: KDAAttentionSpec, w: dict[str, torch.Tensor], h: torch.Tensor,
             meta: dict[str, torch.Tensor]) -> torch.Tensor:
        hd = a.num_heads * a.head_dim
        y = ops[f"{kind}/attn.in_proj"](h, w["in"])
        mixed, g_out = y[:, :3 * hd], y[:, 3 * hd:4 * hd]
        f_a, beta = y[:, 4 * hd:4 * hd + a.decay_rank], y[:, 4 * hd + a.decay_rank:4 * hd + a.decay_rank + a.num_heads]
        # the decay input f_b_proj(f_a) is computed inside the KDA op (its kernel fuses the small gemm)
        o = ops[f"{kind}/attn.kda"](mixed, self.cache.conv[i], w["conv"], f_a, w["A_log"], w["dt_bias"], beta, g_out,
                                    w["o_norm"], self.cache.state[i], meta["rows"], num_heads=a.num_heads,
                                    eps=self.spec.kda_norm_eps, gate_lower_bound=a.gate_lower_bound,
                                    f_b_weight=w["f_b"])
        return ops[f"{kind}/attn.o_proj"](o, w["o"])

    def _mla(self, ops, kind: str, i: int, a: MLAAttentionSpec, w: dict[str, torch.Tensor], h: torch.Tensor,
             meta: dict[str, torch.Tensor]) -> torch.Tensor:
        eps = self.spec.norm.eps
        L, R = a.kv_lora_rank, a.qk_rope_head_dim
        if a.q_lora_rank:
            ql = a.q_lora_rank
            y = ops[f"{kind}/attn.qkv_a_proj"](h, w["qkv_a"])
            # column slices of the fused projection [q_a | kv_a (latent, rope key) | output-gate logits]
            kv = y[:, ql:ql + L + R]
            gate = y[:, ql + L + R:] if a.output_gate == "sigmoid" else None  # strided rows: the op takes them
            if f"{kind}/attn.q_a_norm" in self._skipped.get(y.shape[0], {}):  # the q_b gemm normalises q_a
                q = ops[f"{kind}/attn.q_b_proj"](y[:, :ql], w["q_b"], norm_weight=w["q_a_norm"], norm_eps=eps)
            else:
                q_c = ops[f"{kind}/attn.q_a_norm"](self._rows(f"{kind}/attn.q_a_norm", y[:, :ql]), w["q_a_norm"], eps)
                q = ops[f"{kind}/attn.q_b_proj"](q_c, w["q_b"])
        else:
            kv = ops[f"{kind}/attn.kv_a_proj"](h, w["kv_a"])
            q = ops[f"{kind}/attn.q_proj"](h, w["q"])
            gate = ops[f"{kind}/attn.gate_proj"](h, w["g"]) if "g" in w else None
        # kv_a_layernorm is part of the MLA op (its only consumer): the raw latent slice kv[:, :L] goes in
        # as is (strided rows) and the op normalises it while writing the cache - one launch less per layer
        o = ops[f"{kind}/attn.mla"](q.view(h.shape[0], a.num_heads, a.qk_nope_head_dim + R), kv[:, :L], kv[:, L:],
                                    self.cache.kv[i], meta["slots"], meta["block_table"], meta["seq_lens"], w["kv_b"],
                                    qk_nope_head_dim=a.qk_nope_head_dim, v_head_dim=a.v_head_dim, gate=gate,
                                    kv_norm_weight=w["kv_a_norm"], kv_norm_eps=eps)
        return ops[f"{kind}/attn.o_proj"](o, w["o"])

    def _moe(self, ops, kind: str, f: MoESpec, w: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        eps, b = self.spec.norm.eps, h.shape[0]
        # the shared experts depend only on h: fork them onto the side stream (graph branch) so they
        # overlap the router, the latent down-projection and the routed experts; joined before latent_up.
        # Up to SHARED_FORK_LATE_MAX_BATCH the fork waits for the router inputs (see there)
        def fork_shared():
            return self.side.run(ops[f"{kind}/moe.shared"], h, w["shared_gate_up"], w["shared_down"], f.activation) \
                if (self.side is not None and f.num_shared_experts) else None

        late = b <= SHARED_FORK_LATE_MAX_BATCH
        pending = None if late else fork_shared()
        # fp32 router logits from the bf16 router weight (vLLM's GateLinear: bf16 x bf16 -> fp32) and
        # the latent input: at TP > 1 each rank computes its slice of both (experts r*E/tp.., latent
        # channels r*L/tp..) and one all-gather joins them - no rank repeats another's weight reads
        logits_dtype = torch.promote_types(h.dtype, torch.float32)
        # a communicator with gather slots (the one-GPU bench's stand-in) takes both slices in place: the
        # projections write straight into its gathered buffers and the all-gather copies nothing
        # (only for implementations that write such a slice without a temporary and a copy of their own)
        slot = getattr(self.comm, "gather_slot", None) if self.tp > 1 else None
        fused = f"{kind}/moe.router_gemm" in self._skipped.get(b, {})
        in_place = self._strided_out.get(b, set())

        def slot_for(site: str, n: int, dtype: torch.dtype) -> torch.Tensor | None:
            return slot((b, n), dtype, h.device)[1] if slot is not None and f"{kind}/{site}" in in_place else None

        lg_out = slot_for("moe.gate_down" if fused else "moe.router_gemm", w["gate"].shape[0], logits_dtype)
        x_out = slot_for("moe.gate_down" if fused else "moe.latent_down", w["down"].shape[0], h.dtype)
        if fused:  # both from one weight stream, one kernel
            logits, x = ops[f"{kind}/moe.gate_down"](h, w["gate_down"], w["gate"].shape[0], logits_out=lg_out,
                                                     latent_out=x_out)
        elif self.router_side is not None and b >= ROUTER_SIDE_MIN_BATCH:  # a graph branch, joined before the router
            routing = self.router_side.run(ops[f"{kind}/moe.router_gemm"], h, w["gate"], out_dtype=logits_dtype,
                                           out=lg_out)
            x = ops[f"{kind}/moe.latent_down"](h, w["down"], out=x_out)
            logits = routing.join()
        else:
            logits = ops[f"{kind}/moe.router_gemm"](h, w["gate"], out_dtype=logits_dtype, out=lg_out)
            x = ops[f"{kind}/moe.latent_down"](h, w["down"], out=x_out)
        if late:
            pending = fork_shared()
        if self.tp > 1:
            logits, x = self._communicate(f"{kind}/moe.all_gather", b, gather_parts, self.comm, [logits, x])
        weights, ids = ops[f"{kind}/moe.router"](logits, w["bias"], f.top_k, f.router)
        y = ops[f"{kind}/moe.experts"](x, weights, ids, w["w13"], w["w2"], f.activation)  # partial at TP > 1
        # all-reduce of the experts' partial latent, fused with the latent RMSNorm (no residual: zeros)
        normed, y = ops[f"{kind}/moe.latent_allreduce"](y, self.zeros[:b, :y.shape[-1]], w.get("latent_norm"), eps,
                                                         comm=self.site_comms(b, f"{kind}/moe.latent_allreduce"))
        y = y if normed is None else normed
        if pending is not None:
            shared = pending.join()
        else:
            shared = ops[f"{kind}/moe.shared"](h, w["shared_gate_up"], w["shared_down"], f.activation) \
                if f.num_shared_experts else None
        lo, hi = self.h_lo, self.h_hi
        if self.tp == 1:
            return ops[f"{kind}/moe.latent_up"](y, w["up"], residual=shared)
        # only this rank's hidden slice gets the up-projection, so the FFN all-reduce counts it once;
        # the shared experts' output is this step's own tensor: the slice is written into it in place
        if shared is None:
            shared = h.new_zeros(b, self.spec.hidden_size)
        part = shared[:, lo:hi]  # [b, H/tp] rows of stride H: the gemm contract takes strided rows
        ops[f"{kind}/moe.latent_up"](y, w["up"], residual=part, out=part)  # adds and writes in place
        return shared
