"""Subcommands of the `latency-specialized` CLI, one module each."""
