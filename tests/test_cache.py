"""distill's cache root and JAX's persistent compilation cache under it."""

import subprocess
import sys
import textwrap

import pytest

from distill.cache import cache_dir, compile_cache_dir, enable_compile_cache


def test_the_cache_root_follows_distill_cache_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("DISTILL_CACHE", str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit"
    assert compile_cache_dir() == tmp_path / "explicit" / "jax"
    monkeypatch.delenv("DISTILL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "distill"


def test_off_leaves_the_cache_off_and_bad_arguments_are_refused_by_name(monkeypatch, tmp_path):
    assert enable_compile_cache("off") is None
    monkeypatch.setenv("DISTILL_COMPILE_CACHE", "off")
    assert enable_compile_cache() is None
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="`directory` must be a directory"):
        enable_compile_cache(tmp_path / "file")
    with pytest.raises(ValueError, match="`min_compile_s` must be a number >= 0"):
        enable_compile_cache(tmp_path / "jax", min_compile_s=-1)


PROGRAM = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp
    from distill.cache import enable_compile_cache

    enable_compile_cache(sys.argv[1], min_compile_s=0.0)
    step = jax.jit(lambda x: jnp.tanh(x @ x.T + 1.0).sum())
    print(float(step(jnp.ones((8, 8)))))
    """
)


def test_a_second_process_reads_what_the_first_compiled(tmp_path):
    # Fresh processes, so nothing is left in JAX's in-memory caches between the two runs.
    directory = tmp_path / "jax"
    env = {"JAX_PLATFORMS": "cpu", "PATH": ""}

    def run() -> str:
        command = [sys.executable, "-c", PROGRAM, str(directory)]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    first = run()
    written = sorted(path.name for path in directory.iterdir())
    assert any(name.startswith("jit_") for name in written), written
    assert run() == first
    # The second process found its program there: nothing new was written.
    assert sorted(path.name for path in directory.iterdir()) == written
