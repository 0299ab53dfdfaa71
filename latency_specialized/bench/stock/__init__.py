"""The stock compositions: fair stand-ins for stock vLLM's decode layers (Kimi K3, Muse Spark; PERF.md).

Stock vLLM decodes a Kimi K3 layer with one kernel wherever it has one: a fused AttnRes kernel
(prefix add + block mix + RMSNorm), cuBLAS projections, one causal-conv update, one fused
recurrent KDA kernel, one gated RMSNorm, one grouped top-k routing kernel, a Triton fused MoE
(sort/align, gate/up over the selected experts, activation, down with the routing weights, sum),
router and latent projections replicated on every rank, shared experts and the latent
down-projection on side streams. The pieces stock vLLM has in its own Triton/CUDA code are written
here in Triton (``norms``, ``kda``, ``moe``); ``layers`` composes them. ``gqa_moe`` composes a GQA +
(latent) MoE layer as stock vLLM runs Muse Spark (its stand-ins in ``gqa_kernels``); ``compositions``
names them for the adapters' ``BenchKind.stock``; ``common`` holds the shared helpers. Triton is needed
at call time only (the H200 image has triton 3.6; CPU CI can run them under TRITON_INTERPRET=1).
"""
