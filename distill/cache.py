"""Where distill keeps what it can rebuild: downloaded files, normalised corpora and compiled
XLA programs.

The root is ``$DISTILL_CACHE``, else ``$XDG_CACHE_HOME/distill``, else ``~/.cache/distill``.
:func:`enable_compile_cache` points JAX's persistent compilation cache under it, so a process
that compiles the same programs again (a teacher server restarted, a replica brought back by
Ray) reads them from disk instead of compiling: on the 30-layer SmolLM2 teacher each shape
takes 7-20 s to compile on this project's 2-core machine (docs/performance.md).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir", "compile_cache_dir", "enable_compile_cache"]


def cache_dir() -> Path:
    """Root of distill's caches: ``$DISTILL_CACHE``, else ``$XDG_CACHE_HOME/distill``, else
    ``~/.cache/distill``."""
    explicit = os.environ.get("DISTILL_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "distill"


def compile_cache_dir() -> Path:
    """The default directory of JAX's persistent compilation cache: ``cache_dir()/jax``."""
    return cache_dir() / "jax"


def enable_compile_cache(
    directory: Path | str | None = None, *, min_compile_s: float = 1.0
) -> Path | None:
    """Turn on JAX's persistent compilation cache in ``directory`` for this process (created
    if missing); programs that took at least ``min_compile_s`` seconds to compile are written
    there and read back by any later process compiling the same program with the same JAX
    version, backend and flags. Returns the directory, or None when the cache stays off.

    ``directory`` None means ``$DISTILL_COMPILE_CACHE`` if set, else
    :func:`compile_cache_dir`; the value ``"off"`` (argument or variable) leaves the cache
    off. Fails with ``ValueError`` naming the field for a ``directory`` that exists and is
    not a directory, or a negative ``min_compile_s``."""
    if directory is None:
        directory = os.environ.get("DISTILL_COMPILE_CACHE") or compile_cache_dir()
    if str(directory) == "off":
        return None
    import jax

    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise ValueError(f"`directory` must be a directory; received the file {str(path)!r}")
    if not (isinstance(min_compile_s, int | float) and min_compile_s >= 0):
        raise ValueError(f"`min_compile_s` must be a number >= 0; received {min_compile_s!r}")
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_s))
    return path
