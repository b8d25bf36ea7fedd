"""The commit planner: a small head on the student's final hidden states that gives each
masked slot a commit logit at each denoising step (``rollout.commit_rule: planner``).

``logit = w2 . silu(W1 h + b1) + b2`` per slot, float32; the commit probability is
``sigmoid(logit)``. ``h`` is the hidden state the slot's token proposal is read from (the
slot itself under ``same_position``, the previous logical position under ``shifted``), so
the planner judges the same state the token head samples from. It is part of the student's
parameters (trained, checkpointed and published with them); a student whose config has no
``planner_hidden`` has no planner at all. The warm-up objectives never read it, so a warm-up
run's trunk serves a student with any head or none (:func:`trunk_state`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from distill.config import ModelConfig

#: The student attribute holding its planner head: the first key of the head's state paths.
PLANNER_ATTRIBUTE = "planner"


class CommitPlanner(nnx.Module):
    """``[..., d_model]`` hidden states -> ``[...]`` float32 commit logits."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if config.planner_hidden is None:
            raise ValueError(
                "`config.planner_hidden` must be set to build a planner; received None"
            )
        width = config.planner_hidden
        common = dict(param_dtype=config.param_dtype, dtype=jnp.float32, rngs=rngs)
        init = nnx.initializers.normal(stddev=config.init_std)
        self.hidden = nnx.Linear(config.d_model, width, kernel_init=init, **common)
        # Zero output weights: every slot starts at commit probability 1/2, whatever the
        # trunk's features, so a fresh planner neither stalls nor commits whole blocks.
        self.out = nnx.Linear(width, 1, kernel_init=nnx.initializers.zeros_init(), **common)

    def __call__(self, hidden: jax.Array) -> jax.Array:
        features = nnx.silu(self.hidden(hidden.astype(jnp.float32)))
        return self.out(features)[..., 0].astype(jnp.float32)


def trunk_state(model: nnx.Module) -> nnx.State:
    """Every variable of ``model`` outside its planner head (all of them for a student
    without one): what moves between students that differ only in their head."""
    return nnx.state(model, nnx.Not(nnx.PathContains(PLANNER_ATTRIBUTE)))
