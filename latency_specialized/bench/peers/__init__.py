"""Peer baselines: what another stack runs for one of our ops, called the way that stack calls it.

Unlike ``bench/stock`` (our Triton stand-ins for stock vLLM's kernels), a peer runs the other stack's
own kernels from their own package, with the arguments and the call sequence that stack uses, so the
bench can put a number next to ours and say exactly what ran. ``humming_mxfp4``: stock vLLM 0.33's
MXFP4 routed experts on Hopper (the ``humming-kernels`` package); NOTES.md says how that was read.
Each peer imports its package only when it is used.
"""
