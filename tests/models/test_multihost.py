"""A multi-host learner on CPU: a 2-process ``jax.distributed`` world on loopback (2 forced
devices per process, a global data=2 x model=2 mesh) trains one SPMD step equal to the
single-process step, checkpoints it from every process, and a fresh world resumes with the
same parameters; a program on host 0 alone checkpoints with ``processes={0}``."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from distill.models import sharding
from tests.models.multihost_setup import as_numpy, build, flat_params, step_inputs, train_one_step
from tests.support.network import free_port

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("multihost_check.py")
PROCESSES = 2


def run_world(phase: str, run_dir: Path) -> None:
    """Both processes of the world, to completion (bounded)."""
    port = free_port()
    env = os.environ | {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                phase,
                str(rank),
                str(PROCESSES),
                str(port),
                str(run_dir),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(PROCESSES)
    ]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=400)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for rank, (process, output) in enumerate(zip(processes, outputs, strict=True)):
        assert process.returncode == 0, f"process {rank} of {phase}:\n{output[-4000:]}"
        assert f"process {rank}: {phase} done" in output


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("multihost")
    run_world("train", run_dir)
    run_world("resume", run_dir)
    return run_dir


def load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as archive:
        return {name: archive[name] for name in archive.files}


@pytest.fixture(scope="module")
def single_process_step():
    """The same step in this (single-process, one-device) JAX."""
    model, optimizer, objective = build(seed=0)
    before = as_numpy(flat_params(model))
    train_one_step(model, optimizer, objective, *step_inputs())
    return before, as_numpy(flat_params(model))


@pytest.mark.slow
def test_an_spmd_step_over_two_hosts_equals_the_single_process_step(worlds, single_process_step):
    before, expected = single_process_step
    got = load(worlds / "train.npz")
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, atol=1e-5, rtol=1e-5, err_msg=name)
    # The step moved the parameters: equality above is not the initial state twice.
    assert any(not np.allclose(got[name], before[name], atol=1e-4) for name in before)


@pytest.mark.slow
def test_a_fresh_two_process_world_resumes_the_sharded_checkpoint_bitwise(worlds):
    saved, resumed = load(worlds / "train.npz"), load(worlds / "resume.npz")
    assert saved.keys() == resumed.keys()
    for name in saved:
        np.testing.assert_array_equal(resumed[name], saved[name], err_msg=name)
    # Every process wrote its own shards of the one step (a world-wide checkpoint).
    state = worlds / "world" / "checkpoints" / "1" / "state"
    assert (state / "ocdbt.process_0").is_dir() and (state / "ocdbt.process_1").is_dir()


@pytest.mark.slow
def test_host_zero_alone_checkpoints_and_resumes_while_the_other_host_waits(worlds):
    saved, resumed = load(worlds / "train-host0.npz"), load(worlds / "resume-host0.npz")
    assert saved.keys() == load(worlds / "train.npz").keys()
    for name in saved:
        np.testing.assert_array_equal(resumed[name], saved[name], err_msg=name)
    assert not (worlds / "host0" / "checkpoints" / "1" / "state" / "ocdbt.process_1").exists()


def test_global_batch_places_rows_over_data_and_keeps_key_arrays():
    mesh = sharding.make_mesh(data=1, model=1)
    layout, keys = step_inputs()
    placed_layout, placed_keys = sharding.global_batch((layout, keys), mesh)
    assert placed_layout.tokens.sharding == sharding.batch_sharding(mesh, 2)
    np.testing.assert_array_equal(np.asarray(placed_layout.tokens), np.asarray(layout.tokens))
    assert placed_layout.block_size == layout.block_size
    np.testing.assert_array_equal(
        np.asarray(jax.random.key_data(placed_keys)), np.asarray(jax.random.key_data(keys))
    )
    gathered = sharding.gather({"tokens": placed_layout.tokens, "step": 3})
    assert isinstance(gathered["tokens"], np.ndarray) and gathered["step"] == 3
