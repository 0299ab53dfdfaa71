"""Attention pieces (one module per attention kind)."""
