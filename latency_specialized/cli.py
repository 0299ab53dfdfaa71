"""`latency-specialized` command line.

Each subcommand lives in ``latency_specialized/commands/<name>.py`` with ``add_parser(sub)`` and
``run(args) -> int``. User errors (UserError) print one line naming the fix and exit 2, with no
traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from latency_specialized.errors import UserError

COMMANDS = (
    "models",
    "explain",
    "generate",
    "make_checkpoint",
    "bench_ops",
    "bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="latency-specialized",
        description="Small-batch decode backend for vLLM: list adapters, explain plans, generate, make checkpoints, bench.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        module = importlib.import_module(f"latency_specialized.commands.{name}")
        p = module.add_parser(sub)
        p.set_defaults(_run=module.run)
    return parser




def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
