"""Rotary position embedding for the attention pieces: the math lives in ``ops/rope.py`` (the
``attention.qk_norm_rope`` family's reference uses it too); re-exported here for the pieces."""

from latency_specialized.ops.rope import RopeStyle, apply_rope, rope_inv_freq

__all__ = ["apply_rope", "rope_inv_freq", "RopeStyle"]
