"""transformers 5.24 side of the Muse Spark parity tests; run with the transformers-5.24 target dir first on
PYTHONPATH (``test_muse_vs_transformers.py`` does). Independent of this project's code.

    python _tf524_worker.py build OUT IDS       # per VARIANTS: a random tiny model -> OUT/<variant>/ckpt (fp32)
    python _tf524_worker.py load CKPT OUT IDS   # from_pretrained(CKPT); every text tensor must be in CKPT

Both write the teacher-forced logits ([T, vocab], fp32) of the comma-separated token ids IDS: build to
OUT/<variant>/logits.pt, load to OUT/logits.pt. Attention and experts run transformers' eager code.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers
from transformers import MuseSparkConfig, MuseSparkForConditionalGeneration

TEXT = dict(vocab_size=128, hidden_size=64, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
            head_dim=16, sliding_window=6, num_local_experts=8, num_experts_per_tok=2, moe_hidden_size=32,
            moe_intermediate_size=32, intermediate_size=96, max_position_embeddings=256,
            # layer 0 dense: spec_from_config's dense path (the released model is all sparse)
            mlp_layer_types=["dense"] + ["sparse"] * 7, bos_token_id=None, eos_token_id=None)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, pos_emb_height=4,
              pos_emb_width=4, merge_size=2)
AUDIO = dict(hidden_sizes=[8, 16], patch_sizes=[2, 2], depths=[1, 1], num_hidden_layers=2, out_hidden_size=64)
VARIANTS = {"released": {}, "qk2": {"qk_scale_factor": 2.0}}
"""Text-config overrides: the released q scale 5.473 makes attention sharp enough that fp32 rounding alone (the
same math in other GEMM shapes) moves the logits by up to ~1e-3 after 8 layers; at 2.0 by <= 3e-5."""


def build(**text) -> MuseSparkForConditionalGeneration:
    """The tiny model with every gain, gate and bias randomised (transformers initialises them to neutral)."""
    torch.manual_seed(0)
    cfg = MuseSparkConfig(text_config={**TEXT, **text}, vision_config=VISION, audio_config=AUDIO,
                          out_hidden_size=32 * 4, projector_hidden_size=32)
    model = MuseSparkForConditionalGeneration(cfg).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        lm = model.model.language_model
        for name, t in list(lm.named_parameters()) + list(lm.named_buffers()):
            r = torch.randn(t.shape, generator=g)
            if name.endswith("residual_gate.gate"):
                t.copy_(0.5 * r)
            elif name == "norm.weight":
                t.copy_(1 + 0.1 * r)
            elif name.endswith("norm.weight"):      # (1 + w) gains
                t.copy_(0.1 * r)
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.05 * r)
            elif name.endswith("mlp.gate.weight"):  # router logits of O(1) before the 2^-2.5 multiplier
                t.copy_(2 * r / t.shape[-1] ** 0.5)
        model.lm_head.weight.copy_(2 * torch.randn(model.lm_head.weight.shape, generator=g))
    return model


def forward(model: MuseSparkForConditionalGeneration, ids: str, out: Path) -> None:
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    with torch.no_grad():
        logits = model.eval()(input_ids=torch.tensor([[int(i) for i in ids.split(",")]])).logits[0].float()
    out.mkdir(parents=True, exist_ok=True)
    torch.save(logits, out / "logits.pt")


def main(argv: list[str]) -> None:
    assert transformers.__version__ == "5.24.0", transformers.__version__
    if argv[0] == "build":
        for name, text in VARIANTS.items():
            model = build(**text)
            model.save_pretrained(Path(argv[1]) / name / "ckpt")
            forward(model, argv[2], Path(argv[1]) / name)
    elif argv[0] == "load":
        model, info = MuseSparkForConditionalGeneration.from_pretrained(argv[1], dtype=torch.float32,
                                                                        output_loading_info=True)
        text = [k for k in info["missing_keys"] | set(info["unexpected_keys"]) | set(info["mismatched_keys"])
                if "vision" not in k and "audio" not in k]
        assert not text, f"text tensors transformers did not load from {argv[1]}: {sorted(text)[:5]}"
        forward(model, argv[3], Path(argv[2]))
    else:
        raise SystemExit(f"unknown command {argv[0]!r}: use build or load")


if __name__ == "__main__":
    main(sys.argv[1:])
