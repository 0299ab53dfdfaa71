"""CuTe DSL MoE routing kernels: scores, bias-corrected top-k, renormalise, scale (``moe.router``).

Selection works on 32-bit *ordered keys*: the fp32 selection value ``score + bias`` mapped to an
unsigned integer whose order is the float order; ties go to the lower expert id, as the
reference's stable sort does. Two algorithms (``RouterConfig.sort``):

* **sort** (default up to ``SORT_MAX_TOKENS`` tokens where E <= 1024, top_k <= 16 and the score needs
  no row statistics): one CTA per token, thread ``t`` scores expert ``t``. Every warp sorts its 32
  (key, id) pairs with a bitonic network of shuffles, then a tree of bitonic merges keeps the top 16
  of two lists at a time (one block barrier per level): ~log2(E/32) + 1 short steps. 3.6 us per
  call at batch 1 on the H200 (E=896, top-16).
* **rounds**: one warp per token (or ``split`` warps and a merge at small batches); lane ``l`` owns
  experts ``l, l+32, ...`` (E=896: 28 registers). A round of top-k is two ``redux.sync`` (max key,
  then min expert id among the lanes holding it) and only the winning lane rescans its keys: top_k
  serial rounds (5.9 us at batch 1). Serves softmax scores, larger E or top_k.

In both, the unbiased score of winner ``r`` is recomputed from its logit by lane ``r`` of one warp
with exactly the instructions used for selection, so weights and selection agree bit for bit, and
the two algorithms' outputs are identical. ``M`` is symbolic (one compile per router config).
"""


from dataclasses import dataclass

import torch

from latency_specialized.contract import Implementation, OpContext, Support
from latency_specialized.errors import UserError
from latency_specialized.kernels.compile_cache import cached_compile, compile_unit
from latency_specialized.kernels.dsl_common import compile_options as _compile_options, ptx_of  # noqa: F401
from latency_specialized.kernels.dsl_common import sm90_dsl_support
from latency_specialized.kernels.dsl_common import cutlass_dtype as _cutlass_dtype, dtype_name as _dtype_name
from latency_specialized.spec import RouterSpec

WARPS_PER_CTA = 4
"""Tokens per CTA (one warp each): small CTAs spread a batch of 64 over 16 SMs."""
MAX_TOP_K = 32
"""One lane keeps one selected slot."""


@dataclass(frozen=True)
class RouterConfig:
    """Everything that changes the compiled router kernel (hashable compile-cache key)."""

    num_experts: int
    top_k: int
    score_func: str
    logit_scale: float
    has_bias: bool
    renormalize: bool
    renormalize_eps: float
    routed_scaling: float
    logits_dtype: str
    bias_dtype: str
    ids_dtype: str
    split: int = 1
    """Warps per token. 1: one warp scans all E experts. S > 1 (small batches): S warps each take
    E/S experts and select their own top-k, then warp 0 selects the top-k of the S*k candidates
    (shared memory). A single warp's 16 serial rounds over 28 slots per lane cannot hide latency
    when it is the only warp on the GPU (batch 1); S warps cut each warp's serial work ~S-fold."""
    pdl: bool = True
    """Programmatic dependent launch: launched while the logits' producer drains (it waits before
    reading them) and lets the experts kernel launch early in turn."""
    sort: bool = False
    """One CTA per token, one thread per expert (E <= 1024, top_k <= 16, no softmax): every warp
    bitonic-sorts its 32 (key, id) pairs in registers (15 shuffle stages), then a tree of bitonic
    merges (5 stages each, one block barrier per level) keeps the top 16 of two lists at a time:
    ~log2(E/32) + 1 short steps instead of top_k serial rounds of warp argmax."""


def _build_kernel_class():
    """The kernel class, built lazily so this module imports without nvidia-cutlass-dsl."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Uint32, Uint64
    from cutlass.memory import SmemAllocator

    class RouterKernel:
        def __init__(self, cfg: RouterConfig):
            self.cfg = cfg
            self.slots = (cfg.num_experts + 32 * cfg.split - 1) // (32 * cfg.split)  # experts per lane
            self.cand_slots = (cfg.split * cfg.top_k + 31) // 32  # merge candidates per lane (split > 1)
            self.sort_warps = (cfg.num_experts + 31) // 32          # sort: one thread per expert
            self.sort_stages = [(k >> (d + 1), k) for k in (2, 4, 8, 16, 32) for d in range(k.bit_length() - 1)]
            self.merge_strides = [1 << i for i in range(max(1, self.sort_warps - 1).bit_length())
                                  if (1 << i) < self.sort_warps]

        @cute.jit
        def __call__(self, logits: cute.Tensor, bias: cute.Tensor, w_out: cute.Tensor, ids_out: cute.Tensor,
                     stream):
            m_tokens = logits.shape[0]
            if cutlass.const_expr(self.cfg.sort):
                self.sort_kernel(logits, bias, w_out, ids_out).launch(
                    grid=[m_tokens, 1, 1], block=[32 * self.sort_warps, 1, 1], stream=stream, use_pdl=self.cfg.pdl)
            elif cutlass.const_expr(self.cfg.split == 1):
                grid = (m_tokens + WARPS_PER_CTA - 1) // WARPS_PER_CTA
                self.kernel(logits, bias, w_out, ids_out).launch(
                    grid=[grid, 1, 1], block=[32 * WARPS_PER_CTA, 1, 1], stream=stream, use_pdl=self.cfg.pdl)
            else:
                self.split_kernel(logits, bias, w_out, ids_out).launch(
                    grid=[m_tokens, 1, 1], block=[32 * self.cfg.split, 1, 1], stream=stream, use_pdl=self.cfg.pdl)

        def _pdl_wait(self):
            """Before the first read of the logits (another kernel's output) under PDL."""
            if cutlass.const_expr(self.cfg.pdl):
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()

        @cute.jit
        def _score(self, logit, vmax: Float32, inv_sum: Float32) -> Float32:
            """Score of one expert from its raw logit (softmax needs the row max and 1/sum)."""
            z = Float32(logit) * Float32(self.cfg.logit_scale)
            s = Float32(0.0)
            if cutlass.const_expr(self.cfg.score_func == "sigmoid"):
                s = Float32(1.0) / (Float32(1.0) + cute.math.exp(-z))
            elif cutlass.const_expr(self.cfg.score_func == "sqrtsoftplus"):
                # torch softplus: identity above threshold 20, else log1p(exp(z)).
                sp = z
                if z <= Float32(20.0):
                    sp = cute.math.log1p(cute.math.exp(z))
                s = cute.math.sqrt(sp)
            else:
                s = cute.math.exp(z - vmax) * inv_sum
            return s

        @cute.jit
        def _key(self, sel: Float32) -> Uint32:
            """Unsigned key with the float order; -0.0 maps to +0.0 (they compare equal)."""
            bits = sel.bitcast(Uint32)
            if bits == Uint32(0x80000000):
                bits = Uint32(0)
            key = bits | Uint32(0x80000000)
            if bits >= Uint32(0x80000000):
                key = ~bits
            return key

        def _tree_best(self, keys, below):
            """max over slots of P = key << 8 | 255 - slot, only P < ``below`` when given (0 if none).

            Plain Python (unrolled at trace time) as a pairwise tree: dependency depth log2(slots)."""
            return self._max_below([(keys[i].to(Uint64) << 8) | Uint64(255 - i) for i in range(self.slots)], below)

        @cute.kernel
        def kernel(self, logits: cute.Tensor, bias: cute.Tensor, w_out: cute.Tensor, ids_out: cute.Tensor):
            cfg = self.cfg
            E = cfg.num_experts
            R = self.slots
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            lane = tidx % 32
            m = bidx * WARPS_PER_CTA + tidx // 32
            self._pdl_wait()
            if m < logits.shape[0]:  # warp-uniform
                # 1. logits -> selection keys (padding experts get key 0: never selected while k <= E)
                raw = cute.make_rmem_tensor((R,), Float32)
                for i in cutlass.range_constexpr(R):
                    e = Int32(i * 32) + lane
                    if cutlass.const_expr((i + 1) * 32 <= E):
                        raw[i] = logits[m, e].to(Float32)
                    else:
                        raw[i] = logits[m, cutlass.min(e, Int32(E - 1))].to(Float32)
                vmax = Float32(0.0)
                inv_sum = Float32(1.0)
                if cutlass.const_expr(cfg.score_func == "softmax"):
                    vmax = Float32(-3.0e38)
                    for i in cutlass.range_constexpr(R):
                        if cutlass.const_expr((i + 1) * 32 <= E):
                            vmax = cute.arch.fmax(vmax, raw[i] * Float32(cfg.logit_scale))
                        elif Int32(i * 32) + lane < E:
                            vmax = cute.arch.fmax(vmax, raw[i] * Float32(cfg.logit_scale))
                    vmax = cute.arch.warp_reduction_max(vmax)
                    total = Float32(0.0)
                    for i in cutlass.range_constexpr(R):
                        ex = cute.math.exp(raw[i] * Float32(cfg.logit_scale) - vmax)
                        if cutlass.const_expr((i + 1) * 32 <= E):
                            total = total + ex
                        elif Int32(i * 32) + lane < E:
                            total = total + ex
                    total = cute.arch.warp_reduction_sum(total)
                    inv_sum = Float32(1.0) / total
                keys = cute.make_rmem_tensor((R,), Uint32)
                for i in cutlass.range_constexpr(R):
                    e = Int32(i * 32) + lane
                    sel = self._score(raw[i], vmax, inv_sum)
                    if cutlass.const_expr(cfg.has_bias):
                        sel = sel + bias[cutlass.min(e, Int32(E - 1))].to(Float32)
                    keys[i] = self._key(sel)
                    if cutlass.const_expr((i + 1) * 32 > E):
                        if e >= E:
                            keys[i] = Uint32(0)
                # Lane-local candidates as 64-bit values P = key << 8 | 255 - slot: max picks the largest
                # key and, among equal keys, the lowest slot (= lowest expert id); all P of a lane differ.
                # A lane keeps its best and second best; winners leave a lane in descending P order, so
                # after a lane's second win its next best is the max P below the last one taken (a
                # pairwise-tree rescan, needed ~3 times per token for top-16 of 896 instead of 16).
                best = cute.make_rmem_tensor((2,), Uint64)  # [best, second best]
                best[0] = self._tree_best(keys, None)
                best[1] = self._tree_best(keys, best[0])
                has_second = Int32(1)
                # 2. k rounds of warp argmax: two redux.sync, then the owner promotes or rescans
                my_id = Int32(0)
                for r in cutlass.range(cfg.top_k, unroll=1):  # rolled: 16 unrolled rounds compile slowly
                    packed = best[0]
                    cur = (packed >> 8).to(Uint32)
                    kmax = cute.arch.warp_redux_sync(cur, "umax")
                    cand = Int32(0x7FFFFFFF)
                    if cur == kmax:
                        cand = (Int32(255) - (packed & Uint64(255)).to(Int32)) * 32 + lane
                    win = cute.arch.warp_redux_sync(cand, "min")
                    if lane == r:
                        my_id = win
                    if win % 32 == lane:  # the owner replaces its best
                        if has_second != 0:
                            best[0] = best[1]
                            has_second = Int32(0)
                        else:
                            best[0] = self._tree_best(keys, packed)
                # 3. weights from the unbiased score of each winner; renormalise; scale
                self._weights_out(logits, w_out, ids_out, m, lane, my_id, vmax, inv_sum)

        @cute.jit
        def _weights_out(self, logits: cute.Tensor, w_out: cute.Tensor, ids_out: cute.Tensor, m, lane, my_id,
                         vmax: Float32, inv_sum: Float32):
            """Lane r < top_k holds winner r: its unbiased score, renormalised and scaled, stored."""
            cfg = self.cfg
            s = Float32(0.0)
            if lane < cfg.top_k:
                s = self._score(logits[m, my_id].to(Float32), vmax, inv_sum)
            self._store_weights(w_out, ids_out, m, lane, my_id, s)

        @cute.jit
        def _store_weights(self, w_out: cute.Tensor, ids_out: cute.Tensor, m, lane, my_id, s: Float32):
            """Lane r < top_k: winner r's unbiased score ``s`` renormalised over the lanes, scaled, stored."""
            cfg = self.cfg
            w = s
            if cutlass.const_expr(cfg.renormalize):
                denom = cute.arch.warp_reduction_sum(s) + Float32(cfg.renormalize_eps)
                w = s / denom
            w = w * Float32(cfg.routed_scaling)
            if lane < cfg.top_k:
                w_out[m, lane] = w
                ids_out[m, lane] = my_id.to(ids_out.element_type)

        @cute.kernel
        def split_kernel(self, logits: cute.Tensor, bias: cute.Tensor, w_out: cute.Tensor, ids_out: cute.Tensor):
            """One token per CTA of ``split`` warps (no softmax: scores need no row statistics)."""
            cfg = self.cfg
            E = cfg.num_experts
            S = cfg.split
            R = self.slots
            C = S * cfg.top_k
            tidx, _, _ = cute.arch.thread_idx()
            m, _, _ = cute.arch.block_idx()
            lane = tidx % 32
            wid = tidx // 32
            smem = SmemAllocator()
            s_key = smem.allocate_tensor(Uint32, cute.make_layout(C), byte_alignment=16)
            s_id = smem.allocate_tensor(Int32, cute.make_layout(C), byte_alignment=16)
            self._pdl_wait()
            vmax = Float32(0.0)
            inv_sum = Float32(1.0)
            # 1. this warp's experts e = (i*S + wid)*32 + lane -> selection keys (e >= E: key 0)
            keys = cute.make_rmem_tensor((R,), Uint32)
            for i in cutlass.range_constexpr(R):
                e = (Int32(i * S) + wid) * 32 + lane
                ec = cutlass.min(e, Int32(E - 1))
                sel = self._score(logits[m, ec].to(Float32), vmax, inv_sum)
                if cutlass.const_expr(cfg.has_bias):
                    sel = sel + bias[ec].to(Float32)
                keys[i] = self._key(sel)
                if cutlass.const_expr((i + 1) * S * 32 > E):
                    if e >= E:
                        keys[i] = Uint32(0)
            # 2. the warp's own top-k (as the one-warp kernel, over R slots per lane)
            best = cute.make_rmem_tensor((2,), Uint64)
            best[0] = self._tree_best(keys, None)
            best[1] = self._tree_best(keys, best[0])
            has_second = Int32(1)
            my_id = Int32(0)
            my_key = Uint32(0)
            for r in cutlass.range(cfg.top_k, unroll=1):
                packed = best[0]
                cur = (packed >> 8).to(Uint32)
                kmax = cute.arch.warp_redux_sync(cur, "umax")
                cand = Int32(0x7FFFFFFF)
                if cur == kmax:
                    cand = ((Int32(255) - (packed & Uint64(255)).to(Int32)) * S + wid) * 32 + lane
                win = cute.arch.warp_redux_sync(cand, "min")
                if lane == r:
                    my_id = win
                    my_key = kmax
                if win % 32 == lane:
                    if has_second != 0:
                        best[0] = best[1]
                        has_second = Int32(0)
                    else:
                        best[0] = self._tree_best(keys, packed)
            if lane < cfg.top_k:
                s_key[wid * cfg.top_k + lane] = my_key
                s_id[wid * cfg.top_k + lane] = my_id
            cute.arch.barrier()
            # 3. warp 0: top-k of the S*k candidates; P = key << 32 | (2^31 - 1 - id): larger key, then
            # lower id (the reference's stable order); candidates beyond C are P = 0 (never picked)
            if wid == 0:
                Q = self.cand_slots
                cands = []
                for j in cutlass.range_constexpr(Q):
                    c = lane + 32 * j
                    p = Uint64(0)
                    if cutlass.const_expr((j + 1) * 32 <= C):
                        p = (s_key[c].to(Uint64) << 32) | (Int32(0x7FFFFFFF) - s_id[c]).to(Uint64)
                    elif c < C:
                        p = (s_key[c].to(Uint64) << 32) | (Int32(0x7FFFFFFF) - s_id[c]).to(Uint64)
                    cands.append(p)
                top = self._max_below(cands, None)
                fin_id = Int32(0)
                for r in cutlass.range(cfg.top_k, unroll=1):
                    cur = (top >> 32).to(Uint32)
                    kmax = cute.arch.warp_redux_sync(cur, "umax")
                    cid = Int32(0x7FFFFFFF)
                    if cur == kmax:
                        cid = Int32(0x7FFFFFFF) - (top & Uint64(0x7FFFFFFF)).to(Int32)
                    win = cute.arch.warp_redux_sync(cid, "min")
                    if lane == r:
                        fin_id = win
                    if cur == kmax:
                        if cid == win:  # this lane held the winner: its next candidate below it
                            top = self._max_below(cands, top)
                self._weights_out(logits, w_out, ids_out, m, lane, fin_id, vmax, inv_sum)

        def _cmpx(self, key, eid, lane, j: int, k: int):
            """One bitonic compare-exchange with lane ^ j: the pair's larger (key, then lower id) goes to
            the lower lane where block k runs descending ((lane & k) == 0), to the upper lane elsewhere.
            Plain Python over DSL values (selects, no branches): traced inline, j and k fixed."""
            sel = cutlass.select_
            pk = cute.arch.shuffle_sync_bfly(key, j).to(Uint32)   # (the shuffle returns Int32 bits)
            pe = cute.arch.shuffle_sync_bfly(eid, j).to(Int32)
            def bit(cond):
                return Int32(sel(cond, Int32(1), Int32(0)))

            p_gt = bit(pk > key) | (bit(pk == key) & bit(pe < eid))
            take_max = bit((lane & j) == 0)                              # lower lane of the pair
            if k < 32:                                                   # trace time: block direction
                take_max = Int32(1) - (take_max ^ bit((lane & k) == 0))
            swap = p_gt == take_max                                      # the partner's element belongs here
            return Uint32(sel(swap, pk, key)), Int32(sel(swap, pe, eid))

        @cute.kernel
        def sort_kernel(self, logits: cute.Tensor, bias: cute.Tensor, w_out: cute.Tensor, ids_out: cute.Tensor):
            """One token per CTA, thread t scores expert t; warp sorts, then a merge tree (see RouterConfig.sort)."""
            cfg = self.cfg
            E = cfg.num_experts
            W = self.sort_warps
            LIST: cutlass.Constexpr = 16  # entries a warp's list keeps (top_k <= 16)
            tidx, _, _ = cute.arch.thread_idx()
            m, _, _ = cute.arch.block_idx()
            lane = tidx % 32
            wid = tidx // 32
            smem = SmemAllocator()
            s_key = smem.allocate_tensor(Uint32, cute.make_layout(W * LIST), byte_alignment=16)
            s_id = smem.allocate_tensor(Int32, cute.make_layout(W * LIST), byte_alignment=16)
            s_score = smem.allocate_tensor(Float32, cute.make_layout(W * 32), byte_alignment=16)
            ec = cutlass.min(tidx, Int32(E - 1))
            b = Float32(0.0)
            if cutlass.const_expr(cfg.has_bias):
                b = bias[ec].to(Float32)  # a weight, not the previous kernel's output: read before the PDL wait
            self._pdl_wait()
            score = self._score(logits[m, ec].to(Float32), Float32(0.0), Float32(1.0))
            s_score[tidx] = score  # the winners' weights read it back (no second trip for their logits)
            sel = score
            if cutlass.const_expr(cfg.has_bias):
                sel = sel + b
            key = self._key(sel)
            if cutlass.const_expr(W * 32 > E):
                if tidx >= E:
                    key = Uint32(0)   # below every real key: never selected while top_k <= E
            eid = Int32(tidx)
            # 1. the warp's 32 pairs sorted descending (bitonic network, registers + shuffles)
            for st in cutlass.range_constexpr(len(self.sort_stages)):
                key, eid = self._cmpx(key, eid, lane, self.sort_stages[st][0], self.sort_stages[st][1])
            # 2. merge tree: at stride s, warp w (w % 2s == 0) takes the top LIST of warp w + s into lanes
            # 16..31 reversed (a bitonic sequence with its own lanes 0..15) and half-cleans it: 5 stages.
            # Writers of a level (w % 2s == s) use slots no reader of the previous level touches: one
            # barrier per level.
            for lv in cutlass.range_constexpr(len(self.merge_strides)):
                st = self.merge_strides[lv]
                if wid % (2 * st) == st:
                    if lane < LIST:
                        s_key[wid * LIST + lane] = key
                        s_id[wid * LIST + lane] = eid
                cute.arch.barrier()
                if wid % (2 * st) == 0:
                    if wid + st < W:
                        if lane >= LIST:
                            src = (wid + st) * LIST + (31 - lane)
                            key = s_key[src]
                            eid = s_id[src]
                        for jj in cutlass.range_constexpr(5):
                            key, eid = self._cmpx(key, eid, lane, 16 >> jj, 64)
            # 3. warp 0, lane r < top_k: winner r (rank order, as the other kernels); s_score was written
            # before the merge tree's first barrier (one warp: no barrier, so a warp sync)
            if cutlass.const_expr(len(self.merge_strides) == 0):
                cute.arch.sync_warp()
            if wid == 0:
                s = Float32(0.0)
                if lane < cfg.top_k:
                    s = s_score[eid]
                self._store_weights(w_out, ids_out, m, lane, eid, s)

        def _max_below(self, vals, below):
            """max of ``vals`` (Uint64), only those < ``below`` when given (0 if none): unrolled tree."""
            if below is not None:
                vals = [Uint64(cutlass.select_(v < below, v, Uint64(0))) for v in vals]
            while len(vals) > 1:
                nxt = [cutlass.max(vals[j], vals[j + 1]) for j in range(0, len(vals) - 1, 2)]
                if len(vals) % 2:
                    nxt.append(vals[-1])
                vals = nxt
            return vals[0]

    return RouterKernel


@compile_unit
def _compile(cfg: RouterConfig):
    def build(arch: str):
        import cutlass.cute as cute

        kernel = _build_kernel_class()(cfg)
        m = cute.sym_int()
        logits = cute.runtime.make_fake_tensor(_cutlass_dtype(cfg.logits_dtype), (m, cfg.num_experts),
                                               stride=(cute.sym_int64(), 1), assumed_align=4)
        bias = cute.runtime.make_fake_tensor(_cutlass_dtype(cfg.bias_dtype), (cfg.num_experts,), stride=(1,),
                                             assumed_align=4)
        import cutlass

        w_out = cute.runtime.make_fake_tensor(cutlass.Float32, (m, cfg.top_k), stride=(cute.sym_int64(), 1),
                                              assumed_align=4)
        ids_out = cute.runtime.make_fake_tensor(_cutlass_dtype(cfg.ids_dtype), (m, cfg.top_k),
                                                stride=(cute.sym_int64(), 1), assumed_align=4)
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        return cute.compile(kernel, logits, bias, w_out, ids_out, stream,
                            options=_compile_options(arch))

    return cached_compile("moe_router", (cfg,), build)


SPLIT_MAX_TOKENS = 16
"""Batches up to this many tokens use ``split`` warps per token (see RouterConfig.split)."""
SPLIT_WARPS = 4


SORT_MAX_TOKENS = 64
"""Batches up to this many tokens use the sort kernel where it applies (see RouterConfig.sort)."""
SORT_MAX_EXPERTS = 1024
"""One thread per expert in one CTA."""
SORT_MAX_TOP_K = 16
"""A warp's list keeps 16 entries."""


def sort_applies(num_experts: int, top_k: int, score_func: str) -> str | None:
    """None when the sort kernel can route this router, else why not."""
    if score_func == "softmax":
        return "softmax scores need row statistics over all experts"
    if num_experts > SORT_MAX_EXPERTS:
        return f"E={num_experts} > {SORT_MAX_EXPERTS} (one thread per expert)"
    if top_k > SORT_MAX_TOP_K:
        return f"top_k={top_k} > {SORT_MAX_TOP_K}"
    return None


def choose_split(tokens: int, num_experts: int, top_k: int, score_func: str) -> int:
    """Warps per token for a batch of ``tokens`` (1 = one warp scans all experts)."""
    if score_func == "softmax" or tokens > SPLIT_MAX_TOKENS:
        return 1  # softmax needs row statistics over all experts; big batches fill the GPU already
    s = SPLIT_WARPS
    return s if num_experts // s >= max(top_k, 32) else 1


def make_config(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, router: RouterSpec,
                ids_dtype: torch.dtype = torch.int64, split: int | None = None,
                sort: bool | None = None) -> RouterConfig:
    """The compile key for one call (validates what the kernel supports; UserError names the fix)."""
    if logits.dim() != 2:
        raise UserError(f"moe router: logits must be [M, E], got shape {tuple(logits.shape)}")
    E = logits.shape[1]
    if E > 32 * 256:
        raise UserError(f"moe router: E={E} > 8192 experts; use moe.router.reference")
    if not 0 < top_k <= min(E, MAX_TOP_K):
        raise UserError(f"moe router: top_k={top_k} must be in 1..min(E={E}, {MAX_TOP_K}); "
                        "use moe.router.reference for larger top_k")
    use_bias = bias is not None and router.bias_corrected
    if use_bias and tuple(bias.shape) != (E,):
        raise UserError(f"moe router: bias must be [E={E}], got {tuple(bias.shape)}")
    why_not = sort_applies(E, top_k, router.score_func)
    if sort is None:
        sort = why_not is None and logits.shape[0] <= SORT_MAX_TOKENS and split is None
    if sort:
        if why_not is not None:
            raise UserError(f"moe router: sort kernel: {why_not}; use sort=False")
        split = 1
    if split is None:
        split = choose_split(logits.shape[0], E, top_k, router.score_func)
    if split > 1 and (router.score_func == "softmax" or E // split < top_k):
        raise UserError(f"moe router: split={split} needs a non-softmax score and >= top_k experts per warp "
                        f"(E={E}, top_k={top_k}, score={router.score_func}); use split=1")
    return RouterConfig(E, top_k, router.score_func, float(router.logit_scale), use_bias, router.renormalize,
                        float(router.renormalize_eps), float(router.routed_scaling), _dtype_name(logits.dtype),
                        _dtype_name(bias.dtype) if use_bias else "float32", _dtype_name(ids_dtype), split,
                        sort=bool(sort))


def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, router: RouterSpec, *,
          out_weights: torch.Tensor | None = None, out_ids: torch.Tensor | None = None,
          split: int | None = None, sort: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing on the GPU (same contract as ``ops.moe.route_reference``).

    Parameters
    ----------
    logits : [M, E] router logits (fp32, bf16 or fp16; unit stride along E).
    bias : [E] selection bias or None. top_k : experts per token (<= 32). router : RouterSpec.
    out_weights : optional [M, top_k] fp32 destination. out_ids : optional [M, top_k] int64/int32.
    split : warps per token of the rounds kernel (default: ``choose_split`` for this M).
    sort : the sort kernel (default: where it applies, up to ``SORT_MAX_TOKENS`` tokens, unless a
        ``split`` is given).

    Returns
    -------
    weights [M, top_k] fp32 and ids [M, top_k] (int64 unless ``out_ids`` says otherwise), launched on
    the current stream; no host sync, so it can be captured in a CUDA graph (compile first).
    """
    M = logits.shape[0]
    ids_dtype = out_ids.dtype if out_ids is not None else torch.int64
    cfg = make_config(logits, bias, top_k, router, ids_dtype, split, sort)
    fn = _compile(cfg)
    w = out_weights if out_weights is not None else torch.empty(M, top_k, dtype=torch.float32,
                                                                device=logits.device)
    ids = out_ids if out_ids is not None else torch.empty(M, top_k, dtype=torch.int64, device=logits.device)
    # without a bias the kernel never reads it: an uninitialised placeholder launches nothing
    b = bias if cfg.has_bias else torch.empty(cfg.num_experts, dtype=torch.float32, device=logits.device)
    if M > 0:
        fn(logits, b, w, ids)
    return w, ids


def _supports(ctx: OpContext) -> Support:
    ok = sm90_dsl_support(ctx)
    if ok is not True:
        return ok
    if ctx.dim("topk") > MAX_TOP_K:
        return f"top_k {ctx.dim('topk')} > {MAX_TOP_K}"
    return True


def prepare(ctx: OpContext, router: RouterSpec, logits_dtype: torch.dtype = torch.float32,
            has_bias: bool = True) -> None:
    """Compile before graph capture for a site (E, topk from ctx)."""
    E, k = ctx.dim("E"), ctx.dim("topk")
    dummy = torch.empty(ctx.tokens, E, dtype=logits_dtype, device="meta")  # M picks the split variant
    bias = torch.empty(E, dtype=torch.float32, device="meta") if has_bias else None
    _compile(make_config(dummy, bias, k, router))


IMPLEMENTATIONS = [
    Implementation("moe.router", "moe.router.cutedsl", route, _supports, priority=10,
                   description="ordered-key top-k: warp bitonic sorts + a merge tree (one thread per expert, "
                               "E <= 1024, top_k <= 16), else redux.sync rounds (1 warp per token; 4 warps + a merge "
                               "at <= 16 tokens); renormalise, scale"),
]

__all__ = ["route", "RouterConfig", "make_config", "prepare", "IMPLEMENTATIONS"]
