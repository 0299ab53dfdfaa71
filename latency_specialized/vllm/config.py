"""Which decode backend a vLLM deployment asked for, where that choice came from, and how it is carried.

Three ways to ask, one answer. Precedence (highest first), resolved once in the process that builds
the engine config (``EngineArgs.create_engine_config``, which ``vllm serve`` and ``vllm.LLM`` both use):

1. ``LATENCY_SPECIALIZED_DECODE_BACKEND`` (environment; non-empty) - wins over everything, logged.
2. ``--decode-backend`` (CLI flag; folded into ``additional_config["decode_backend"]`` first).
3. ``--additional-config '{"decode_backend": ...}'`` / ``vllm.LLM(additional_config=...)``. A flag
   that contradicts it is an error: one deployment, one choice.
4. Nothing set: ``auto`` = stock vLLM, untouched (the key is not even written).

**Carrying it.** vLLM 0.33's in-tree specialized decode (``KimiLinearForCausalLM`` inside
``KimiK3ForConditionalGeneration``, and ``DeepseekV41LLMForCausalLM`` inside
``DeepseekV41ForCausalLM``) reads ``additional_config["decode_backend"]`` in the model's
``__init__`` and switches *its own* executor on for the very value ``latency_specialized``. So the
answer is never left under that key when it is ours: :func:`apply` moves it to an entry of our
own, ``additional_config["latency_specialized"] = {"decode_backend": "latency_specialized",
"source": ...}``, which no vLLM reader looks at; our workers read that entry (:func:`resolve`).

``vllm_specialized`` (offered only when the installed vLLM ships the in-tree decode) is the way to
ask for vLLM's executor with the plugin installed: vLLM's key gets vLLM's spelling
(``"latency_specialized"``), our entry records ``vllm_specialized``, and our override stays off.
``auto`` leaves vLLM's key at ``auto`` (stock for both). Other values are rejected with the list of
valid ones.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from latency_specialized.errors import UserError

KEY = "decode_backend"
"""The additional_config key users write (vLLM 0.33's in-tree specialized decode reads it too)."""
OWN_KEY = "latency_specialized"
"""Our own additional_config entry, where the resolved choice is carried to the workers."""
ENV = "LATENCY_SPECIALIZED_DECODE_BACKEND"
"""Environment override of the key."""
OURS = "latency_specialized"
AUTO = "auto"
VLLM_INTREE = "vllm_specialized"
"""Our name for vLLM's in-tree specialized decode (vLLM >= 0.33)."""
INTREE_VALUE = "latency_specialized"
"""The value of vLLM's key that switches vLLM's in-tree executor on (vLLM 0.33 accepts it and auto)."""
CHOICES: tuple[str, ...] = (AUTO, OURS)
"""Values of ``--decode-backend`` on every vLLM (:func:`choices` adds vllm_specialized on vLLM >= 0.33)."""

Source = Literal["env", "flag", "additional_config", "default"]
_SOURCES = ("env", "flag", "additional_config")

# Packages of vLLM's in-tree specialized decode (vLLM >= 0.33). Their presence makes vllm_specialized
# a valid choice.
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

    @property
    def intree(self) -> bool:
        """vLLM's own in-tree specialized decode was asked for (vllm_specialized)."""
        return self.value == VLLM_INTREE

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
        raise UserError(f"{where} must be a non-empty string: use one of {', '.join(choices())}")
    return value.strip().lower().replace("-", "_")


def choices() -> tuple[str, ...]:
    """The valid values here: auto, latency_specialized, and vllm_specialized where vLLM ships it."""
    return CHOICES + ((VLLM_INTREE,) if intree_specialized_decode_present() else ())


def _check_known(value: str, where: str) -> str:
    valid = choices()
    if value in valid:
        return value
    if value == VLLM_INTREE:
        raise UserError(f"{where}={value!r} selects vLLM's in-tree specialized decode, which the installed "
                        f"vLLM does not ship (it comes with vLLM >= 0.33): use one of {', '.join(valid)}")
    raise UserError(f"{where}={value!r} is not a decode backend: use one of {', '.join(valid)} "
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


def _carried(additional_config: Mapping[str, Any]) -> BackendChoice | None:
    """The choice :func:`apply` already recorded under :data:`OWN_KEY` (None if there is none)."""
    entry = additional_config.get(OWN_KEY)
    if entry is None:
        return None
    where = f"additional_config[{OWN_KEY!r}]"
    if not isinstance(entry, Mapping) or KEY not in entry:
        raise UserError(f"{where} must be a dict with a {KEY!r} entry (the plugin writes it; to choose the backend "
                        f"use --decode-backend or additional_config {{{KEY!r}: ...}})")
    value = _check_known(_normalize(entry[KEY], f"{where}[{KEY!r}]"), f"{where}[{KEY!r}]")
    if value == AUTO:
        raise UserError(f"{where}[{KEY!r}] is auto: auto is written as additional_config {{{KEY!r}: 'auto'}}")
    raw = additional_config.get(KEY)
    expected = INTREE_VALUE if value == VLLM_INTREE else None
    if raw != expected:
        raise UserError(f"additional_config {KEY}={raw!r} contradicts {where}={dict(entry)!r}: set the backend "
                        f"in one place only")
    source = entry.get("source")
    return BackendChoice(value, source if source in _SOURCES else "additional_config")


def resolve(additional_config: Mapping[str, Any] | None, *, flag_given: bool = False,
            environ: Mapping[str, str] | None = None) -> BackendChoice:
    """The backend this deployment runs (env override > flag > additional_config > auto).

    Reads the entry :func:`apply` wrote (:data:`OWN_KEY`) when there is one - that is how workers
    and any second ``create_engine_config`` see the choice - else vLLM's key.
    ``flag_given`` only labels the source: the flag has already been folded into the key.
    """
    env = os.environ if environ is None else environ
    if env.get(ENV, "").strip():
        return BackendChoice(_check_known(_normalize(env[ENV], ENV), ENV), "env")
    carried = _carried(additional_config) if additional_config else None
    if carried is not None:
        return carried
    raw = (additional_config or {}).get(KEY)
    if raw is None:
        return BackendChoice(AUTO, "default")
    where = f"additional_config[{KEY!r}]"
    return BackendChoice(_check_known(_normalize(raw, where), where), "flag" if flag_given else "additional_config")


def apply(additional_config: Any, *, flag_given: bool = False,
          environ: Mapping[str, str] | None = None) -> tuple[BackendChoice, Any]:
    """Resolve, and write the result into a copy of ``additional_config`` the way it is carried.

    Returns (choice, config to use):

    * ``auto`` from nowhere: the config exactly as it was (same object), so that a deployment without
      the flag is byte-for-byte a deployment without the plugin;
    * ``auto``: ``decode_backend: auto`` (stock for vLLM's in-tree reader and for us);
    * ``latency_specialized``: **no** ``decode_backend`` key (vLLM 0.33's in-tree reader would switch
      its own executor on for that very value); ``latency_specialized: {decode_backend, source}``;
    * ``vllm_specialized``: ``decode_backend: latency_specialized`` for vLLM's reader, and our entry
      saying so, so that our workers stay off.

    Idempotent: ``apply`` of its own output gives the same output.
    """
    if additional_config is not None and not isinstance(additional_config, Mapping):
        raise UserError(f"additional_config is a {type(additional_config).__name__}, not a dict: pass "
                        f"--additional-config as a JSON object to use {KEY}")
    choice = resolve(additional_config, flag_given=flag_given, environ=environ)
    if choice.source == "default":
        return choice, additional_config
    out = dict(additional_config or {})
    out.pop(OWN_KEY, None)
    if choice.value == AUTO:
        out[KEY] = AUTO
        return choice, out
    out.pop(KEY, None)
    if choice.intree:
        out[KEY] = INTREE_VALUE
    out[OWN_KEY] = {KEY: choice.value, "source": choice.source}
    return choice, out


def apply_in_place(additional_config: Any, *, environ: Mapping[str, str] | None = None) -> BackendChoice:
    """:func:`apply` on a live config dict, rewriting it in place (only if that changes it).

    For workers whose ``vllm_config`` did not come through ``EngineArgs.create_engine_config`` (a
    ``VllmConfig`` built by hand): the rewrite then happens before the model is built, so vLLM's
    in-tree reader still never sees our value. After the front process' rewrite it changes nothing.
    """
    if not isinstance(additional_config, dict):  # None or a SupportsHash object: vLLM's readers see auto
        return resolve(None, environ=environ)
    choice, out = apply(additional_config, environ=environ)
    if out is not additional_config and out != additional_config:
        additional_config.clear()
        additional_config.update(out)
    return choice
