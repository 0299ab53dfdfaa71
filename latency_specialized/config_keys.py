"""Config keys of a checkpoint's ``config.json``: unknown ones get one warning; missing or contradictory ones fail.

Published checkpoints carry keys no adapter maps: ``save_pretrained`` of a transformers config
writes its own attributes (``attention_bias``, ``layer_types``, ``model_max_length`` ...), and
vendors add theirs. An adapter names the keys it knows, section by section; :class:`ConfigKeys`
collects every other key and :meth:`ConfigKeys.warn` lists them, sorted, in a single
:class:`UnknownConfigKeysWarning`. A required key that is missing, or two spellings of one setting
that disagree, raise :class:`CheckpointError` naming the key(s).

Use::

    keys = ConfigKeys(where="ckpt/config.json", model="Kimi K3")
    keys.section(cfg, KNOWN_TOP)                       # top-level keys
    keys.section(cfg["text_config"], KNOWN_TEXT, prefix="text_config.")
    keys.require(cfg["text_config"], ("hidden_size", "vocab_size"), prefix="text_config.")
    ctx = keys.pick(text, "max_position_embeddings", "model_max_length", default=4096)
    keys.warn()                                        # once, after every section was seen
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from latency_specialized.errors import CheckpointError

__all__ = ["ConfigKeys", "UnknownConfigKeysWarning", "MISSING"]


class UnknownConfigKeysWarning(UserWarning):
    """A config.json holds keys the adapter does not read; they were ignored."""


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()
"""Default of :meth:`ConfigKeys.pick`: no default, the key is required."""


class ConfigKeys:
    """Collects a config's unknown keys across its sections; checks required and aliased keys.

    ``where`` (the file) and ``model`` (the adapter's name) start every message. A key whose value
    is ``null`` counts as absent, as it does for transformers and vLLM defaults.
    """

    def __init__(self, where: str = "config.json", model: str = "this adapter"):
        self.where = where
        self.model = model
        self._unknown: set[str] = set()
        self._warned = False

    # -- unknown keys -------------------------------------------------------------------------

    def section(self, cfg: Any, known: Collection[str], prefix: str = "") -> Mapping[str, Any]:
        """Note every key of the mapping ``cfg`` not in ``known`` (recorded as ``prefix + key``); returns ``cfg``.

        ``prefix`` names the section, e.g. ``"text_config."``. A ``cfg`` that is not a mapping is an
        error naming the section.
        """
        if not isinstance(cfg, Mapping):
            name = prefix.rstrip(".") or "(top level)"
            raise CheckpointError(f"{self.where}: config key {name} is {type(cfg).__name__}, not an object: "
                                  f"{self.model} needs a JSON object there")
        for k in cfg:
            if k not in known:
                self._unknown.add(prefix + str(k))
        return cfg

    @property
    def unknown(self) -> tuple[str, ...]:
        """The unknown keys noted so far, sorted, each with its section prefix."""
        return tuple(sorted(self._unknown))

    def warn(self, stacklevel: int = 2) -> tuple[str, ...]:
        """Issue one :class:`UnknownConfigKeysWarning` naming every unknown key (sorted); returns them.

        Nothing is issued when there are none, or when this object already warned.
        """
        names = self.unknown
        if names and not self._warned:
            self._warned = True
            n = len(names)
            warnings.warn(f"{self.where}: {self.model} ignores {n} unknown config key{'s' if n > 1 else ''}: "
                          f"{', '.join(names)}", UnknownConfigKeysWarning, stacklevel=stacklevel + 1)
        return names

    # -- required and aliased keys ------------------------------------------------------------

    def require(self, cfg: Mapping[str, Any], keys: Iterable[str], prefix: str = "", why: str = "") -> None:
        """CheckpointError naming every key of ``keys`` that ``cfg`` lacks (or holds as null)."""
        missing = [prefix + k for k in keys if cfg.get(k) is None]
        if missing:
            one = len(missing) == 1
            why = why or f"{self.model} needs {'it' if one else 'them'}"
            raise CheckpointError(f"{self.where}: config key{'' if one else 's'} {', '.join(missing)} "
                                  f"{'is' if one else 'are'} missing: {why}")

    def pick(self, cfg: Mapping[str, Any], *names: str, prefix: str = "", default: Any = MISSING) -> Any:
        """The value of a setting spelled several ways (``names``, e.g. vLLM's and transformers' spellings).

        The spellings present (not null) must agree, else CheckpointError naming each with its value;
        none present gives ``default``, or CheckpointError naming the first spelling if there is no default.
        """
        if not names:
            raise ValueError("pick needs at least one key name")
        present = [(n, cfg[n]) for n in names if cfg.get(n) is not None]
        if not present:
            if default is MISSING:
                alt = f" (or {', '.join(prefix + n for n in names[1:])})" if len(names) > 1 else ""
                raise CheckpointError(f"{self.where}: config key {prefix + names[0]}{alt} is missing: "
                                      f"{self.model} needs it")
            return default
        first = present[0][1]
        if any(v != first for _, v in present[1:]):
            said = " and ".join(f"{prefix + n} = {v!r}" for n, v in present)
            raise CheckpointError(f"{self.where}: config keys {said} contradict each other: they are one setting "
                                  "spelled two ways; make them equal or remove one")
        return first
