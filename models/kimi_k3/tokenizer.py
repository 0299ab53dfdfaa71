"""A small working tokenizer for tiny Kimi K3 checkpoints, trained offline and deterministically.

A byte-level BPE (Hugging Face ``tokenizers``) trained on the embedded corpus below, with Kimi's
special-token names at fixed ids (``<|pad|>`` 0, ``[BOS]`` 1, ``[EOS]`` 2) and reserved tokens
filling the vocabulary up to the model's size (``runtime/tokenizer.py``). The real Kimi K3 tokenizer
(tiktoken-based, 163840 ids) is not reproduced.
"""

from __future__ import annotations

from pathlib import Path

from latency_specialized.runtime import tokenizer
from latency_specialized.runtime.tokenizer import train_byte_bpe

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
    return train_byte_bpe(vocab_size, [_CORPUS] * 4, SPECIALS)


def save_tokenizer(tok, directory: str | Path, *, max_length: int) -> list[Path]:
    """Write tokenizer.json and tokenizer_config.json (Kimi's special-token names) into ``directory``."""
    return tokenizer.save_tokenizer(tok, directory, max_length=max_length, bos=BOS, eos=EOS, pad=PAD)
