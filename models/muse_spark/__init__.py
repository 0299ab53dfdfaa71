"""Muse Spark adapter (spec, scope and op sites; reference/program/vLLM binding come later)."""
