"""Training curves as TensorBoard event files (written with tensorboardX), and a reader.

Every training phase with a run directory writes its per-step metrics under
``<run_dir>/tensorboard`` as the steps finish (tags ``<prefix>/<metric>``, evaluations as
``eval/*``), so a run's curves survive without its process. A resumed run purges what the
crashed run wrote after the resume step (TensorBoard's ``purge_step``), so each step keeps
one value; :func:`read_curves` applies the same rule.
"""

from __future__ import annotations

import math
import os
import struct
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

CURVES_DIR = "tensorboard"


class _Report(Protocol):
    overall: float
    tokens_per_forward: float
    agree_entropy_bits: float | None


class CurveWriter:
    """Appends scalars to ``directory`` (created if missing).

    Steps count finished steps (the metrics of the first step are at step 1, an evaluation
    before training at 0). ``resume_step``: the steps the run has already finished; events
    an earlier, crashed run wrote after it are hidden (TensorBoard's ``purge_step``).
    Non-finite values are skipped, not written. Not thread-safe; :meth:`close` flushes.
    """

    def __init__(self, directory: str | Path, *, resume_step: int = 0) -> None:
        if isinstance(resume_step, bool) or not isinstance(resume_step, int) or resume_step < 0:
            raise ValueError(
                f"`resume_step` must be a non-negative integer; received {resume_step!r}"
            )
        from tensorboardX import SummaryWriter

        self.directory = Path(directory)
        self.resume_step = resume_step
        self._evaluated: set[int] = set()
        # tensorboardX names files by the second: a rerun within the same second as the
        # run it resumes would overwrite that run's file without a suffix of its own.
        self._writer = SummaryWriter(
            str(self.directory),
            purge_step=resume_step + 1,
            filename_suffix=f".{os.getpid()}.{time.time_ns()}",
        )

    def scalars(self, prefix: str, metrics: Mapping[str, float], step: int) -> None:
        """Write ``metrics`` as ``<prefix>/<name>`` at ``step``."""
        for name, value in metrics.items():
            value = float(value)
            if math.isfinite(value):
                self._writer.add_scalar(f"{prefix}/{name}", value, step)

    def evaluation(self, step: int, report: _Report) -> None:
        """Write an evaluation's headline numbers under ``eval/`` at ``step``."""
        values = {"exact_match": report.overall, "tokens_per_forward": report.tokens_per_forward}
        if report.agree_entropy_bits is not None:
            values["agree_entropy_bits"] = report.agree_entropy_bits
        self.scalars("eval", values, step)
        self._evaluated.add(step)

    def evaluations(self, reports: Sequence[tuple[int, _Report]]) -> None:
        """Write the ``(step, report)`` evaluations not written yet; those before the resume
        step were written by the run that made them."""
        for step, report in reports:
            if step >= self.resume_step and step not in self._evaluated:
                self.evaluation(step, report)

    def close(self) -> None:
        self._writer.close()


def _events(path: Path):
    """The events of one TFRecord file (length, length crc, payload, payload crc)."""
    from tensorboardX.proto import event_pb2

    data = path.read_bytes()
    offset = 0
    while offset + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        payload = data[offset + 12 : offset + 12 + length]
        if len(payload) < length:  # a file cut while its writer was killed
            return
        yield event_pb2.Event.FromString(payload)
        offset += 12 + length + 4


def read_curves(directory: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag under ``directory`` as ``[(step, value), ...]`` sorted by step.

    Files are read in the order they were started; a file that begins with a purge (a
    resumed run) drops the earlier files' values at or after its step, and a later value
    for the same tag and step replaces an earlier one. A missing directory reads as {}.
    """
    from tensorboardX.proto.event_pb2 import SessionLog

    directory = Path(directory)
    files = []
    for path in directory.glob("events.out.tfevents.*"):
        events = list(_events(path))
        if events:
            files.append((events[0].wall_time, path.name, events))
    curves: dict[str, dict[int, float]] = {}
    for _, _, events in sorted(files, key=lambda item: item[:2]):
        for event in events:
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                for points in curves.values():
                    for step in [step for step in points if step >= event.step]:
                        del points[step]
            for value in event.summary.value:
                curves.setdefault(value.tag, {})[event.step] = value.simple_value
    return {tag: sorted(points.items()) for tag, points in sorted(curves.items())}
