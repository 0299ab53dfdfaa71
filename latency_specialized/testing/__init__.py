"""Test helpers shipped with the package so third-party adapters can run the same matrix."""
