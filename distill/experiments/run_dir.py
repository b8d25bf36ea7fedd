"""What every experiment's run directory shares: atomic JSON files and the refusal to mix
configurations (``experiment.json`` records the format and configuration the directory was
started with; a rerun with another one is refused, naming the fields)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["ExperimentError", "check_run_dir", "error", "read_json", "write_json"]


class ExperimentError(ValueError):
    """An invalid experiment configuration or run directory ("`field` must ...; received ...")."""


def error(field: str, must: str, received: Any) -> ExperimentError:
    return ExperimentError(f"`{field}` must {must}; received {received!r}")


def read_json(path: Path) -> Any:
    """The JSON value in ``path``, or None when there is no such file."""
    return json.loads(path.read_text()) if path.is_file() else None


def write_json(path: Path, value: Any) -> None:
    """Atomic write: an interrupted run never leaves a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as out:
        json.dump(value, out, indent=2, sort_keys=True)
    os.replace(out.name, path)


def check_run_dir(run_dir: Path, experiment_format: str, config: Mapping[str, Any]) -> None:
    """Record ``experiment_format`` and ``config`` in ``run_dir/experiment.json`` on the first
    run; on later runs raise :class:`ExperimentError` naming `run_dir` (another format) or
    `config` with every differing key (``saved -> given``)."""
    path = run_dir / "experiment.json"
    wanted = {"format": experiment_format, "config": dict(config)}
    stored = read_json(path)
    if stored is None:
        write_json(path, wanted)
        return
    if stored.get("format") != experiment_format:
        raise error("run_dir", f"hold a {experiment_format} run", stored.get("format"))
    differing = sorted(
        key
        for key in set(stored["config"]) | set(wanted["config"])
        if stored["config"].get(key) != wanted["config"].get(key)
    )
    if differing:
        details = ", ".join(
            f"{key}: {stored['config'].get(key)!r} -> {wanted['config'].get(key)!r}"
            for key in differing
        )
        raise error("config", f"equal the run's ({path})", details)
