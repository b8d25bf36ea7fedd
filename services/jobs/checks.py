"""Checks a job runs on its teacher before step 0, from the driver (no JAX needed).

- compatibility: every replica's ``Info`` matches the student (vocabulary, special ids,
  tokenizer hash; :func:`~distill.teacher_contract.check_compatible`) and the replicas
  serve the same model (one model hash);
- determinism: each replica scores the same sequence twice, and every replica scores it
  the same, bit for bit; OPD's exact accounting assumes a teacher is a function.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from distill.teacher_contract import (
    CompatibilityError,
    Teacher,
    TeacherInfo,
    check_compatible,
)
from distill.tokenizer import Tokenizer


class TeacherSelfTestError(RuntimeError):
    """A teacher scored the same input differently."""


def check_teachers(
    teachers: Sequence[Teacher],
    names: Sequence[str],
    tokenizer: Tokenizer,
    student_vocab: int,
    probe: Sequence[int],
    *,
    cross_tokenizer_ok: bool = False,
) -> TeacherInfo:
    """Run both checks over ``teachers`` (``names`` label them in errors, e.g. addresses;
    ``probe`` is in the teachers' ids; ``cross_tokenizer_ok``: the job scores text with a
    teacher of another tokenizer, see :func:`~distill.teacher_contract.check_compatible`);
    returns their common info. Raises :class:`CompatibilityError` naming the field or
    :class:`TeacherSelfTestError` naming the replica."""
    if not teachers or len(names) != len(teachers):
        raise ValueError(
            f"`names` must name each of the {len(teachers)} teachers; received {len(names)}"
        )
    infos = [teacher.info() for teacher in teachers]
    for name, info in zip(names, infos, strict=True):
        try:
            check_compatible(info, tokenizer, student_vocab, cross_tokenizer_ok=cross_tokenizer_ok)
        except CompatibilityError as error:
            raise CompatibilityError(
                f"teacher {name} is incompatible with the student:\n{error}"
            ) from None
        if info.model_hash != infos[0].model_hash:
            raise CompatibilityError(
                f"`teacher.model_hash` must be the same on every replica ({names[0]}: "
                f"{infos[0].model_hash[:12]}); received {info.model_hash[:12]} from {name}"
            )
    reference = None
    for name, teacher in zip(names, teachers, strict=True):
        first = teacher.score([list(probe)])[0].log_probs
        second = teacher.score([list(probe)])[0].log_probs
        if not np.array_equal(first, second):
            raise TeacherSelfTestError(
                f"teacher determinism self-test failed: {name} scored the same sequence twice "
                f"differently (max |difference| {float(np.max(np.abs(first - second))):.3g})"
            )
        if reference is not None and not np.array_equal(first, reference):
            raise TeacherSelfTestError(
                f"teacher determinism self-test failed: {name} scores the probe differently "
                f"from {names[0]} (max |difference| "
                f"{float(np.max(np.abs(first - reference))):.3g})"
            )
        reference = first
    return infos[0]
