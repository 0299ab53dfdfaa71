"""Fixtures of the vLLM integration tests: the tiny checkpoint, written once per session, offline."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A random-weight Qwen3-MoE checkpoint (fp32, fixed seed) with its own BPE tokenizer."""
    from latency_specialized_models.vllm_moe.checkpoint import write_tiny_qwen3_moe

    return write_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny-qwen3-moe"), dtype="float32")
