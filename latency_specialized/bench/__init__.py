"""Benchmarks: per-op (ops_bench*) and per-layer (layer_bench) timing on one GPU."""
