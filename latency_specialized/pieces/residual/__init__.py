"""Residual-scheme pieces (pre-norm add, ...)."""
