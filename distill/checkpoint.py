"""Orbax checkpoints plus the run contract: fail-closed resume (DESIGN section 8).

A run directory holds ``contract.json`` (everything that must not change across a resume:
tokenizer hash, model configs, objective / loss / rollout / optimizer configs, data stream
spec, stop ids, seeds, topology) and ``checkpoints/<step>/`` written by an Orbax
``CheckpointManager``: the model and optimizer state (``state``), a JSON record
(``progress``: step, data position, policy version, metrics) and a copy of the contract the
step was written under (``contract``), so the contract travels with the weights.

- Saves are atomic (Orbax writes a temporary directory and renames it) and synchronous, so a
  step counted as saved is on disk; ``max_to_keep`` bounds disk use.
- :meth:`RunCheckpointer.open` refuses a directory whose contract differs from the given one,
  listing every differing field with its old and new value, and a directory that holds
  checkpoints but no ``contract.json``; nothing is loaded.
- :meth:`RunCheckpointer.restore_latest` restores into fresh arrays and only then updates the
  live objects: a truncated or corrupt latest step is reported and the newest good step
  before it is used, never a half-loaded state.
- :meth:`RunCheckpointer.restore_latest` refuses a step whose own ``contract`` differs
  from the live one (a replaced ``contract.json``), before its state is read. Steps written
  before checkpoints carried a contract are checked against ``contract.json`` only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

logger = logging.getLogger(__name__)

CONTRACT_FILE = "contract.json"


class ContractMismatch(ValueError):
    """Resuming with a different setup; ``differences`` maps field -> (saved, given)."""

    def __init__(self, differences: Mapping[str, tuple[Any, Any]]):
        self.differences = dict(differences)
        lines = [
            f"`{field}` must equal the saved run's {saved!r} to resume; received {given!r}"
            for field, (saved, given) in sorted(self.differences.items())
        ]
        super().__init__("run contract differs:\n" + "\n".join(lines))


class ContractMissing(ContractMismatch):
    """A run directory holds checkpoints but not the contract they were written under."""

    def __init__(self, directory: Path):
        self.differences = {}
        ValueError.__init__(
            self,
            f"`{CONTRACT_FILE}` must exist in a run directory that holds checkpoints; "
            f"received none in {directory}",
        )


class CheckpointError(RuntimeError):
    """No usable checkpoint could be restored."""


def flatten_contract(contract: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mapping -> ``{"a.b.c": leaf}`` (lists and tuples compared as JSON lists)."""
    flat: dict[str, Any] = {}
    for key, value in contract.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat |= flatten_contract(value, prefix=f"{name}.")
        else:
            flat[name] = json.loads(json.dumps(value))
    return flat


def contract_differences(
    saved: Mapping[str, Any], given: Mapping[str, Any]
) -> dict[str, tuple[Any, Any]]:
    old, new = flatten_contract(saved), flatten_contract(given)
    missing = object()
    return {
        field: (old.get(field, "<absent>"), new.get(field, "<absent>"))
        for field in sorted(old.keys() | new.keys())
        if old.get(field, missing) != new.get(field, missing)
    }


def extend_ledger(ledger: list[list[int]], start: int, end: int) -> list[list[int]]:
    """The data ledger (ranges ``[start, end)`` of stream positions trained by the lineage
    of a state) with ``[start, end)`` appended; contiguous ranges merge. Overlap would mean
    a sample trained twice: refused."""
    if ledger and start < ledger[-1][1]:
        raise CheckpointError(
            f"`ledger` must not train position {start} twice (trained up to {ledger[-1][1]})"
        )
    if ledger and start == ledger[-1][1]:
        return [*ledger[:-1], [ledger[-1][0], end]]
    return [*ledger, [start, end]]


def restored_ledger(restored: Restored | None, position: int, directory: Path) -> list[list[int]]:
    """The ledger of a restored checkpoint, which must end at its trained ``position``."""
    ledger: list[list[int]] = [] if restored is None else restored.progress.get("ledger", [])
    trained = ledger[-1][1] if ledger else 0
    if trained != position:
        raise CheckpointError(
            f"`ledger` must end at the checkpoint's trained position {position}; it ends at "
            f"{trained} in {directory}"
        )
    return ledger


def topology() -> dict[str, Any]:
    """Process count, device count and platform: part of every contract."""
    return {
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "platform": jax.devices()[0].platform,
    }


@dataclasses.dataclass(frozen=True)
class Restored:
    """What :meth:`RunCheckpointer.restore_latest` resumed from."""

    step: int
    progress: dict[str, Any]
    skipped: tuple[int, ...]  # newer steps that could not be restored


class RunCheckpointer:
    """Checkpoints of one run directory bound to one contract."""

    def __init__(self, directory: str | Path, contract: Mapping[str, Any], max_to_keep: int = 3):
        if max_to_keep < 1:
            raise ValueError(f"`max_to_keep` must be >= 1; received {max_to_keep}")
        self.directory = Path(directory).absolute()
        self.contract = json.loads(json.dumps(dict(contract)))
        self._unreadable: set[int] = set()
        self._manager = ocp.CheckpointManager(
            self.directory / "checkpoints",
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, enable_async_checkpointing=False, create=True
            ),
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "progress": ocp.JsonCheckpointHandler(),
                "contract": ocp.JsonCheckpointHandler(),
            },
        )

    @classmethod
    def open(
        cls, directory: str | Path, contract: Mapping[str, Any], max_to_keep: int = 3
    ) -> RunCheckpointer:
        """Open (or start) a run; an existing run must have an identical contract, and a
        directory that already holds checkpoints must have its ``contract.json``."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        contract_path = path / CONTRACT_FILE
        if contract_path.exists():
            saved = json.loads(contract_path.read_text())
            differences = contract_differences(saved, contract)
            if differences:
                raise ContractMismatch(differences)
        else:
            # Writing a fresh contract here would adopt old weights under any setup; even a
            # leftover temporary step means a run was started under some other contract.
            checkpoints = path / "checkpoints"
            if checkpoints.is_dir() and any(checkpoints.iterdir()):
                raise ContractMissing(path.absolute())
            temporary = contract_path.with_suffix(".tmp")
            temporary.write_text(json.dumps(contract, indent=2, sort_keys=True))
            temporary.replace(contract_path)
        return cls(path, contract, max_to_keep)

    @property
    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, progress: Mapping[str, Any]) -> None:
        """Save ``state`` (an nnx graph node or tuple of them) and the JSON ``progress``.
        A step that :meth:`restore_latest` found unreadable is replaced."""
        if step in self._unreadable:
            logger.warning("replacing unreadable checkpoint step %d", step)
            self._manager.delete(step)
            self._unreadable.discard(step)
        pure = nnx.to_pure_dict(nnx.state(state))
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(pure),
                progress=ocp.args.JsonSave(dict(progress) | {"step": step}),
                contract=ocp.args.JsonSave(self.contract),
            ),
            force=True,
        )
        self._manager.wait_until_finished()

    def _saved_contract(self, step: int) -> dict[str, Any] | None:
        """The contract stored with ``step``; None for a step written before checkpoints
        carried one."""
        step_path = ocp.step.find_step_path(
            self._manager.directory, ocp.step.standard_name_format(), step=step
        )
        if not (step_path / "contract").exists():
            return None
        restored = self._manager.restore(
            step, args=ocp.args.Composite(contract=ocp.args.JsonRestore())
        )
        return dict(restored.contract)

    def restore_latest(self, state: Any) -> Restored | None:
        """Restore the newest restorable step into ``state`` (in place); None when the run
        has no checkpoint. Corrupt newer steps are skipped with a warning. Raises
        :class:`ContractMismatch` when the step's stored contract differs from this run's."""
        skipped: list[int] = []

        def skip(step: int, error: Exception) -> None:
            logger.warning("checkpoint step %d is unreadable (%s); trying older", step, error)
            skipped.append(step)
            self._unreadable.add(step)

        for step in reversed(self.steps):
            try:
                saved = self._saved_contract(step)
            except Exception as error:  # noqa: BLE001 - any failure means "not restorable"
                skip(step, error)
                continue
            # Checked before the state is read: weights of another setup are never loaded.
            differences = {} if saved is None else contract_differences(saved, self.contract)
            if differences:
                raise ContractMismatch(differences)
            target = nnx.state(state)
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.to_pure_dict(target))
            try:
                restored = self._manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract),
                        progress=ocp.args.JsonRestore(),
                    ),
                )
            except Exception as error:  # noqa: BLE001 - any failure means "not restorable"
                skip(step, error)
                continue
            nnx.replace_by_pure_dict(target, restored.state)
            nnx.update(state, target)
            return Restored(step, dict(restored.progress), tuple(skipped))
        if skipped:
            raise CheckpointError(
                f"`checkpoints` must hold a restorable step; steps {skipped} in "
                f"{self.directory} are all unreadable"
            )
        return None

    def close(self) -> None:
        self._manager.close()
