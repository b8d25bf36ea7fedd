"""The tiny warm-up step shared by the 2-process world (multihost_check.py) and the
single-process reference in test_multihost.py: the same student, batch, keys and update."""

import jax
import numpy as np
from flax import nnx

from distill.config import JobConfig, load_config
from distill.data.stream import TaskStream
from distill.diffusion.objectives import Objective
from distill.job import completion_length, job_tokenizer
from distill.models.transformer import Transformer
from distill.pipeline import phase_train_state
from distill.train import Trainer, batch_keys, task_layout

STEP = 1
# A small learning rate: Adam's first update is about lr * sign(gradient), so a gradient near
# zero whose rounding differs between one device and the sharded sum moves by up to lr.
JOB = [
    "teacher.d_model=32",
    "teacher.d_ff=64",
    "student.d_model=32",
    "student.d_ff=64",
    "student.n_layers=1",
    "student_init=scratch",
    "student.n_heads=4",
    "student.n_kv_heads=2",
    "data.batch_size=8",
    "student_warmup.optimizer.warmup_steps=0",
    "student_warmup.optimizer.schedule=constant",
    "student_warmup.optimizer.learning_rate=0.001",
]


def job() -> JobConfig:
    return load_config("deploy/configs/tiny.yaml", JobConfig, JOB)


def build(seed: int) -> tuple[Transformer, nnx.Optimizer, Objective]:
    config = job()
    model = Transformer(config.student, rngs=nnx.Rngs(seed))
    optimizer = phase_train_state(model, config.student_warmup)
    objective = Objective(config.objective, job_tokenizer(config).special.mask_id)
    return model, optimizer, objective


def step_inputs():
    """Step 0's global batch layout and its per-row keys, identical on every process."""
    config = job()
    stream = TaskStream(config.data)
    layout = task_layout(
        stream.batch(0, stream.batch_size),
        job_tokenizer(config),
        horizon=completion_length(config),
        block_size=config.student.block_size,
    )
    return layout, batch_keys(config.seed, 0, stream.batch_size)


def train_one_step(model, optimizer, objective, layout, keys) -> None:
    trainer = Trainer(model, optimizer)
    trainer.step(layout, keys, 0, objective=objective)
    trainer.sync()


def flat_params(model: Transformer) -> dict[str, jax.Array]:
    """Parameters by their path (``layers.0.attention.q_proj.kernel``)."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(map(str, path)): variable[...] for path, variable in flat}


def as_numpy(params: dict[str, jax.Array]) -> dict[str, np.ndarray]:
    return {name: np.asarray(value) for name, value in params.items()}
