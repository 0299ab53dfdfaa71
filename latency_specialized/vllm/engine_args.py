"""``--decode-backend`` on vLLM's engine arguments (``vllm serve``, the OpenAI api_server, EngineArgs).

vLLM loads general plugins before it builds its argument parser (``AsyncEngineArgs.add_cli_args``
calls ``load_general_plugins()`` and then looks ``EngineArgs.add_cli_args`` up), so wrapping that
static method adds the option to every vLLM command line. Three wraps, each idempotent:

* ``EngineArgs.add_cli_args`` adds ``--decode-backend {auto,latency_specialized}`` (own help group).
* ``EngineArgs.from_cli_args`` folds the flag into ``additional_config["decode_backend"]``.
* ``EngineArgs.create_engine_config`` applies the precedence of :mod:`latency_specialized.vllm.config`
  (env override, validation) once, in the process that builds the config; workers read the key.
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


def _add_option(parser: Any) -> None:
    if any(_FLAG_DEST == a.dest for a in getattr(parser, "_actions", [])):
        return  # parser already has it (EngineArgs.add_cli_args called twice on one parser)
    group = parser.add_argument_group(title=HELP_GROUP, description=HELP)
    group.add_argument("--decode-backend", dest=_FLAG_DEST, choices=list(backend_config.CHOICES), default=None,
                       help="Decode path of pure decode steps: 'auto' (stock vLLM) or 'latency_specialized'. "
                            f"Maps to additional_config['{backend_config.KEY}'].")


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
            log.info("latency_specialized: %s", choice.describe())
        if choice.source == "env":
            log.warning("latency_specialized: $%s overrides --decode-backend and additional_config",
                        backend_config.ENV)
        return original_create(self, *args, **kwargs)

    engine_args.create_engine_config = create_engine_config
