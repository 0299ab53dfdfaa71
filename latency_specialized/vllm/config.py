"""Which decode backend a vLLM deployment asked for, and where that choice came from.

One key decides: vLLM's own ``additional_config["decode_backend"]``. The ``--decode-backend`` flag
our plugin adds is sugar for that key, and ``LATENCY_SPECIALIZED_DECODE_BACKEND`` overrides both.
Precedence (highest first), resolved once in the process that builds the engine config:

1. ``LATENCY_SPECIALIZED_DECODE_BACKEND`` (environment; non-empty) - wins over everything, logged.
2. ``--decode-backend`` (CLI flag).
3. ``--additional-config '{"decode_backend": ...}'`` (the vLLM-native key). A flag that contradicts
   it is an error: one deployment, one choice.
4. Nothing set: ``auto`` = stock vLLM, untouched (the key is not even written).

vLLM 0.33's in-tree specialized decode (DeepSeek-V4.1, Kimi K3) reads the same key. Because the key
holds one value, exactly one backend can be named: ``latency_specialized`` installs ours, a value
vLLM's in-tree decode understands is left to vLLM and ours stays off. Values nobody understands are
rejected with the list of valid ones (on a vLLM without the in-tree decode, that is auto and
latency_specialized).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from latency_specialized.errors import UserError

KEY = "decode_backend"
"""The additional_config key (shared with vLLM 0.33's in-tree specialized decode)."""
ENV = "LATENCY_SPECIALIZED_DECODE_BACKEND"
"""Environment override of the key."""
OURS = "latency_specialized"
AUTO = "auto"
CHOICES: tuple[str, ...] = (AUTO, OURS)
"""Values of ``--decode-backend``."""

Source = Literal["env", "flag", "additional_config", "default"]

# Packages of vLLM's in-tree specialized decode (vLLM >= 0.33). Their presence means a value of the
# key other than ours may be theirs, so it is passed through instead of rejected.
INTREE_SPECIALIZED_DECODE = (
    "vllm.models.deepseek_v41.nvidia.specialized_decode",
    "vllm.models.kimi_k3.nvidia.specialized_decode",
)


@dataclass(frozen=True)
class BackendChoice:
    """The resolved decode backend of one deployment."""

    value: str
    """'auto', 'latency_specialized', or a value of vLLM's in-tree specialized decode."""
    source: Source
    """Where the value came from."""

    @property
    def ours(self) -> bool:
        return self.value == OURS

    def describe(self) -> str:
        where = {"env": f"${ENV}", "flag": "--decode-backend", "additional_config": f"additional_config[{KEY!r}]",
                 "default": "default"}[self.source]
        return f"decode_backend={self.value} (from {where})"


def intree_specialized_decode_present() -> bool:
    """True when the installed vLLM ships its own specialized decode (which reads the same key).

    Looks for the package directories without importing vLLM (importing it costs seconds).
    """
    spec = importlib.util.find_spec("vllm")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for name in INTREE_SPECIALIZED_DECODE:
        rel = Path(*name.split(".")[1:])
        if any((Path(root) / rel).is_dir() for root in roots):
            return True
    return False


def _normalize(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise UserError(f"{where} must be a non-empty string: use one of {', '.join(CHOICES)}")
    return value.strip().lower().replace("-", "_")


def _check_known(value: str, where: str) -> str:
    if value in CHOICES or intree_specialized_decode_present():
        return value
    raise UserError(f"{where}={value!r} is not a decode backend: use one of {', '.join(CHOICES)} "
                    f"(e.g. --decode-backend latency_specialized)")


def merge_flag(additional_config: Mapping[str, Any] | None, flag: str | None) -> dict[str, Any]:
    """additional_config with the ``--decode-backend`` flag folded into the key.

    Raises UserError when the flag contradicts a value already in additional_config.
    """
    merged = dict(additional_config or {})
    if flag is None:
        return merged
    value = _check_known(_normalize(flag, "--decode-backend"), "--decode-backend")
    if KEY in merged and merged[KEY] is not None:
        existing = _normalize(merged[KEY], f"additional_config[{KEY!r}]")
        if existing != value:
            raise UserError(f"--decode-backend {value} contradicts additional_config {KEY}={existing!r}: "
                            f"set the backend in one place only")
    merged[KEY] = value
    return merged


def resolve(additional_config: Mapping[str, Any] | None, *, flag_given: bool = False,
            environ: Mapping[str, str] | None = None) -> BackendChoice:
    """The backend this deployment runs (env override > flag > additional_config > auto).

    ``flag_given`` only labels the source: the flag has already been folded into the key.
    """
    env = os.environ if environ is None else environ
    if env.get(ENV, "").strip():
        return BackendChoice(_check_known(_normalize(env[ENV], ENV), ENV), "env")
    raw = (additional_config or {}).get(KEY)
    if raw is None:
        return BackendChoice(AUTO, "default")
    where = f"additional_config[{KEY!r}]"
    return BackendChoice(_check_known(_normalize(raw, where), where), "flag" if flag_given else "additional_config")


def apply(additional_config: Any, *, flag_given: bool = False,
          environ: Mapping[str, str] | None = None) -> tuple[BackendChoice, Any]:
    """Resolve and write the final value back into a copy of ``additional_config``.

    Returns (choice, config to use). ``auto`` from nowhere leaves the config exactly as it was, so
    that a deployment without the flag is byte-for-byte a deployment without the plugin.
    """
    if additional_config is not None and not isinstance(additional_config, Mapping):
        raise UserError(f"additional_config is a {type(additional_config).__name__}, not a dict: pass "
                        f"--additional-config as a JSON object to use {KEY}")
    choice = resolve(additional_config, flag_given=flag_given, environ=environ)
    if choice.source == "default":
        return choice, additional_config
    out = dict(additional_config or {})
    out[KEY] = choice.value
    return choice, out
