"""Composition layer: reusable layer pieces an adapter lists per layer (docs/composition.md).

A piece implements the runtime's protocols (``runtime/pieces_api.py``: ``Piece``,
``ResidualPiece``); the generic program (``runtime/composed.py``) drives them. Pieces import ops,
runtime and the foundation - never ``kernels/`` (an implementation is reached through its op
family) and never ``models/``.
"""

from latency_specialized.pieces.attention.gqa import GQAAttention
from latency_specialized.pieces.attention.rope import apply_rope, rope_inv_freq
from latency_specialized.pieces.embedding import TokenEmbedding
from latency_specialized.pieces.ffn.dense_mlp import DenseMLP
from latency_specialized.pieces.ffn.moe import RoutedMoE
from latency_specialized.pieces.lm_head import LMHead
from latency_specialized.pieces.residual.prenorm import PreNormResidual

__all__ = ["TokenEmbedding", "LMHead", "PreNormResidual", "DenseMLP", "RoutedMoE", "GQAAttention", "apply_rope",
           "rope_inv_freq"]

# residual schemes and sparse attention without an adapter yet (issue 20): interface + reference
from latency_specialized.pieces.attention.sparse_mla import IndexerOptions, SparseMLAAttention  # noqa: E402
from latency_specialized.pieces.residual.gated import GatedResidual, NormPreservingGate  # noqa: E402
from latency_specialized.pieces.residual.mhc import MHCResidual  # noqa: E402
from latency_specialized.pieces.residual.sandwich import SandwichResidual  # noqa: E402

__all__ += ["MHCResidual", "GatedResidual", "NormPreservingGate", "SandwichResidual", "SparseMLAAttention",
            "IndexerOptions"]
