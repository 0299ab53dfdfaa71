"""Generic adapter for vLLM's standard MoE decoder layers (first target: ``Qwen3MoeForCausalLM``)."""
