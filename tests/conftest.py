"""Shared test set-up: CPU only, float32 matmuls, deterministic XLA."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "float32")
