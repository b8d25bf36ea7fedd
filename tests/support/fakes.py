"""Shared fakes for tests and benches: a tiny job, tiny untrained models, scripted teachers.

Untrained models are enough wherever a test checks plumbing, validation or exactness (not
quality): they compile in seconds and every call is deterministic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from flax import nnx

from distill.config import load_config
from distill.models.transformer import Transformer
from distill.teacher import InProcessTeacher
from distill.teacher_contract import ScoredSequence, TeacherInfo
from services.common.config import JobSpec

ROOT = Path(__file__).resolve().parents[2]

#: Tiny models for deploy/configs/tiny.yaml: seconds per step on one core.
TINY_MODELS = (
    "teacher.d_model=32",
    "teacher.d_ff=64",
    "student.d_model=32",
    "student.d_ff=64",
    "student_init=scratch",
    "data.batch_size=4",
)
#: The teacher-training and student warm-up phases cut to two steps each (whole jobs).
TINY_PHASES = (
    "teacher_training.steps=2",
    "teacher_training.optimizer.warmup_steps=1",
    "teacher_training.eval_examples=2",
    "student_warmup.steps=2",
    "student_warmup.optimizer.warmup_steps=1",
    "student_warmup.eval_examples=2",
    "opd.eval_examples=2",
)
#: The tiny job of the library-level tests: tiny models, four OPD steps.
TINY_OVERRIDES = (*TINY_MODELS, "opd.steps=4", "opd.eval_examples=2")


def set_args(*overrides: str) -> list[str]:
    """``--set`` arguments of a ``distill`` command for ``overrides``."""
    return [part for override in overrides for part in ("--set", override)]


def tiny_job(*overrides: str) -> JobSpec:
    return load_config(ROOT / "deploy/configs/tiny.yaml", JobSpec, [*TINY_OVERRIDES, *overrides])


def tiny_models(job: JobSpec) -> tuple[Transformer, Transformer]:
    """(causal teacher, block-diffusion student), untrained, fixed seeds."""
    return (
        Transformer(job.teacher, rngs=nnx.Rngs(0)),
        Transformer(job.student, rngs=nnx.Rngs(1)),
    )


class ScriptedTeacher:
    """A teacher whose ``info`` can be altered and whose scores can be made to drift between
    calls (a non-deterministic teacher), over an in-process one."""

    def __init__(self, inner: InProcessTeacher, *, drift: float = 0.0, **info_changes):
        self.inner = inner
        self.drift = drift
        self.calls = 0
        self._info = dataclasses.replace(inner.info(), **info_changes)

    def info(self) -> TeacherInfo:
        return self._info

    def score(
        self, sequences: Sequence[Sequence[int]], *, top_k: int | None = None
    ) -> list[ScoredSequence]:
        self.calls += 1
        scored = self.inner.score(sequences, top_k=top_k)
        if not self.drift:
            return scored
        shift = np.float32(self.drift * self.calls)
        return [dataclasses.replace(s, log_probs=s.log_probs - shift) for s in scored]


def tiny_char_teacher(*, max_length: int = 64, seed: int = 0, **teacher_options):
    """An untrained tiny causal teacher on the character tokenizer (the services tests'
    teacher); ``teacher_options`` go to :class:`InProcessTeacher` (e.g. ``shapes``)."""
    from distill.config import ModelConfig
    from distill.tokenizer import CharTokenizer

    tokenizer = CharTokenizer()
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        attention_type="causal",
        init_std=0.2,
        max_length=max_length,
    )
    return InProcessTeacher(Transformer(config, rngs=nnx.Rngs(seed)), tokenizer, **teacher_options)
