"""Token embedding (plain and RMS-normed) and the LM head (vocab split at TP, replicated otherwise)."""

from __future__ import annotations

import torch

from latency_specialized.pieces import LMHead, TokenEmbedding
from latency_specialized.spec import DenseMLPSpec, GQAAttentionSpec, LayerSpec, ModelSpec, NormSpec

from tests.pieces.helpers import make_step, piece_sites, random_full, rank_weights

H, EPS = 32, 1e-6


def spec_for(vocab: int) -> ModelSpec:
    return ModelSpec(name="emb_toy", hidden_size=H, vocab_size=vocab, max_context=64, norm=NormSpec(eps=EPS),
                     layers=(LayerSpec(index=0, attention=GQAAttentionSpec(num_heads=4, num_kv_heads=4, head_dim=8),
                                       ffn=DenseMLPSpec(intermediate=16)),))


def test_embedding_gathers_rows_and_optionally_norms_them():
    spec = spec_for(40)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 40, (6,), generator=g)
    for normed in (False, True):
        piece = TokenEmbedding(normed=normed)
        w = random_full(piece, spec, g)
        w["weight"] = torch.randn(40, H, generator=g)
        step = make_step(piece_sites(piece, spec, 1, 6, prefix=""), spec, 6, prefix="", layer=-1)
        x = piece.forward(step, rank_weights(piece, spec, w, 0, 1), {}, tokens)
        want = w["weight"][tokens].double()
        if normed:
            want = want / torch.sqrt((want * want).mean(-1, keepdim=True) + EPS) * w["norm"].double()
        torch.testing.assert_close(x.double(), want, rtol=1e-6, atol=1e-6)
        assert [s.name for s in step.ops.sites.values()] == (["embed_norm"] if normed else [])
        assert {d.name: d.split for d in piece.weights(spec, 4)} == ({"weight": None, "norm": None} if normed
                                                                     else {"weight": None})


def test_lm_head_splits_the_vocabulary_and_the_slices_make_the_logits():
    g = torch.Generator().manual_seed(4)
    h = torch.randn(3, H, generator=g)
    for vocab, tp, split in ((40, 2, True), (42, 4, False), (40, 1, False)):
        spec, piece = spec_for(vocab), LMHead()
        w = {"weight": torch.randn(vocab, H, generator=g)}
        assert piece.weights(spec, tp)[0].split == (0 if split else None)
        parts = []
        for r in range(tp):
            site, = piece_sites(piece, spec, tp, 3, prefix="")
            assert site.name == "lm_head" and site.ctx.dim("N") == (vocab // tp if split else vocab)
            step = make_step([site], spec, 3, tp=tp, rank=r, prefix="", layer=-1)
            parts.append(piece.forward(step, rank_weights(piece, spec, w, r, tp), {}, h))
        logits = torch.cat(parts, -1) if split else parts[0]
        torch.testing.assert_close(logits.double(), h.double() @ w["weight"].double().T, rtol=1e-5, atol=1e-5)
    assert LMHead(tied=True).tied and LMHead(tied=True).weights(spec_for(40), 1)[0].shape == (40, H)
