"""Kimi K3 adapter."""
