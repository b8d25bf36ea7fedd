from services.proto import rollout_pb2 as _rollout_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class WorkAssignment(_message.Message):
    __slots__ = ("kind", "step", "row_start", "row_count", "stream_positions", "policy_version", "seed", "retry_after_ms")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[WorkAssignment.Kind]
        WORK: _ClassVar[WorkAssignment.Kind]
        WAIT: _ClassVar[WorkAssignment.Kind]
        DONE: _ClassVar[WorkAssignment.Kind]
    KIND_UNSPECIFIED: WorkAssignment.Kind
    WORK: WorkAssignment.Kind
    WAIT: WorkAssignment.Kind
    DONE: WorkAssignment.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ROW_COUNT_FIELD_NUMBER: _ClassVar[int]
    STREAM_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    kind: WorkAssignment.Kind
    step: int
    row_start: int
    row_count: int
    stream_positions: _containers.RepeatedScalarFieldContainer[int]
    policy_version: int
    seed: int
    retry_after_ms: int
    def __init__(self, kind: _Optional[_Union[WorkAssignment.Kind, str]] = ..., step: _Optional[int] = ..., row_start: _Optional[int] = ..., row_count: _Optional[int] = ..., stream_positions: _Optional[_Iterable[int]] = ..., policy_version: _Optional[int] = ..., seed: _Optional[int] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...

class PushSummary(_message.Message):
    __slots__ = ("accepted", "dropped_stale", "refused")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    dropped_stale: int
    refused: int
    def __init__(self, accepted: _Optional[int] = ..., dropped_stale: _Optional[int] = ..., refused: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LearnerStatus(_message.Message):
    __slots__ = ("step", "total_steps", "policy_version", "accepted_rows", "dropped_stale_rows", "refused_rows", "invalid_pushes", "queued_rows", "done", "error")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_ROWS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_ROWS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_ROWS_FIELD_NUMBER: _ClassVar[int]
    INVALID_PUSHES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_ROWS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    step: int
    total_steps: int
    policy_version: int
    accepted_rows: int
    dropped_stale_rows: int
    refused_rows: int
    invalid_pushes: int
    queued_rows: int
    done: bool
    error: str
    def __init__(self, step: _Optional[int] = ..., total_steps: _Optional[int] = ..., policy_version: _Optional[int] = ..., accepted_rows: _Optional[int] = ..., dropped_stale_rows: _Optional[int] = ..., refused_rows: _Optional[int] = ..., invalid_pushes: _Optional[int] = ..., queued_rows: _Optional[int] = ..., done: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...
