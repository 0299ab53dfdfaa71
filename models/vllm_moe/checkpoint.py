"""Tiny random-weight checkpoints that vLLM's CPU build can serve, made offline.

``write_tiny_qwen3_moe(path)`` writes a complete Hugging Face model directory - ``config.json``,
``model.safetensors`` (random weights, fixed seed), a byte-level BPE tokenizer trained here with
`tokenizers` on a built-in corpus, ``tokenizer_config.json`` with a chat template and
``generation_config.json`` - for vLLM's in-tree ``Qwen3MoeForCausalLM``. Nothing is downloaded.
Tests serve it through the OpenAI API; users can reuse it to try the backend on a laptop::

    python -m latency_specialized_models.vllm_moe.checkpoint /tmp/tiny-qwen3-moe
    python -m vllm.entrypoints.openai.api_server --model /tmp/tiny-qwen3-moe --dtype float32 \\
        --decode-backend latency_specialized
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from latency_specialized.errors import UserError

if TYPE_CHECKING:
    import torch

# Chat template of the tiny model: plain role-tagged turns, enough for /v1/chat/completions.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>")

# A small English corpus so that the BPE merges make ordinary words single tokens.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A small model answers every question with
confidence, and a large model answers with latency. Decode one token, then the next token.
Tensor parallel ranks exchange partial sums; the router picks the top experts for every token.
Once upon a time there was a kernel that read every weight exactly once from memory.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000. Yes, no, maybe. Red, green, blue, yellow.
{"name": "tiny", "value": 1, "ok": true, "items": [1, 2, 3]} The answer is yes or no.
Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris.
""".strip()


@dataclass(frozen=True)
class TinyQwen3MoeConfig:
    """Shapes of the tiny Qwen3-MoE (all small enough for a 2-core CPU)."""

    vocab_size: int = 512
    """Target BPE vocabulary (special tokens included)."""
    hidden_size: int = 64
    """Width of the residual stream."""
    num_hidden_layers: int = 3
    """Decoder layers; layer 0 is a dense MLP layer (``mlp_only_layers``), the others MoE."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """KV heads (GQA)."""
    head_dim: int = 32
    """Width of one head."""
    intermediate_size: int = 128
    """Dense MLP width (layer 0)."""
    moe_intermediate_size: int = 32
    """Width of one routed expert."""
    num_experts: int = 8
    """Routed experts per MoE layer."""
    num_experts_per_tok: int = 2
    """Top-k."""
    max_position_embeddings: int = 1024
    """Longest context."""
    weight_std: float = 0.08
    """Std of the random projection weights: large enough that logits have clear margins."""
    seed: int = 1234
    """Seed of the random weights."""


def train_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on the built-in corpus (deterministic, offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([line for line in _CORPUS.splitlines() if line] * 4, trainer=trainer)
    return tok


def _hf_weights(cfg: TinyQwen3MoeConfig, vocab: int) -> dict[str, "torch.Tensor"]:
    """Random fp32 weights named as a Hugging Face Qwen3-MoE checkpoint names them."""
    import torch

    g = torch.Generator().manual_seed(cfg.seed)

    def rnd(*shape: int, std: float = cfg.weight_std) -> "torch.Tensor":
        return torch.randn(*shape, generator=g) * std

    def gain(n: int) -> "torch.Tensor":  # norm gains around 1, not exactly 1 (a wrong gain must show)
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    h, hd = cfg.hidden_size, cfg.head_dim
    w: dict[str, "torch.Tensor"] = {"model.embed_tokens.weight": rnd(vocab, h, std=1.0)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = gain(h)
        w[f"{p}.post_attention_layernorm.weight"] = gain(h)
        w[f"{p}.self_attn.q_proj.weight"] = rnd(cfg.num_attention_heads * hd, h)
        w[f"{p}.self_attn.k_proj.weight"] = rnd(cfg.num_key_value_heads * hd, h)
        w[f"{p}.self_attn.v_proj.weight"] = rnd(cfg.num_key_value_heads * hd, h)
        w[f"{p}.self_attn.o_proj.weight"] = rnd(h, cfg.num_attention_heads * hd)
        w[f"{p}.self_attn.q_norm.weight"] = gain(hd)
        w[f"{p}.self_attn.k_norm.weight"] = gain(hd)
        if i == 0:  # dense layer
            w[f"{p}.mlp.gate_proj.weight"] = rnd(cfg.intermediate_size, h)
            w[f"{p}.mlp.up_proj.weight"] = rnd(cfg.intermediate_size, h)
            w[f"{p}.mlp.down_proj.weight"] = rnd(h, cfg.intermediate_size)
            continue
        w[f"{p}.mlp.gate.weight"] = rnd(cfg.num_experts, h, std=0.5)  # decisive routing
        for e in range(cfg.num_experts):
            q = f"{p}.mlp.experts.{e}"
            w[f"{q}.gate_proj.weight"] = rnd(cfg.moe_intermediate_size, h)
            w[f"{q}.up_proj.weight"] = rnd(cfg.moe_intermediate_size, h)
            w[f"{q}.down_proj.weight"] = rnd(h, cfg.moe_intermediate_size)
    w["model.norm.weight"] = gain(h)
    w["lm_head.weight"] = rnd(vocab, h, std=0.5)
    return {k: v.contiguous() for k, v in w.items()}


def write_tiny_qwen3_moe(path: str | Path, cfg: TinyQwen3MoeConfig = TinyQwen3MoeConfig(),
                         dtype: str = "float32") -> Path:
    """Write a servable tiny ``Qwen3MoeForCausalLM`` checkpoint into ``path`` (created if missing).

    Parameters
    ----------
    path : directory to write (existing files of the same names are overwritten).
    cfg : shapes and seed.
    dtype : 'float32' or 'bfloat16': stored weights and ``torch_dtype`` of the config.

    Returns
    -------
    The directory, ready for ``--model``.
    """
    import torch
    from safetensors.torch import save_file

    if dtype not in ("float32", "bfloat16"):
        raise UserError(f"dtype {dtype!r} not supported for the tiny checkpoint: use float32 or bfloat16")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(cfg.vocab_size)
    vocab = tok.get_vocab_size()
    tok.save(str(out / "tokenizer.json"))
    eos = "<|endoftext|>"
    eos_id = tok.token_to_id(eos)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos, "bos_token": None,
        "unk_token": None, "model_max_length": cfg.max_position_embeddings, "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(tok.token_to_id(t)): {"content": t, "special": True, "lstrip": False,
                                                           "rstrip": False, "normalized": False, "single_word": False}
                                 for t in SPECIAL_TOKENS},
    }, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": eos, "pad_token": eos}, indent=2))
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": dtype,
        "vocab_size": vocab, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size, "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [0], "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": False,
        "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
        "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": eos_id,
        "latency_specialized_tiny": asdict(cfg),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id, "do_sample": False}, indent=2))
    weights = {k: v.to(getattr(torch, dtype)) for k, v in _hf_weights(cfg, vocab).items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m latency_specialized_models.vllm_moe.checkpoint OUT_DIR", file=sys.stderr)
        return 2
    print(write_tiny_qwen3_moe(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
