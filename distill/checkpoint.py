"""Orbax checkpoints plus the run contract: fail-closed resume (DESIGN section 8).

A run directory holds ``contract.json`` (what must not change across a resume: tokenizer
hash, model configs, objective / loss / rollout / optimizer configs, data stream spec, stop
ids, seeds; plus the topology, which is only recorded) and ``checkpoints/<step>/`` written by an Orbax
``CheckpointManager``: the model and optimizer state (``state``), a JSON record
(``progress``: step, data position, policy version, metrics) and a copy of the contract the
step was written under (``contract``), so the contract travels with the weights.

- Saves are atomic (Orbax writes a temporary directory and renames it) and synchronous, so a
  step counted as saved is on disk; ``max_to_keep`` bounds disk use.
- :meth:`RunCheckpointer.open` refuses a directory whose contract differs from the given one
  in a must-match field, listing every such field with its old and new value, and a
  directory that holds checkpoints but no ``contract.json``; nothing is loaded.
- :meth:`RunCheckpointer.restore_latest` restores into fresh arrays and only then updates the
  live objects: a truncated or corrupt latest step is reported and the newest good step
  before it is used, never a half-loaded state.
- :meth:`RunCheckpointer.restore_latest` refuses a step whose own ``contract`` differs
  from the live one (a replaced ``contract.json``), before its state is read. Steps written
  before checkpoints carried a contract are checked against ``contract.json`` only.

Must match versus recorded. Every field outside ``topology`` changes what is trained (the
models, objective, optimizer, data order, seeds, tokenizer) and must match. The topology
(:func:`topology`: process and device counts, platform, device kind) is recorded: the same
restored parameters and the same per-row randomness (a function of seed, step and row, never
of the device or process count) continue the same computation on any hardware, only with
another floating-point reduction order. A topology difference is logged as a warning and
kept in :attr:`RunCheckpointer.recorded_changes`; each step stores the contract (topology
included) it was written under, so the run's hardware history travels with its weights.
Resuming is bitwise identical to an uninterrupted run only on the same topology.

Multi-process worlds (``jax.distributed``): every process of the world that holds shards of
the state opens the run and calls :meth:`RunCheckpointer.save` / ``restore_latest`` together
(Orbax synchronizes them and each writes its own shards; the lowest process writes the JSON
files). A program that runs on one process of a world only (host 0 of a slice) passes
``processes={0}`` (or sets it once with :func:`set_checkpoint_processes`), so Orbax
synchronizes that subset and never waits for the others.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

logger = logging.getLogger(__name__)

CONTRACT_FILE = "contract.json"

#: Contract sections that are recorded, not required: a difference is a warning. Everything
#: else must match to resume (see the module docstring for why).
RECORDED_SECTIONS: tuple[str, ...] = ("topology",)


class ContractMismatch(ValueError):
    """Resuming with a different setup; ``differences`` maps field -> (saved, given)."""

    def __init__(self, differences: Mapping[str, tuple[Any, Any]]):
        self.differences = dict(differences)
        lines = [
            f"`{field}` must equal the saved run's {saved!r} to resume; received {given!r}"
            for field, (saved, given) in sorted(self.differences.items())
        ]
        super().__init__(
            "run contract differs (resume with the saved run's settings, or start a new run "
            "directory):\n" + "\n".join(lines)
        )

    def __reduce__(self):
        # Rebuilt from its fields when pickled across processes (a Ray actor's error reaches
        # the driver), not from the message.
        return type(self), (self.differences,)


class ContractMissing(ContractMismatch):
    """A run directory holds checkpoints but not the contract they were written under."""

    def __init__(self, directory: Path):
        self.differences = {}
        self.directory = directory
        ValueError.__init__(
            self,
            f"`{CONTRACT_FILE}` must exist in a run directory that holds checkpoints; "
            f"received none in {directory}",
        )

    def __reduce__(self):
        return type(self), (self.directory,)


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
    """Every differing flattened field -> ``(saved, given)`` (``"<absent>"`` for a field one
    side lacks), recorded sections included."""
    old, new = flatten_contract(saved), flatten_contract(given)
    missing = object()
    return {
        field: (old.get(field, "<absent>"), new.get(field, "<absent>"))
        for field in sorted(old.keys() | new.keys())
        if old.get(field, missing) != new.get(field, missing)
    }


def is_recorded_field(field: str) -> bool:
    """Whether a flattened contract field is only recorded (see :data:`RECORDED_SECTIONS`)."""
    return any(field == section or field.startswith(f"{section}.") for section in RECORDED_SECTIONS)


def split_differences(
    differences: Mapping[str, tuple[Any, Any]],
) -> tuple[dict[str, tuple[Any, Any]], dict[str, tuple[Any, Any]]]:
    """``(must_match, recorded)`` parts of :func:`contract_differences`' answer."""
    must = {field: pair for field, pair in differences.items() if not is_recorded_field(field)}
    recorded = {field: pair for field, pair in differences.items() if is_recorded_field(field)}
    return must, recorded


def check_contract(
    saved: Mapping[str, Any], given: Mapping[str, Any], where: str
) -> dict[str, tuple[Any, Any]]:
    """Raise :class:`ContractMismatch` listing every must-match field that differs; log and
    return the recorded ones (``where`` names the saved side in the warning)."""
    must, recorded = split_differences(contract_differences(saved, given))
    if must:
        raise ContractMismatch(must)
    if recorded:
        logger.warning(
            "resuming %s on another topology (recorded, not required; not bitwise identical "
            "to an uninterrupted run): %s",
            where,
            ", ".join(f"{field} {old!r} -> {new!r}" for field, (old, new) in recorded.items()),
        )
    return recorded


def read_contract(directory: str | Path) -> dict[str, Any] | None:
    """The contract a run directory was started under (its ``contract.json``); None when it
    has none. Read only: deciding how to open a run (:meth:`RunCheckpointer.open` still
    checks every must-match field)."""
    path = Path(directory) / CONTRACT_FILE
    return json.loads(path.read_text()) if path.exists() else None


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
    """Process count, device count, platform and device kind (``cpu``, ``TPU v6 lite``):
    recorded in every contract, never required to match (see the module docstring)."""
    device = jax.devices()[0]
    return {
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "platform": device.platform,
        "device_kind": device.device_kind,
    }


_default_processes: frozenset[int] | None = None


def set_checkpoint_processes(processes: Collection[int] | None) -> None:
    """Process-wide default for :class:`RunCheckpointer`'s ``processes`` (None: the whole
    world). For a process of a multi-process world whose programs run on a subset only (host
    0 of a slice running a single-process role): set once, right after joining the world,
    like the world itself it holds for the life of the process."""
    global _default_processes
    _default_processes = None if processes is None else frozenset(processes)


def _participants(processes: Collection[int] | None) -> frozenset[int] | None:
    """The processes that run this checkpointer (None: the whole world), validated."""
    if processes is None:
        processes = _default_processes
    if processes is None:
        return None
    chosen = frozenset(int(process) for process in processes)
    count, me = jax.process_count(), jax.process_index()
    if not chosen or min(chosen) < 0 or max(chosen) >= count or me not in chosen:
        raise ValueError(
            f"`processes` must be process indices in [0, {count}) that include this process "
            f"({me}); received {sorted(chosen)}"
        )
    return None if len(chosen) == count else chosen


def _host_value(value: Any) -> Any:
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        raise ValueError(
            "`processes` must be every process of the world when the state is sharded across "
            f"processes; received an array sharded over {value.sharding}"
        )
    return np.asarray(value)


@dataclasses.dataclass(frozen=True)
class Restored:
    """What :meth:`RunCheckpointer.restore_latest` resumed from."""

    step: int
    progress: dict[str, Any]
    skipped: tuple[int, ...]  # newer steps that could not be restored


class RunCheckpointer:
    """Checkpoints of one run directory bound to one contract.

    ``processes``: the process indices of the ``jax.distributed`` world that run this
    checkpointer together (None: :func:`set_checkpoint_processes`' default, else all of
    them, as Orbax requires of a state sharded over the whole world); it must include the
    calling process. The lowest one writes the JSON files. A subset checkpoints host-local
    state only (saved as numpy by its lowest process; a sharded state raises ValueError).
    ``recorded_changes``: the recorded (topology) fields that differ from the run's contract.
    """

    def __init__(
        self,
        directory: str | Path,
        contract: Mapping[str, Any],
        max_to_keep: int = 3,
        *,
        processes: Collection[int] | None = None,
    ):
        if max_to_keep < 1:
            raise ValueError(f"`max_to_keep` must be >= 1; received {max_to_keep}")
        participants = _participants(processes)
        # A subset of a multi-process world holds host-local arrays, which Orbax refuses to
        # serialize there: they are saved as numpy by the subset's lowest process.
        self._host_local = participants is not None
        self.directory = Path(directory).absolute()
        self.contract = json.loads(json.dumps(dict(contract)))
        self.recorded_changes: dict[str, tuple[Any, Any]] = {}
        self._unreadable: set[int] = set()
        checkpoints = self.directory / "checkpoints"
        if participants is not None:
            # Orbax creates the directory only with every process taking part.
            checkpoints.mkdir(parents=True, exist_ok=True)
        multiprocessing = ocp.options.MultiprocessingOptions(
            primary_host=0 if participants is None else min(participants),
            active_processes=None if participants is None else set(participants),
            barrier_sync_key_prefix=None
            if participants is None
            else "distill-" + "-".join(map(str, sorted(participants))),
        )
        self._manager = ocp.CheckpointManager(
            checkpoints,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                enable_async_checkpointing=False,
                create=participants is None,
                multiprocessing_options=multiprocessing,
            ),
            item_handlers={
                "state": ocp.StandardCheckpointHandler(multiprocessing_options=multiprocessing),
                "progress": ocp.JsonCheckpointHandler(multiprocessing_options=multiprocessing),
                "contract": ocp.JsonCheckpointHandler(multiprocessing_options=multiprocessing),
            },
        )

    @classmethod
    def open(
        cls,
        directory: str | Path,
        contract: Mapping[str, Any],
        max_to_keep: int = 3,
        *,
        processes: Collection[int] | None = None,
    ) -> RunCheckpointer:
        """Open (or start) a run; an existing run's must-match fields must equal
        ``contract``'s (recorded ones are logged: :attr:`recorded_changes`), and a directory
        that already holds checkpoints must have its ``contract.json``. In a multi-process
        world every process in ``processes`` calls it; only the lowest writes the file."""
        participants = _participants(processes)
        writer = jax.process_index() == (0 if participants is None else min(participants))
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        contract_path = path / CONTRACT_FILE
        recorded: dict[str, tuple[Any, Any]] = {}
        if contract_path.exists():
            saved = json.loads(contract_path.read_text())
            recorded = check_contract(saved, contract, str(path))
        else:
            # Writing a fresh contract here would adopt old weights under any setup; even a
            # leftover temporary step means a run was started under some other contract.
            checkpoints = path / "checkpoints"
            if checkpoints.is_dir() and any(checkpoints.iterdir()):
                raise ContractMissing(path.absolute())
            if writer:
                temporary = contract_path.with_suffix(".tmp")
                temporary.write_text(json.dumps(contract, indent=2, sort_keys=True))
                temporary.replace(contract_path)
        opened = cls(path, contract, max_to_keep, processes=processes)
        opened.recorded_changes = recorded
        return opened

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
        if self._host_local:
            pure = jax.tree.map(_host_value, pure)
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
            if saved is not None:
                self.recorded_changes |= check_contract(saved, self.contract, f"step {step}")
            target = nnx.state(state)
            live = nnx.to_pure_dict(target)
            if self._host_local:
                abstract = jax.tree.map(lambda x: np.empty(x.shape, x.dtype), live)
            else:
                abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, live)
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
            values = restored.state
            if self._host_local:
                values = jax.tree.map(lambda x, old: jax.device_put(x, old.sharding), values, live)
            # An uncommitted live array (default single-device placement) stays uncommitted:
            # jit keys its cache on committedness, so a resumed phase would compile its step
            # again.
            values = jax.tree.map(
                lambda x, old: (
                    x if getattr(old, "committed", True) else jax.numpy.asarray(np.asarray(x))
                ),
                values,
                live,
            )
            nnx.replace_by_pure_dict(target, values)
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
