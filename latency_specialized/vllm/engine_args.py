"""``--decode-backend`` on vLLM's engine arguments (``vllm serve``, the OpenAI api_server, EngineArgs).

vLLM loads general plugins before it builds its argument parser (``AsyncEngineArgs.add_cli_args``
calls ``load_general_plugins()`` and then looks ``EngineArgs.add_cli_args`` up), so wrapping that
static method adds the option to every vLLM command line. Three wraps, each idempotent:

* ``EngineArgs.add_cli_args`` adds ``--decode-backend {auto,latency_specialized}`` (own help group).
* ``EngineArgs.from_cli_args`` folds the flag into ``additional_config["decode_backend"]``.
* ``EngineArgs.create_engine_config`` applies the precedence of :mod:`latency_specialized.vllm.config`
  (env override, validation) once, in the process that builds the config (``vllm serve``, the
  api_server and ``vllm.LLM`` all come through it), and moves our value out of
  ``decode_backend`` into ``additional_config["latency_specialized"]`` before vLLM builds anything:
  vLLM 0.33's in-tree specialized decode reads ``decode_backend`` in the model's ``__init__``.
  Workers read our entry.
"""

from __future__ import annotations

import argparse
import functools
import logging
from types import ModuleType
from typing import Any

from latency_specialized.vllm import config as backend_config

log = logging.getLogger("vllm.latency_specialized")

_MARK = "__latency_specialized_wrapped__"
_FLAG_DEST = "decode_backend"
# Set on EngineArgs instances built from a command line that carried --decode-backend.
_FLAG_ATTR = "_latency_specialized_flag"

HELP_GROUP = "DecodeBackend"
HELP = (f"--decode-backend {{{','.join(backend_config.CHOICES)}}}: which path runs pure decode steps "
        f"(latency_specialized plugin). 'auto' is stock vLLM; 'latency_specialized' runs the model "
        f"adapter's decode program where it is in scope. Same as --additional-config "
        f"'{{\"{backend_config.KEY}\": ...}}'; ${backend_config.ENV} overrides both.")
"""Help text on a vLLM without the in-tree specialized decode (vLLM 0.32)."""
HELP_INTREE = (f" On this vLLM '{backend_config.VLLM_INTREE}' selects vLLM's own in-tree specialized decode "
               f"(Kimi K3, DeepSeek-V4.1; Blackwell only) instead of ours.")


def _add_option(parser: Any) -> None:
    if any(_FLAG_DEST == a.dest for a in getattr(parser, "_actions", [])):
        return  # parser already has it (EngineArgs.add_cli_args called twice on one parser)
    valid = backend_config.choices()
    intree = backend_config.VLLM_INTREE in valid
    description = HELP.replace(",".join(backend_config.CHOICES), ",".join(valid), 1) + (HELP_INTREE if intree else "")
    group = parser.add_argument_group(title=HELP_GROUP, description=description)
    group.add_argument("--decode-backend", dest=_FLAG_DEST, choices=list(valid), default=None,
                       help="Decode path of pure decode steps: 'auto' (stock vLLM) or 'latency_specialized'"
                            + (f" or '{backend_config.VLLM_INTREE}' (vLLM's in-tree one)" if intree else "")
                            + f". Same as additional_config['{backend_config.KEY}'].")


def patch(arg_utils: ModuleType) -> None:
    """Wrap EngineArgs' CLI and config methods (idempotent; called when vllm.engine.arg_utils loads)."""
    engine_args = arg_utils.EngineArgs
    if getattr(engine_args.add_cli_args, _MARK, False):
        return

    original_add = engine_args.add_cli_args

    @functools.wraps(original_add)
    def add_cli_args(parser, *args, **kwargs):
        parser = original_add(parser, *args, **kwargs)
        _add_option(parser)
        return parser

    setattr(add_cli_args, _MARK, True)
    engine_args.add_cli_args = staticmethod(add_cli_args)

    original_from = engine_args.from_cli_args.__func__

    @functools.wraps(original_from)
    def from_cli_args(cls, args: argparse.Namespace):
        built = original_from(cls, args)
        flag = getattr(args, _FLAG_DEST, None)
        if flag is not None:
            built.additional_config = backend_config.merge_flag(built.additional_config, flag)
            setattr(built, _FLAG_ATTR, True)
        return built

    engine_args.from_cli_args = classmethod(from_cli_args)

    original_create = engine_args.create_engine_config

    @functools.wraps(original_create)
    def create_engine_config(self, *args, **kwargs):
        choice, self.additional_config = backend_config.apply(
            self.additional_config, flag_given=bool(getattr(self, _FLAG_ATTR, False)))
        if choice.source != "default":
            carried = {backend_config.OURS: f"carried as additional_config[{backend_config.OWN_KEY!r}], "
                                            f"not under {backend_config.KEY!r}",
                       backend_config.VLLM_INTREE: f"vLLM's in-tree specialized decode: additional_config"
                                                   f"[{backend_config.KEY!r}]={backend_config.INTREE_VALUE!r}"}
            log.info("latency_specialized: %s%s", choice.describe(),
                     f" ({carried[choice.value]})" if choice.value in carried else "")
        if choice.source == "env":
            log.warning("latency_specialized: $%s overrides --decode-backend and additional_config",
                        backend_config.ENV)
        return original_create(self, *args, **kwargs)

    engine_args.create_engine_config = create_engine_config
