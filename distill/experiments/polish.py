"""Continue the finished OPD cells of a parallelism run with another loss, then evaluate.

Sampled reverse KL moves the student only through the log-prob of what it sampled (a
gradient scaled by 1 - p), so a token the student commits with p ~ 1 is barely corrected
however low the teacher scores it; a mass-covering loss (``forward_kl``: gradient p - q at
every vocabulary entry) pushes it regardless (docs/quality.md). This runs such a second
stage on every finished OPD cell of ``--run-dir``::

    python -m distill.experiments.polish --run-dir runs/parallelism/copy-cos4000-s0 \\
        --loss forward_kl --steps 300 --learning-rate 1e-4 --prompts 256 --samples 4 \\
        --ks 16 --thresholds 0.9

Each cell's second stage is an OPD run of its own (rollouts from the live student as in the
cell, the loss variant's overrides, ``--steps`` at a constant ``--learning-rate``) under
``polish/<cell>__<loss>__<steps>__lr<rate>/``, resumable from its checkpoints; its record (the
teacher and the continued student on ``--prompts`` x ``--samples``, as ``reevaluate``
writes) goes to ``polish/<cell>__<loss>__<steps>__lr<rate>__<prompts>x<samples>.json`` and is
reused when present.
The cell's own run directory is only read.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distill.experiments.parallelism import LOSS_VARIANTS, cell_job, load_cells
from distill.experiments.reevaluate import (
    Log,
    evaluation_arguments,
    evaluation_record,
    finished_cell,
    run_command,
    run_config,
)
from distill.experiments.run_dir import error, read_json, write_json


def polish(
    run_dir: str | Path,
    *,
    loss: str,
    steps: int,
    learning_rate: float,
    prompts: int,
    samples: int,
    ks: Sequence[int],
    thresholds: Sequence[float],
    log: Log = print,
) -> dict[str, dict[str, Any]]:
    """Continue every finished OPD cell of ``run_dir`` with the loss variant ``loss`` for
    ``steps`` steps at ``learning_rate`` and evaluate it; returns the records by name.
    Raises :class:`ExperimentError` naming the field for an unknown or non-OPD ``loss``,
    ``steps`` < 1 or a ``learning_rate`` that is not > 0."""
    from distill.job import job_tokenizer
    from distill.opd import run_opd
    from distill.pipeline import in_process_teacher

    if loss not in LOSS_VARIANTS or not LOSS_VARIANTS[loss].opd:
        opd = ", ".join(name for name, variant in LOSS_VARIANTS.items() if variant.opd)
        raise error("loss", f"name an OPD loss variant ({opd})", loss)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise error("steps", "be an int >= 1", steps)
    if not learning_rate > 0:
        raise error("learning_rate", "be > 0", learning_rate)
    run_dir = Path(run_dir)
    trained = run_config(run_dir)
    second = dataclasses.replace(
        trained,
        opd_steps=steps,
        checkpoint_every=min(trained.checkpoint_every, steps),
        overrides=(
            *trained.overrides,
            f"opd.optimizer.learning_rate={learning_rate}",
            "opd.optimizer.schedule=constant",
        ),
    )
    evaluation = dataclasses.replace(
        trained, eval_prompts=prompts, samples=samples, ks=tuple(ks), thresholds=tuple(thresholds)
    )
    records = {}
    for name, stored_cell in load_cells(run_dir).items():
        cell = stored_cell["cell"]
        if not LOSS_VARIANTS[cell["loss"]].opd:
            continue
        stage = f"{name}__{loss}__{steps}__lr{learning_rate:g}"
        path = run_dir / "polish" / f"{stage}__{prompts}x{samples}.json"
        record = read_json(path)
        if record is None:
            job, teacher, student = finished_cell(run_dir, trained, cell, log)
            stage_job = cell_job(cell["task"], cell["objective"], loss, cell["seed"], second)
            run_opd(
                stage_job,
                student,
                in_process_teacher(stage_job, teacher),
                job_tokenizer(stage_job),
                run_dir=run_dir / "polish" / stage,
                progress=False,
                log=log,
            )
            record = evaluation_record(run_dir, evaluation, cell, stage_job, teacher, student, log)
            record["polish"] = {"loss": loss, "steps": steps, "learning_rate": learning_rate}
            write_json(path, record)
        records[stage] = record
    return records


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distill.experiments.polish",
        description="Continue a parallelism run's finished OPD cells with another loss.",
    )
    evaluation_arguments(parser, ks=[16])
    parser.add_argument("--loss", default="forward_kl")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    args = parser.parse_args(argv)
    return run_command(
        lambda: polish(
            args.run_dir,
            loss=args.loss,
            steps=args.steps,
            learning_rate=args.learning_rate,
            prompts=args.prompts,
            samples=args.samples,
            ks=args.ks,
            thresholds=args.thresholds,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
