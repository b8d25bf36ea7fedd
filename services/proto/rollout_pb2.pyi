from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingSettings(_message.Message):
    __slots__ = ("alignment", "commit_rule", "threshold", "confidence", "schedule_steps", "strategy", "temperature", "greedy", "stop_when_done", "completion_length", "mask_id", "pad_id", "stop_ids")
    ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    COMMIT_RULE_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_STEPS_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    STOP_WHEN_DONE_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MASK_ID_FIELD_NUMBER: _ClassVar[int]
    PAD_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    alignment: str
    commit_rule: str
    threshold: float
    confidence: str
    schedule_steps: int
    strategy: str
    temperature: float
    greedy: bool
    stop_when_done: bool
    completion_length: int
    mask_id: int
    pad_id: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, alignment: _Optional[str] = ..., commit_rule: _Optional[str] = ..., threshold: _Optional[float] = ..., confidence: _Optional[str] = ..., schedule_steps: _Optional[int] = ..., strategy: _Optional[str] = ..., temperature: _Optional[float] = ..., greedy: _Optional[bool] = ..., stop_when_done: _Optional[bool] = ..., completion_length: _Optional[int] = ..., mask_id: _Optional[int] = ..., pad_id: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TraceRow(_message.Message):
    __slots__ = ("step", "row_id", "stream_position", "policy_version", "seed", "worker_id", "block_size", "settings", "tokens", "positions", "segment_ids", "prompt_mask", "completion_mask", "action_steps", "action_logps", "forwards", "decision_logps", "forced", "completion_ids", "completion_text")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROW_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_POSITION_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_MASK_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_MASK_FIELD_NUMBER: _ClassVar[int]
    ACTION_STEPS_FIELD_NUMBER: _ClassVar[int]
    ACTION_LOGPS_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    DECISION_LOGPS_FIELD_NUMBER: _ClassVar[int]
    FORCED_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TEXT_FIELD_NUMBER: _ClassVar[int]
    step: int
    row_id: int
    stream_position: int
    policy_version: int
    seed: int
    worker_id: str
    block_size: int
    settings: SamplingSettings
    tokens: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    segment_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_mask: _containers.RepeatedScalarFieldContainer[bool]
    completion_mask: _containers.RepeatedScalarFieldContainer[bool]
    action_steps: _containers.RepeatedScalarFieldContainer[int]
    action_logps: _containers.RepeatedScalarFieldContainer[float]
    forwards: int
    decision_logps: _containers.RepeatedScalarFieldContainer[float]
    forced: _containers.RepeatedScalarFieldContainer[bool]
    completion_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_text: str
    def __init__(self, step: _Optional[int] = ..., row_id: _Optional[int] = ..., stream_position: _Optional[int] = ..., policy_version: _Optional[int] = ..., seed: _Optional[int] = ..., worker_id: _Optional[str] = ..., block_size: _Optional[int] = ..., settings: _Optional[_Union[SamplingSettings, _Mapping]] = ..., tokens: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., segment_ids: _Optional[_Iterable[int]] = ..., prompt_mask: _Optional[_Iterable[bool]] = ..., completion_mask: _Optional[_Iterable[bool]] = ..., action_steps: _Optional[_Iterable[int]] = ..., action_logps: _Optional[_Iterable[float]] = ..., forwards: _Optional[int] = ..., decision_logps: _Optional[_Iterable[float]] = ..., forced: _Optional[_Iterable[bool]] = ..., completion_ids: _Optional[_Iterable[int]] = ..., completion_text: _Optional[str] = ...) -> None: ...
