"""Architecture building blocks shared by every adapter.

A model is a :class:`ModelSpec`: hidden size, vocabulary, and one :class:`LayerSpec` per decoder
layer, each made of an attention block (KDA, MLA, GQA, sparse MQA) and a feed-forward block (dense
MLP or MoE). All specs are frozen pydantic models with ``extra="forbid"``; their field docstrings
are the documentation. ``shard(tp)`` gives the per-rank shapes of tensor parallelism and refuses,
with the fix in the message, a TP size the architecture cannot be split by.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from latency_specialized.errors import UserError


class Frozen(BaseModel):
    """Base of every spec: immutable, hashable, unknown keys rejected, docstrings as descriptions."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


def _split(total: int, tp: int, what: str, owner: str) -> int:
    if tp < 1:
        raise UserError(f"TP={tp} is not valid: use a positive tensor-parallel size")
    if total % tp:
        raise UserError(f"TP={tp} not supported: {owner} needs {total} {what} divisible by TP")
    return total // tp


# --------------------------------------------------------------------------------------------
# Attention kinds
# --------------------------------------------------------------------------------------------


class KDAAttentionSpec(Frozen):
    """Kimi Delta Attention: gated delta-rule linear attention with a fixed-size fp32 state."""

    kind: Literal["kda"] = "kda"
    num_heads: int
    """Query/key/value heads (all equal in KDA)."""
    head_dim: int
    """Width of one head; the recurrent state per head is head_dim x head_dim fp32."""
    conv_kernel: int = 4
    """Width of the short causal convolution on q, k, v (state keeps conv_kernel-1 tokens)."""
    decay_rank: int = 128
    """Rank of the low-rank decay input f_a (decay = f_b_proj(f_a))."""
    gate_lower_bound: float = -5.0
    """Lower bound of the per-channel log-decay g = lb * sigmoid(exp(A_log) * (f + dt_bias))."""

    def shard(self, tp: int, owner: str = "model") -> "KDAAttentionSpec":
        return self.model_copy(update={"num_heads": _split(self.num_heads, tp, "KDA heads", owner)})

    def state_bytes_per_sequence(self) -> int:
        """fp32 recurrent state plus the conv tail (bf16) of one sequence, this shard."""
        rec = self.num_heads * self.head_dim * self.head_dim * 4
        conv = 3 * self.num_heads * self.head_dim * (self.conv_kernel - 1) * 2
        return rec + conv


class IndexerSpec(Frozen):
    """Lightning-indexer of DSA-style sparse attention: scores every cached token, keeps top-k."""

    num_heads: int
    """Indexer heads."""
    head_dim: int
    """Width of one indexer head."""
    topk: int
    """Tokens each query attends to."""
    full_layers: tuple[int, ...] = ()
    """Layers (0-based) that run their own indexer; other layers reuse the latest full one's top-k."""


class MLAAttentionSpec(Frozen):
    """Multi-head latent attention (absorbed form at decode) over a paged latent KV cache."""

    kind: Literal["mla"] = "mla"
    num_heads: int
    """Query heads."""
    q_lora_rank: int | None
    """Rank of the query down-projection (None: direct q projection)."""
    kv_lora_rank: int
    """Width of the compressed latent KV."""
    qk_nope_head_dim: int
    """Per-head query/key width without position encoding."""
    qk_rope_head_dim: int
    """Per-head decoupled key width (RoPE part; present in the cache even when RoPE is off)."""
    v_head_dim: int
    """Per-head value width."""
    use_rope: bool = True
    """False for NoPE MLA (Kimi K3): the rope part exists but is not rotated."""
    rope_theta: float | None = None
    """RoPE base when use_rope."""
    rope_interleaved: bool = False
    """Interleaved (GLM) instead of half-split rotary layout."""
    output_gate: Literal["none", "sigmoid"] = "none"
    """Elementwise gate applied to the attention output before o_proj."""
    indexer: IndexerSpec | None = None
    """DSA top-k indexer (GLM-5.3); None for dense MLA."""

    def shard(self, tp: int, owner: str = "model") -> "MLAAttentionSpec":
        return self.model_copy(update={"num_heads": _split(self.num_heads, tp, "MLA heads", owner)})

    @property
    def latent_width(self) -> int:
        """Values cached per token: compressed KV plus the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class SparseMQAAttentionSpec(Frozen):
    """DeepSeek-V4-style sparse MQA over compressed KV with a sliding window and attention sinks."""

    kind: Literal["sparse_mqa"] = "sparse_mqa"
    num_heads: int
    """Query heads (one shared KV head)."""
    head_dim: int
    """Width of the single KV head (includes rope_dim)."""
    rope_dim: int
    """Part of head_dim that is rotated."""
    q_lora_rank: int
    """Rank of the query down-projection."""
    o_groups: int
    """Groups of the grouped low-rank output projection."""
    o_lora_rank: int
    """Rank of each output group."""
    sliding_window: int
    """Window of raw (uncompressed) KV every layer attends to."""
    compress_ratio: int
    """KV compression ratio of this layer (0: window only, 1: full length, 2: ratio 2)."""
    indexer: IndexerSpec | None = None
    """Top-k indexer over compressed KV, present on layers that run one."""

    def shard(self, tp: int, owner: str = "model") -> "SparseMQAAttentionSpec":
        heads = _split(self.num_heads, tp, "query heads", owner)
        # Each rank must hold whole output groups: a group's low-rank projection reads all of its
        # heads, so TP > o_groups would split a group across ranks (vLLM asserts the same).
        groups = _split(self.o_groups, tp, "output groups", owner)
        return self.model_copy(update={"num_heads": heads, "o_groups": groups})


class GQAAttentionSpec(Frozen):
    """Grouped-query attention over a paged KV cache, optionally windowed and RoPE-free."""

    kind: Literal["gqa"] = "gqa"
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads."""
    head_dim: int
    """Width of one head."""
    sliding_window: int | None = None
    """Window in tokens; None for full attention."""
    rope_theta: float | None = None
    """RoPE base; None for NoPE layers."""
    qk_norm: bool = False
    """Weightless RMSNorm on q and k per head."""
    softmax_scale: float | None = None
    """Scale of q.k; None means 1/sqrt(head_dim)."""
    output_gate: Literal["none", "sigmoid"] = "none"
    """Elementwise gate on the attention output before o_proj."""

    def shard(self, tp: int, owner: str = "model") -> "GQAAttentionSpec":
        heads = _split(self.num_heads, tp, "query heads", owner)
        kv = self.num_kv_heads // tp if self.num_kv_heads >= tp else 1  # KV heads replicate past TP=kv
        if self.num_kv_heads >= tp and self.num_kv_heads % tp:
            raise UserError(f"TP={tp} not supported: {owner} needs {self.num_kv_heads} KV heads divisible by TP")
        return self.model_copy(update={"num_heads": heads, "num_kv_heads": kv})


AttentionSpec = Annotated[
    Union[KDAAttentionSpec, MLAAttentionSpec, SparseMQAAttentionSpec, GQAAttentionSpec],
    Field(discriminator="kind"),
]

# --------------------------------------------------------------------------------------------
# Feed-forward kinds
# --------------------------------------------------------------------------------------------


class ActivationSpec(Frozen):
    """Gated activation of an MLP/expert: act(gate) * lin(up)."""

    kind: Literal["swiglu", "situ_glu"] = "swiglu"
    """swiglu: silu(g)*u (optionally clamped); situ_glu: b*tanh(g/b)*sigmoid(g) * bl*tanh(u/bl)."""
    beta: float | None = None
    """SiTU-GLU gate saturation (Kimi K3: 4)."""
    beta_lin: float | None = None
    """SiTU-GLU linear-branch saturation (Kimi K3: 25)."""
    clamp: float | None = None
    """SwiGLU clamp limit (DeepSeek-V4: 10); None: no clamp."""

    @model_validator(mode="after")
    def _check(self) -> "ActivationSpec":
        if self.kind == "situ_glu" and (self.beta is None or self.beta_lin is None):
            raise ValueError("situ_glu needs beta and beta_lin: set both (Kimi K3 uses 4 and 25)")
        return self


class RouterSpec(Frozen):
    """How router logits become top-k expert weights."""

    score_func: Literal["sigmoid", "sqrtsoftplus", "softmax"]
    """Score of each expert from its logit."""
    logit_scale: float = 1.0
    """Logits are multiplied by this before scoring (Muse Spark: 2**-2.5)."""
    bias_corrected: bool = True
    """Selection uses score + per-expert bias (noaux_tc); weights use the unbiased score."""
    renormalize: bool = True
    """Selected weights are divided by their sum."""
    renormalize_eps: float = 0.0
    """Added to the sum before renormalising (Muse Spark: 1e-15)."""
    routed_scaling: float = 1.0
    """Final multiplier of the routed weights."""
    fp32: bool = True
    """fp32 router logits (the GEMM accumulates and outputs fp32 from the stored weight, as vLLM's
    GateLinear with out_dtype=float32) and fp32 scoring."""


ExpertFormat = Literal["mxfp4", "mxfp4-deepseek", "nvfp4", "fp8-block-128"]
"""Stored formats routed experts can stay in on the device (``quant.FORMATS`` names)."""
EXPERT_FORMATS: tuple[str, ...] = ("mxfp4", "mxfp4-deepseek", "nvfp4", "fp8-block-128")
_EXPERT_SPLIT = {"nvfp4": 16, "fp8-block-128": 128}
"""Granularity a TP slice of the expert width must keep (a scale group / block; default 32: MX formats)."""


class MoESpec(Frozen):
    """Routed mixture of experts with optional shared experts and an optional latent width."""

    kind: Literal["moe"] = "moe"
    num_experts: int
    """Routed experts."""
    top_k: int
    """Experts selected per token."""
    num_shared_experts: int
    """Always-on experts (0 for none); run as one MLP of num_shared * expert_intermediate."""
    expert_intermediate: int
    """Intermediate width of one expert."""
    latent_dim: int | None = None
    """Latent MoE: experts run at this width between a down-projection (+RMSNorm) and an up-projection."""
    activation: ActivationSpec = ActivationSpec()
    """Expert activation."""
    router: RouterSpec
    """Routing function."""
    expert_format: ExpertFormat | None = None
    """The routed experts stay on the device in this stored format (``quant.FORMATS``; the
    ``moe.experts`` site's ``weight_format``); None: in the activation dtype (a quantized checkpoint is
    dequantised at load)."""

    @model_validator(mode="after")
    def _check(self) -> "MoESpec":
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        return self

    def shard(self, tp: int, owner: str = "model") -> "MoESpec":
        inter = _split(self.expert_intermediate, tp, "expert intermediate width", owner)
        group = _EXPERT_SPLIT.get(self.expert_format or "", 32)
        partial = self.expert_format == "fp8-block-128" and tp == 1  # FP8 blocks may be partial; uncut at TP1
        if self.expert_format and inter % group and not partial:
            raise UserError(f"TP={tp} not supported by {owner}'s {self.expert_format} experts: a rank's "
                            f"{inter}-wide slice of the {self.expert_intermediate} intermediate width cuts their "
                            f"{group}-value scale groups; pick a TP that leaves multiples of {group}")
        return self.model_copy(update={"expert_intermediate": inter})


class DenseMLPSpec(Frozen):
    """Dense gated MLP."""

    kind: Literal["dense"] = "dense"
    intermediate: int
    """Intermediate width."""
    activation: ActivationSpec = ActivationSpec()
    """Gated activation."""

    def shard(self, tp: int, owner: str = "model") -> "DenseMLPSpec":
        return self.model_copy(update={"intermediate": _split(self.intermediate, tp, "MLP intermediate width", owner)})


FFNSpec = Annotated[Union[MoESpec, DenseMLPSpec], Field(discriminator="kind")]

# --------------------------------------------------------------------------------------------
# Norms, residual streams, layers, models
# --------------------------------------------------------------------------------------------


class NormSpec(Frozen):
    """RMSNorm variant."""

    eps: float = 1e-6
    """Epsilon inside the rsqrt."""
    zero_centered: bool = False
    """Gain is (1 + w) instead of w."""


class ResidualSpec(Frozen):
    """How sublayer outputs are combined into the residual stream."""

    kind: Literal["pre_norm", "attnres", "mhc", "gated"] = "pre_norm"
    """pre_norm: x + f(norm(x)); attnres: block attention residuals (Kimi K3); mhc: hyper-connections
    (DeepSeek-V4); gated: norm-preserving sigmoid gates (Muse Spark)."""
    block_size: int | None = None
    """attnres: sublayers per block."""
    max_cached_blocks: int | None = None
    """attnres: completed blocks kept for mixing."""
    streams: int | None = None
    """mhc: parallel residual streams."""
    sinkhorn_iters: int | None = None
    """mhc: Sinkhorn iterations of the mixing matrix."""


class LayerSpec(Frozen):
    """One decoder layer: attention block then feed-forward block."""

    index: int
    """0-based layer index."""
    attention: AttentionSpec
    """Attention block."""
    ffn: FFNSpec
    """Feed-forward block."""

    @property
    def kind(self) -> str:
        """Short name of the layer kind, e.g. 'kda+moe'."""
        return f"{self.attention.kind}+{self.ffn.kind}"


MAX_SPEC_TOKENS = 7
"""Most draft tokens per request of a verification step (DSpark's 7: rows up to 64 x 8). Pieces whose
per-sequence rings a verification step writes ahead of its readers (a sliding window, a compressor's pending
group) keep this many rows more in every program, so their states do not depend on the deployment's k."""


LINEAR_FORMATS: tuple[str, ...] = ("fp8-block-128", "fp8-block-32")
"""Stored formats dense projections can stay in on the device (``quant.FORMATS`` names the block-FP8 gemms serve)."""


class LinearFormat(Frozen):
    """The dense projections (attention, dense MLPs, shared experts) kept on the device as the checkpoint stores
    them: every gemm / mlp site whose weight parts are all stored in ``format`` carries it as ``weight_format``;
    a site joining any ``plain`` part - or one whose op takes the activation dtype only (e.g. absorbed MLA's
    ``kv_b``) - gets its weight dequantised when the program binds it."""

    format: Literal["fp8-block-128", "fp8-block-32"]
    """How the stored projections are kept (``quant.FORMATS``)."""
    plain: tuple[str, ...] = ()
    """Piece-local weight names the checkpoint stores in the activation dtype (e.g. GLM-5.3's indexer
    ``weights_proj``): a fused site containing one stays unquantised."""

    def kept(self, *parts: str) -> str | None:
        """The ``weight_format`` of a site whose weight joins ``parts`` (piece-local names): ``format`` where none
        of them is plain, else None."""
        return None if any(p in self.plain for p in parts) else self.format


class ModelSpec(Frozen):
    """A decoder-only model as the backend sees it (full or per-rank shapes)."""

    name: str
    """Adapter name, e.g. 'kimi_k3'."""
    variant: str = "full"
    """'full' for the real architecture, 'tiny' for the test-sized one."""
    hidden_size: int
    """Width of the residual stream."""
    vocab_size: int
    """Vocabulary."""
    max_context: int
    """Longest context the architecture supports."""
    layers: tuple[LayerSpec, ...]
    """Decoder layers in order."""
    norm: NormSpec = NormSpec()
    """Default RMSNorm of the model."""
    residual: ResidualSpec = ResidualSpec()
    """Residual-stream kind."""
    tp: int = 1
    """Tensor-parallel size these shapes are for (1: unsharded)."""
    spec_tokens: int = 0
    """Most draft tokens per request of the verification steps (speculative decoding) the program is built
    for (0: plain decode steps only). A deployment choice: pieces with per-sequence recurrent states keep
    rollback tapes for that many tokens (e.g. KDA), paged attention needs nothing more."""
    linear_format: LinearFormat | None = None
    """Dense projections kept in a stored format (``LinearFormat``); None: in the activation dtype (a quantized
    checkpoint is dequantised at load)."""

    def with_spec_tokens(self, k: int) -> "ModelSpec":
        """This spec for verification steps of up to ``k`` draft tokens (``spec_tokens``)."""
        if not 0 <= k <= MAX_SPEC_TOKENS:
            raise UserError(f"{k} speculative tokens: use 0 to {MAX_SPEC_TOKENS} (MAX_SPEC_TOKENS: the draft rows "
                            "a verification step's ops and windowed rings are built for)")
        return self.model_copy(update={"spec_tokens": k})

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_kinds(self) -> dict[str, tuple[int, ...]]:
        """Layer kind -> layer indices (in order), e.g. {'kda+moe': (1, 2, ...)}."""
        kinds: dict[str, list[int]] = {}
        for layer in self.layers:
            kinds.setdefault(layer.kind, []).append(layer.index)
        return {k: tuple(v) for k, v in kinds.items()}

    def shard(self, tp: int) -> "ModelSpec":
        """Per-rank shapes at tensor-parallel size ``tp`` (raises UserError naming the fix)."""
        if self.tp != 1:
            raise UserError(f"{self.name}: spec is already sharded for TP={self.tp}; shard the full spec")
        layers = tuple(
            layer.model_copy(
                update={"attention": layer.attention.shard(tp, self.name), "ffn": layer.ffn.shard(tp, self.name)}
            )
            for layer in self.layers
        )
        return self.model_copy(update={"layers": layers, "tp": tp})

    def with_expert_format(self, fmt: str | None) -> "ModelSpec":
        """This spec with every MoE layer's routed experts kept in the stored format ``fmt``
        (``MoESpec.expert_format``; None: dequantised to the activation dtype)."""
        if fmt not in (None, *EXPERT_FORMATS):
            raise UserError(f"{self.name}: routed experts cannot be kept as {fmt!r}; use one of "
                            f"{', '.join(EXPERT_FORMATS)} (or none: dequantised at load)")
        layers = tuple(layer.model_copy(update={"ffn": layer.ffn.model_copy(update={"expert_format": fmt})})
                       if isinstance(layer.ffn, MoESpec) else layer for layer in self.layers)
        return self.model_copy(update={"layers": layers})

    def with_linear_format(self, fmt: LinearFormat | None) -> "ModelSpec":
        """This spec with its dense projections kept as ``fmt`` says (``linear_format``; None: dequantised)."""
        return self.model_copy(update={"linear_format": fmt})

    def kept_linear(self, *parts: str) -> str | None:
        """The ``weight_format`` of a projection site joining the piece-local weights ``parts`` (None: the
        activation dtype) - what a piece puts on its gemm / mlp sites and its weight declarations."""
        return self.linear_format.kept(*parts) if self.linear_format is not None else None


class ParallelSpec(Frozen):
    """How one model instance is split across GPUs."""

    tp: int = 1
    """Tensor-parallel size."""
    dcp: int = 1
    """Decode context parallelism: KV cache split across this many of the TP ranks."""

    @model_validator(mode="after")
    def _check(self) -> "ParallelSpec":
        if self.tp < 1:
            raise ValueError(f"tp={self.tp}: use a positive tensor-parallel size")
        if self.dcp < 1 or self.tp % self.dcp:
            raise ValueError(f"dcp={self.dcp} must divide tp={self.tp}")
        return self


DType = Literal["bfloat16", "float16", "float32"]


class Deployment(Frozen):
    """What a decode step is asked to run on (checked against a DecodeScope)."""

    arch: str = "cpu"
    """GPU arch ('sm_90', 'sm_100', 'sm_103', ...) or 'cpu'."""
    tp: int = 1
    """Tensor-parallel size."""
    batch: int = 1
    """Sequences decoded per step."""
    dtype: DType = "bfloat16"
    """Activation dtype."""
    spec_tokens: int = 0
    """Speculative draft tokens verified per sequence per step."""
    cuda_graphs: bool = True
    """Whether the decode step may be captured into CUDA graphs."""
    context: int | None = None
    """Longest sequence (prompt + generated tokens) the deployment serves; None: not given (plans then
    carry no length, see ``ops.plan.build_plan``)."""


class DecodeScope(Frozen):
    """What an adapter's fast decode path supports; outside it the stock path runs."""

    archs: tuple[str, ...]
    """Archs the fast path runs on ('cpu' allows the reference-backed path used in tests)."""
    tp_sizes: tuple[int, ...]
    """Supported tensor-parallel sizes."""
    max_batch: int = 64
    """Largest batch decoded by the fast path."""
    dtypes: tuple[DType, ...] = ("bfloat16",)
    """Activation dtypes."""
    spec_tokens: tuple[int, ...] = (0,)
    """Supported numbers of speculative tokens per step."""
    needs_cuda_graphs: bool = False
    """True when the fast path is only correct/fast inside CUDA graphs."""

    def problems(self, d: Deployment, model: str = "model", max_context: int | None = None) -> list[str]:
        """Every requirement ``d`` misses, one phrase each naming the fix (empty: in scope).

        ``max_context``: the longest context of the model's architecture (``ModelSpec.max_context``); a
        ``d.context`` beyond it is out of scope (the scope itself does not know the spec)."""
        out: list[str] = []
        if d.arch not in self.archs:
            out.append(f"arch {d.arch} not supported (use one of {', '.join(self.archs)})")
        if d.tp not in self.tp_sizes:
            out.append(f"TP={d.tp} not supported (use one of {list(self.tp_sizes)})")
        if not 1 <= d.batch <= self.max_batch:
            out.append(f"batch {d.batch} beyond the scope (use 1..{self.max_batch}; larger batches run stock)")
        if d.dtype not in self.dtypes:
            out.append(f"dtype {d.dtype} not supported (use {', '.join(self.dtypes)})")
        if d.spec_tokens not in self.spec_tokens:
            out.append(f"{d.spec_tokens} speculative tokens not supported (use one of {list(self.spec_tokens)})")
        if self.needs_cuda_graphs and not d.cuda_graphs:
            out.append("CUDA graphs are off (drop --enforce-eager)")
        if d.context is not None and d.context < 1:
            out.append(f"context {d.context} is not valid (use a context of 1..{max_context or 'max_context'} tokens)")
        elif d.context is not None and max_context is not None and d.context > max_context:
            out.append(f"context {d.context} beyond {model}'s longest context {max_context} "
                       f"(use a context of at most {max_context} tokens)")
        return out
