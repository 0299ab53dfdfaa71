"""DeepSeek-V4.1-Flash adapter (spec, scope and op sites; reference/program/vLLM binding come later)."""
