"""GLM-5.3 adapter (spec, scope and op sites; reference/program/vLLM binding come later)."""
