from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenSequence(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("sequences", "top_k")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    top_k: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., top_k: _Optional[int] = ...) -> None: ...

class SequenceScores(_message.Message):
    __slots__ = ("log_probs", "top_ids", "top_log_probs")
    LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    log_probs: _containers.RepeatedScalarFieldContainer[float]
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_log_probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, log_probs: _Optional[_Iterable[float]] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_log_probs: _Optional[_Iterable[float]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("sequences", "top_k")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceScores]
    top_k: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceScores, _Mapping]]] = ..., top_k: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("vocab_size", "pad_id", "bos_id", "mask_id", "stop_ids", "tokenizer_hash", "model_hash", "max_length")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAD_ID_FIELD_NUMBER: _ClassVar[int]
    BOS_ID_FIELD_NUMBER: _ClassVar[int]
    MASK_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    pad_id: int
    bos_id: int
    mask_id: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    tokenizer_hash: str
    model_hash: str
    max_length: int
    def __init__(self, vocab_size: _Optional[int] = ..., pad_id: _Optional[int] = ..., bos_id: _Optional[int] = ..., mask_id: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., tokenizer_hash: _Optional[str] = ..., model_hash: _Optional[str] = ..., max_length: _Optional[int] = ...) -> None: ...
