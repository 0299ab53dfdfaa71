"""A small working tokenizer for tiny Kimi K3 checkpoints, trained offline and deterministically.

A byte-level BPE (Hugging Face ``tokenizers``) trained on the embedded corpus below, with Kimi's
special-token names at fixed ids (``<|pad|>`` 0, ``[BOS]`` 1, ``[EOS]`` 2) and reserved tokens
filling the vocabulary up to the model's size, so every id the model can emit decodes. Saved as
``tokenizer.json`` + ``tokenizer_config.json`` (loadable by ``transformers``' fast tokenizer).
The real Kimi K3 tokenizer (tiktoken-based, 163840 ids) is not reproduced.
"""

from __future__ import annotations

import json
from pathlib import Path

from latency_specialized.errors import CheckpointError

PAD, BOS, EOS = "<|pad|>", "[BOS]", "[EOS]"
SPECIALS = (PAD, BOS, EOS)

_CORPUS = """
The quick brown fox jumps over the lazy dog, and the lazy dog sleeps in the warm sun.
A decoder reads one token, updates its state, and writes the next token. Then it does it again.
Kimi Delta Attention keeps a small state for every head: it forgets a little, writes a little,
and reads what it needs. Latent attention keeps a compressed cache of every token it has seen.
The router sends each token to sixteen of many experts; two shared experts see every token.
Block attention residuals mix the outputs of earlier blocks with a learned query.
Once upon a time, a small model lived on a laptop. It could not remember much, but it tried.
It was the best of times, it was the worst of times; the weights were random, the tests were not.
Numbers and symbols: 0 1 2 3 4 5 6 7 8 9 10 12 16 32 64 128 256 512 1024 = + - * / ( ) [ ] { } .
Questions and answers: What is the time? It is late. Where is the cache? It is in memory.
The river runs to the sea, and the sea runs to the sky, and the sky rains on the river again.
Every kernel reads its weights once, every test compares against a reference, every step counts.
Hello, world! Good morning. Good night. Thank you very much. You are welcome. See you soon.
She sells sea shells by the sea shore. Peter Piper picked a peck of pickled peppers.
In the beginning the program was slow; after many small steps it was fast, and still correct.
""".strip()


def train_tokenizer(vocab_size: int):
    """The byte-level BPE of exactly ``vocab_size`` ids (deterministic; no network)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 260:
        raise CheckpointError(f"a byte-level tokenizer needs >= 260 ids (256 bytes + specials); got vocab {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=1)
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    # A small corpus may run out of merges before the target: fill with reserved special tokens
    # so that ids up to vocab_size - 1 (which a random model can emit) all decode.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    if tok.get_vocab_size() != vocab_size:
        raise CheckpointError(f"tokenizer came out with {tok.get_vocab_size()} ids instead of {vocab_size}")
    return tok


def save_tokenizer(tok, directory: str | Path, *, max_length: int) -> list[Path]:
    """Write tokenizer.json and tokenizer_config.json into ``directory``."""
    d = Path(directory)
    tok.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
           "model_max_length": max_length, "add_bos_token": True, "clean_up_tokenization_spaces": False}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return [d / "tokenizer.json", d / "tokenizer_config.json"]


def load_tokenizer(directory: str | Path):
    """The ``tokenizers.Tokenizer`` of a checkpoint directory, or None when it has no tokenizer.json."""
    path = Path(directory) / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad checkpoint
        raise CheckpointError(f"{path}: not a valid tokenizers file ({e}); regenerate it or pass --prompt-ids") from e
