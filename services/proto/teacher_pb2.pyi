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
    __slots__ = ("sequences", "top_k", "shared_prompt", "candidates", "candidate_ids")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SHARED_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_IDS_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    top_k: int
    shared_prompt: TokenSequence
    candidates: int
    candidate_ids: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    def __init__(self, sequences: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., top_k: _Optional[int] = ..., shared_prompt: _Optional[_Union[TokenSequence, _Mapping]] = ..., candidates: _Optional[int] = ..., candidate_ids: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ...) -> None: ...

class SequenceScores(_message.Message):
    __slots__ = ("log_probs", "top_ids", "top_log_probs", "candidate_log_probs")
    LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    log_probs: _containers.RepeatedScalarFieldContainer[float]
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_log_probs: _containers.RepeatedScalarFieldContainer[float]
    candidate_log_probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, log_probs: _Optional[_Iterable[float]] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_log_probs: _Optional[_Iterable[float]] = ..., candidate_log_probs: _Optional[_Iterable[float]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("sequences", "top_k", "candidates")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceScores]
    top_k: int
    candidates: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceScores, _Mapping]]] = ..., top_k: _Optional[int] = ..., candidates: _Optional[int] = ...) -> None: ...

class TextPair(_message.Message):
    __slots__ = ("prompt", "completion", "stopped")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    completion: str
    stopped: bool
    def __init__(self, prompt: _Optional[str] = ..., completion: _Optional[str] = ..., stopped: _Optional[bool] = ...) -> None: ...

class ScoreTextRequest(_message.Message):
    __slots__ = ("pairs",)
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    pairs: _containers.RepeatedCompositeFieldContainer[TextPair]
    def __init__(self, pairs: _Optional[_Iterable[_Union[TextPair, _Mapping]]] = ...) -> None: ...

class TextScores(_message.Message):
    __slots__ = ("log_probs", "byte_ends", "stop_log_prob", "refusal")
    LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    BYTE_ENDS_FIELD_NUMBER: _ClassVar[int]
    STOP_LOG_PROB_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    log_probs: _containers.RepeatedScalarFieldContainer[float]
    byte_ends: _containers.RepeatedScalarFieldContainer[int]
    stop_log_prob: float
    refusal: str
    def __init__(self, log_probs: _Optional[_Iterable[float]] = ..., byte_ends: _Optional[_Iterable[int]] = ..., stop_log_prob: _Optional[float] = ..., refusal: _Optional[str] = ...) -> None: ...

class ScoreTextResponse(_message.Message):
    __slots__ = ("scores",)
    SCORES_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[TextScores]
    def __init__(self, scores: _Optional[_Iterable[_Union[TextScores, _Mapping]]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("vocab_size", "pad_id", "bos_id", "mask_id", "stop_ids", "tokenizer_hash", "model_hash", "max_length", "tokenizer_kind", "top_k_buckets", "candidate_buckets", "scores_text")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAD_ID_FIELD_NUMBER: _ClassVar[int]
    BOS_ID_FIELD_NUMBER: _ClassVar[int]
    MASK_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_KIND_FIELD_NUMBER: _ClassVar[int]
    TOP_K_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    SCORES_TEXT_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    pad_id: int
    bos_id: int
    mask_id: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    tokenizer_hash: str
    model_hash: str
    max_length: int
    tokenizer_kind: str
    top_k_buckets: _containers.RepeatedScalarFieldContainer[int]
    candidate_buckets: _containers.RepeatedScalarFieldContainer[int]
    scores_text: bool
    def __init__(self, vocab_size: _Optional[int] = ..., pad_id: _Optional[int] = ..., bos_id: _Optional[int] = ..., mask_id: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., tokenizer_hash: _Optional[str] = ..., model_hash: _Optional[str] = ..., max_length: _Optional[int] = ..., tokenizer_kind: _Optional[str] = ..., top_k_buckets: _Optional[_Iterable[int]] = ..., candidate_buckets: _Optional[_Iterable[int]] = ..., scores_text: _Optional[bool] = ...) -> None: ...
