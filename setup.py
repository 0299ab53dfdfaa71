"""Package discovery only (metadata lives in pyproject.toml).

``models/`` is shipped as the import package ``latency_specialized_models`` so that the
repository keeps the requested layout without installing a top-level ``models`` package.
"""

from setuptools import find_packages, setup

backend = find_packages(include=["latency_specialized", "latency_specialized.*"])
adapters = ["latency_specialized_models" + p[len("models"):] for p in find_packages(include=["models", "models.*"])]

setup(packages=backend + adapters, package_dir={"latency_specialized_models": "models"})
