"""Small byte-level BPE tokenizers for random-weight checkpoints, and a checkpoint's tokenizer files.

    tok = train_byte_bpe(512, [corpus] * 4, specials=("<|pad|>", "[BOS]", "[EOS]"))   # deterministic, offline
    files = save_tokenizer(tok, directory, max_length=4096, bos="[BOS]", eos="[EOS]", pad="<|pad|>")
    tok = load_tokenizer(directory)                                                    # None without tokenizer.json

The special tokens take the first ids in order; reserved tokens fill the vocabulary up to its size
where the corpus runs out of merges, so every id a model can emit decodes. Files: ``tokenizer.json``
and ``tokenizer_config.json`` (loadable by ``transformers``' fast tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from latency_specialized.errors import CheckpointError


def train_byte_bpe(vocab_size: int, texts: Sequence[str], specials: Sequence[str]) -> Any:
    """A ``tokenizers.Tokenizer``: byte-level BPE of exactly ``vocab_size`` ids trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(specials) + 1:
        raise CheckpointError(f"a byte-level tokenizer needs >= {256 + len(specials) + 1} ids (256 bytes + specials); "
                              f"got vocab {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=1)
    tok.train_from_iterator(list(texts), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    if tok.get_vocab_size() != vocab_size:
        raise CheckpointError(f"tokenizer came out with {tok.get_vocab_size()} ids instead of {vocab_size}")
    return tok


def save_tokenizer(tok: Any, directory: str | Path, *, max_length: int, bos: str, eos: str, pad: str) -> list[Path]:
    """Write tokenizer.json and tokenizer_config.json into ``directory``; returns them."""
    d = Path(directory)
    tok.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": pad,
           "model_max_length": max_length, "add_bos_token": True, "clean_up_tokenization_spaces": False}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return [d / "tokenizer.json", d / "tokenizer_config.json"]


def load_tokenizer(directory: str | Path) -> Any:
    """The ``tokenizers.Tokenizer`` of a checkpoint directory, or None when it has no tokenizer.json."""
    path = Path(directory) / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad checkpoint
        raise CheckpointError(f"{path}: not a valid tokenizers file ({e}); regenerate it or pass --prompt-ids") from e


__all__ = ["train_byte_bpe", "save_tokenizer", "load_tokenizer"]
