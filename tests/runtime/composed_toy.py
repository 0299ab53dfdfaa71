"""A toy composed model from the simple pieces, and an independent plain-torch decode step for it.

The model (hidden 64, vocab 96, 4 layers, 3 layer kinds) uses every option of the simple pieces:

* kind ``A+dense`` (layer 0): GQA 4 heads / 2 KV heads, weighted QK norm, NeoX RoPE (Qwen3's attention);
  dense SwiGLU MLP;
* kind ``A+moe`` (layers 1, 3): the same attention; a Qwen3-MoE router (softmax, top-2 of 8,
  renormalised, activation-dtype logits) replicated across ranks;
* kind ``B+moe`` (layer 2): MQA (1 KV head: replicated at TP=2), weightless QK norm, interleaved partial
  RoPE (8 of 16 channels), sliding window 5, attention sinks, sigmoid output gate, softmax scale 0.2;
  a sigmoid router with selection bias, routed scaling 2, fp32 logits, split across ranks, and a
  shared expert.

``ToyReference`` is written from the math, not from the pieces or the op references: per sequence,
with its own unpaged KV history, float64 arithmetic rounded to the activation dtype at the points a
bf16 serving stack rounds (after every projection, norm, rotation, attention, activation, residual
add). ``composed_world`` is the per-rank body of the TP=2 test (gloo processes).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from latency_specialized.adapter import ModelAdapter
from latency_specialized.pieces import DenseMLP, GQAAttention, LMHead, PreNormResidual, RoutedMoE, TokenEmbedding
from latency_specialized.runtime.composed import MODEL, ComposedModel, LayerPieces
from latency_specialized.spec import (DecodeScope, DenseMLPSpec, GQAAttentionSpec, LayerSpec, ModelSpec, MoESpec,
                                      NormSpec, RouterSpec)

HIDDEN, VOCAB = 64, 96
ATTN_A = GQAAttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, qk_norm=True)
ATTN_B = GQAAttentionSpec(num_heads=4, num_kv_heads=1, head_dim=16, rope_theta=500.0, qk_norm=True, sliding_window=5,
                          softmax_scale=0.2, output_gate="sigmoid")
DENSE = DenseMLPSpec(intermediate=64)
MOE_QWEN = MoESpec(num_experts=8, top_k=2, num_shared_experts=0, expert_intermediate=32,
                   router=RouterSpec(score_func="softmax", bias_corrected=False, renormalize=True, fp32=False))
MOE_SIG = MoESpec(num_experts=8, top_k=2, num_shared_experts=1, expert_intermediate=32,
                  router=RouterSpec(score_func="sigmoid", bias_corrected=True, renormalize=True, routed_scaling=2.0,
                                    fp32=True))
EPS = 1e-5


def toy_spec() -> ModelSpec:
    layers = (LayerSpec(index=0, attention=ATTN_A, ffn=DENSE), LayerSpec(index=1, attention=ATTN_A, ffn=MOE_QWEN),
              LayerSpec(index=2, attention=ATTN_B, ffn=MOE_SIG), LayerSpec(index=3, attention=ATTN_A, ffn=MOE_QWEN))
    return ModelSpec(name="toy_composed", variant="tiny", hidden_size=HIDDEN, vocab_size=VOCAB, max_context=256,
                     layers=layers, norm=NormSpec(eps=EPS))


def toy_model(tied: bool = False) -> ComposedModel:
    spec = toy_spec()
    a = GQAAttention(ATTN_A, qk_norm="weighted")
    b = GQAAttention(ATTN_B, qk_norm="weightless", rope_style="interleaved", rotary_dim=8, sinks=True)
    qwen = RoutedMoE(MOE_QWEN, router_split=False)
    sig = RoutedMoE(MOE_SIG)
    layers = [LayerPieces(0, "A+dense", a, DenseMLP(DENSE)), LayerPieces(1, "A+moe", a, qwen),
              LayerPieces(2, "B+moe", b, sig), LayerPieces(3, "A+moe", a, qwen)]
    return ComposedModel(spec, TokenEmbedding(), PreNormResidual(), layers, LMHead(tied=tied))


class ToyAdapter(ModelAdapter):
    """Just enough of an adapter for ``build_plan``: the toy's spec, a scope, the model's sites."""

    name: ClassVar[str] = "toy_composed"

    def __init__(self, model: ComposedModel):
        self.model = model

    def spec(self, variant: str = "full") -> ModelSpec:
        return self.model.spec

    def scope(self) -> DecodeScope:
        return DecodeScope(archs=("cpu",), tp_sizes=(1, 2), max_batch=8, dtypes=("float32", "bfloat16"))

    def op_sites(self, spec, parallel, tokens, arch, dtype):
        return self.model.op_sites(spec, parallel, tokens, arch, dtype)


def random_weights(model: ComposedModel, seed: int, dtype: torch.dtype) -> dict:
    """Fresh random full weights ``{layer: {role: {local: tensor}}}`` at serving-like scales."""
    g = torch.Generator().manual_seed(seed)
    out: dict = {}
    for (layer, role, local), d in model.weight_decls(1).items():
        x = torch.randn(d.shape, generator=g, dtype=torch.float64)
        if "norm" in local:
            t = 1.0 + 0.2 * x
        elif local == "router_bias":
            t = 0.3 * x
        elif local == "sinks":
            t = x
        elif role == "embed":
            t = x
        elif local == "router":
            t = 3.0 * x / math.sqrt(d.shape[-1])  # well separated routing scores
        else:
            t = x / math.sqrt(d.shape[-1])
        out.setdefault(layer, {}).setdefault(role, {})[local] = t.to(torch.float32 if d.dtype == "float32" else dtype)
    return out


# ---------------------------------------------------------------------------------------------- reference
class ToyReference:
    """Independent decode of the toy model, one sequence at a time (see the module docstring)."""

    def __init__(self, model: ComposedModel, weights: dict, dtype: torch.dtype):
        self.model, self.w, self.dtype = model, weights, dtype
        self.history: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        """(layer, sequence) -> (keys, values): [KV, D] float64 per token, position order."""

    def r(self, t: torch.Tensor) -> torch.Tensor:
        """Round to the activation dtype (kept as float64 for the next op)."""
        return t.to(self.dtype).to(torch.float64)

    def W(self, layer: int, role: str, local: str) -> torch.Tensor:
        return self.w[layer][role][local].to(torch.float64)

    def rms(self, x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS)
        return self.r(y * w if w is not None else y)

    @staticmethod
    def rope(x: torch.Tensor, pos: int, theta: float, rot: int, interleaved: bool) -> torch.Tensor:
        """x [heads, D] float64 rotated as complex numbers (pairs per style) by pos * theta^(-2i/rot)."""
        freqs = pos * theta ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
        turn = torch.polar(torch.ones_like(freqs), freqs)
        part = x[:, :rot]
        if interleaved:
            c = torch.view_as_complex(part.reshape(x.shape[0], rot // 2, 2).contiguous()) * turn
            rotated = torch.view_as_real(c).reshape(x.shape[0], rot)
        else:
            c = torch.complex(part[:, : rot // 2], part[:, rot // 2:]) * turn
            rotated = torch.cat([c.real, c.imag], dim=-1)
        return torch.cat([rotated, x[:, rot:]], dim=-1)

    def attention(self, i: int, seq: int, x: torch.Tensor, pos: int) -> torch.Tensor:
        piece = self.model.layers[i].attention
        a: GQAAttentionSpec = piece.spec
        Hq, KV, D = a.num_heads, a.num_kv_heads, a.head_dim
        q = self.r(x @ self.W(i, "attn", "q_proj").T).view(Hq, D)
        k = self.r(x @ self.W(i, "attn", "k_proj").T).view(KV, D)
        v = self.r(x @ self.W(i, "attn", "v_proj").T).view(KV, D)
        if piece.qk_norm == "weighted":
            q, k = self.rms(q, self.W(i, "attn", "q_norm")), self.rms(k, self.W(i, "attn", "k_norm"))
        elif piece.qk_norm == "weightless":
            q, k = self.rms(q, None), self.rms(k, None)
        rot = piece.rotary_dim or D
        q = self.r(self.rope(q, pos, a.rope_theta, rot, piece.rope_style == "interleaved"))
        k = self.r(self.rope(k, pos, a.rope_theta, rot, piece.rope_style == "interleaved"))
        keys, values = self.history.setdefault((i, seq), ([], []))
        keys.append(k)
        values.append(v)
        start = max(0, len(keys) - a.sliding_window) if a.sliding_window else 0
        K, V = torch.stack(keys[start:]), torch.stack(values[start:])       # [n, KV, D]
        scale = a.softmax_scale if a.softmax_scale is not None else D ** -0.5
        group = Hq // KV
        o = torch.empty(Hq, D, dtype=torch.float64)
        for h in range(Hq):
            s = (K[:, h // group] @ q[h]) * scale
            e = torch.exp(s - s.max())
            denom = e.sum()
            if piece.sinks:
                denom = denom + torch.exp(self.W(i, "attn", "sinks")[h] - s.max())
            o[h] = (e / denom) @ V[:, h // group]
        o = self.r(o.reshape(-1))
        if a.output_gate == "sigmoid":
            g = self.r(x @ self.W(i, "attn", "g_proj").T)
            o = self.r(o * torch.sigmoid(g))
        return self.r(o @ self.W(i, "attn", "o_proj").T)

    def mlp(self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        g, u = self.r(x @ gate.T), self.r(x @ up.T)
        return self.r(self.r(torch.nn.functional.silu(g) * u) @ down.T)

    def ffn(self, i: int, x: torch.Tensor) -> torch.Tensor:
        piece = self.model.layers[i].ffn
        W = lambda n: self.W(i, "ffn", n)  # noqa: E731
        if isinstance(piece, DenseMLP):
            return self.mlp(x, W("gate_proj"), W("up_proj"), W("down_proj"))
        f: MoESpec = piece.spec
        logits = x @ W("router").T
        logits = logits.to(torch.float32).to(torch.float64) if f.router.fp32 else self.r(logits)
        scores = torch.softmax(logits, -1) if f.router.score_func == "softmax" else torch.sigmoid(logits)
        pick = scores + W("router_bias") if f.router.bias_corrected else scores
        ids = torch.topk(pick, f.top_k).indices
        weights = scores[ids]
        if f.router.renormalize:
            weights = weights / weights.sum()
        weights = weights * f.router.routed_scaling
        y = torch.zeros(HIDDEN, dtype=torch.float64)
        for wgt, e in zip(weights, ids.tolist()):
            y += wgt * self.mlp(x, W("experts.w1")[e], W("experts.w3")[e], W("experts.w2")[e])
        y = self.r(y)
        if f.num_shared_experts:
            y = self.r(y + self.mlp(x, W("shared.gate_proj"), W("shared.up_proj"), W("shared.down_proj")))
        return y

    def decode(self, seq: int, token: int, pos: int) -> torch.Tensor:
        """Logits [vocab] (float64) of ``token`` at ``pos`` of sequence ``seq``; appends to its history."""
        h = self.w[MODEL]["embed"]["weight"][token].to(torch.float64)
        for i in range(len(self.model.layers)):
            x = self.rms(h, self.W(i, "residual", "input_norm"))
            h = self.r(h + self.attention(i, seq, x, pos))
            x = self.rms(h, self.W(i, "residual", "post_norm"))
            h = self.r(h + self.ffn(i, x))
        x = self.rms(h, self.W(MODEL, "residual", "norm"))
        head = self.w[MODEL]["head"].get("weight", self.w[MODEL]["embed"]["weight"]).to(torch.float64)
        return self.r(x @ head.T)


# ---------------------------------------------------------------------------------------------- TP world
def composed_world(rank: int, world_size: int, seed: int, lens: list[int], steps: int) -> dict[str, Any]:
    """One rank of the TP test: the program at TP=world_size from empty caches vs the reference, step by step."""
    from latency_specialized import hardware
    from latency_specialized.comm.base import TorchDistributedCommunicator
    from latency_specialized.ops.plan import build_plan
    from latency_specialized.plugins import get_registry
    from latency_specialized.runtime.buffers import BufferSpec, DecodeBuffers
    from latency_specialized.runtime.composed import ComposedProgram
    from latency_specialized.runtime.states import ModelStates

    torch.manual_seed(0)
    dtype = torch.float32
    model = toy_model()
    comm = TorchDistributedCommunicator()
    w = random_weights(model, seed, dtype)
    ref = ToyReference(model, w, dtype)
    n = len(lens)
    plan = build_plan(ToyAdapter(model), get_registry().implementations, hardware.for_arch("cpu"), tp=world_size,
                      batch=n, dtype="float32", comm=comm)
    states = ModelStates.allocate(model, n, max(lens) + steps + 1, tp=world_size, block_size=4, dtype=dtype,
                                  shuffle_seed=seed)
    prog = ComposedProgram(model, w, plan, states, comm=comm)
    bufs = DecodeBuffers(BufferSpec(max_batch=plan.bucket, max_blocks_per_seq=len(states.slots[0].blocks),
                                    block_size=4, pad_state=0))
    g = torch.Generator().manual_seed(seed + 1)
    positions = [0] * n
    # the first len(s) - 1 steps of each sequence build its history; every step is compared
    tokens = torch.randint(0, VOCAB, (n,), generator=g)
    bufs.load(tokens, positions, [s.row for s in states.slots], states.block_table())
    worst, agree = 0.0, True
    for _ in range(steps):
        bufs.metadata(plan.bucket)
        prog.logits.fill_(float("nan"))
        prog.step(bufs, plan.bucket)
        got = prog.logits[:n].double()
        want = torch.stack([ref.decode(b, int(bufs.tokens[b]), int(bufs.positions[b])) for b in range(n)])
        worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
        agree &= bool(torch.equal(got.argmax(-1), want.argmax(-1)))
        bufs.advance(plan.bucket, torch.randint(0, VOCAB, (plan.bucket,), generator=g))
    return {"rel_err": worst, "argmax_equal": agree, "logits_sum": float(prog.logits[:n].double().sum()),
            "calls": dict(prog.calls), "sites": [c.site.name for c in plan.choices],
            "layers": {c.site.name: len(c.site.layers) for c in plan.called_choices()},
            "k_shape": list(states.layer(2)["k"].shape), "router_rows": list(prog.w_layers[2]["ffn"]["router"].shape),
            "kv_rank_rows": list(prog.w_layers[2]["attn"]["qkv"].shape)}
