"""One process of a 2-process ``jax.distributed`` world on loopback (CPU, 2 forced devices
each): the multi-host learner's program. Used by test_multihost.py; not collected by pytest.

``python multihost_check.py PHASE PROCESS_ID NUM_PROCESSES PORT RUN_DIR``

- ``train``: a fresh block-diffusion student (seed 0) and its optimizer sharded over the
  global (data=2 hosts, model=2) mesh, one SPMD warm-up step on the global batch, then a
  checkpoint saved by every process (``RUN_DIR/world``); process 0 alone also saves an
  unsharded copy on its own first device with ``processes={0}`` (set process-wide by
  ``set_checkpoint_processes``) (``RUN_DIR/host0``: a
  program that runs on host 0 only, while process 1 never opens a checkpoint).
- ``resume``: a differently initialised student (seed 1), sharded the same way, restored
  from ``RUN_DIR/world`` by every process; process 0 alone restores ``RUN_DIR/host0``.

Process 0 writes the parameters it ends with to ``RUN_DIR/<phase>.npz`` (gathered from the
whole world) and ``RUN_DIR/<phase>-host0.npz``.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from distill.checkpoint import (  # noqa: E402
    RunCheckpointer,
    set_checkpoint_processes,
    topology,
)
from distill.models import sharding  # noqa: E402
from tests.models.multihost_setup import (  # noqa: E402
    STEP,
    build,
    flat_params,
    step_inputs,
    train_one_step,
)


def main(phase: str, process_id: int, num_processes: int, port: int, run_dir: str) -> None:
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        coordinator_bind_address=f"127.0.0.1:{port}",
        initialization_timeout=120,
    )
    assert jax.process_count() == num_processes and jax.device_count() == 2 * num_processes
    mesh = sharding.make_mesh(data=num_processes, model=2)
    contract = {"name": "multihost", "topology": topology()}
    seed = 0 if phase == "train" else 1
    model, optimizer, objective = build(seed)
    sharding.shard_state((optimizer, model), mesh)
    world = RunCheckpointer.open(os.path.join(run_dir, "world"), contract)
    if phase == "train":
        layout, keys = step_inputs()
        with sharding.use_mesh(mesh):
            train_one_step(
                model, optimizer, objective, *sharding.global_batch((layout, keys), mesh)
            )
        world.save(STEP, (optimizer, model), {"phase": phase})
    else:
        restored = world.restore_latest((optimizer, model))
        assert restored is not None and restored.step == STEP, restored
    world.close()
    params = sharding.gather(flat_params(model))
    trained = sharding.gather(nnx.state((optimizer, model)))  # collectives: every process
    if process_id == 0:
        np.savez(os.path.join(run_dir, f"{phase}.npz"), **params)
        local_model, local_optimizer, _ = build(seed)  # on this process's first device only
        # What host 0 of a slice running a single-process role does once it joined.
        set_checkpoint_processes({0})
        host0 = RunCheckpointer.open(os.path.join(run_dir, "host0"), contract)
        if phase == "train":
            nnx.update((local_optimizer, local_model), jax.tree.map(jnp.asarray, trained))
            host0.save(STEP, (local_optimizer, local_model), {"phase": phase})
        else:
            restored = host0.restore_latest((local_optimizer, local_model))
            assert restored is not None and restored.step == STEP, restored
        host0.close()
        np.savez(os.path.join(run_dir, f"{phase}-host0.npz"), **flat_params(local_model))
    # Nobody leaves (and tears the coordination service down) before process 0 is done.
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(f"done-{phase}")
    print(f"process {process_id}: {phase} done", flush=True)


if __name__ == "__main__":
    phase, process_id, num_processes, port, run_dir = sys.argv[1:]
    main(phase, int(process_id), int(num_processes), int(port), run_dir)
