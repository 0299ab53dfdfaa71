"""Qwen3-MoE adapter (composed from the pieces only)."""
