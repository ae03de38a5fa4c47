from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MediaRef(_message.Message):
    __slots__ = ("mm_hash", "modality", "offset", "num_tokens", "grid_thw", "second_per_grid_t", "frame_indices", "item_row")
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    SECOND_PER_GRID_T_FIELD_NUMBER: _ClassVar[int]
    FRAME_INDICES_FIELD_NUMBER: _ClassVar[int]
    ITEM_ROW_FIELD_NUMBER: _ClassVar[int]
    mm_hash: str
    modality: str
    offset: int
    num_tokens: int
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    second_per_grid_t: float
    frame_indices: _containers.RepeatedScalarFieldContainer[int]
    item_row: int
    def __init__(self, mm_hash: _Optional[str] = ..., modality: _Optional[str] = ..., offset: _Optional[int] = ..., num_tokens: _Optional[int] = ..., grid_thw: _Optional[_Iterable[int]] = ..., second_per_grid_t: _Optional[float] = ..., frame_indices: _Optional[_Iterable[int]] = ..., item_row: _Optional[int] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("dtype", "shape", "nbytes")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "n", "logprobs", "bad_words", "bad_words_token_ids", "min_tokens", "logit_bias", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p", "stop_token_ids", "json_schema", "json_object", "regex", "choice", "grammar", "any_whitespace")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    n: int
    logprobs: int
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    bad_words_token_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    min_p: float
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    any_whitespace: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., n: _Optional[int] = ..., logprobs: _Optional[int] = ..., bad_words: _Optional[_Iterable[str]] = ..., bad_words_token_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., any_whitespace: _Optional[bool] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class EncodeStages(_message.Message):
    __slots__ = ("held_s", "decode_queue_s", "decode_s", "prepare_s", "tower_s", "cache_write_s", "push_s")
    HELD_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    PREPARE_S_FIELD_NUMBER: _ClassVar[int]
    TOWER_S_FIELD_NUMBER: _ClassVar[int]
    CACHE_WRITE_S_FIELD_NUMBER: _ClassVar[int]
    PUSH_S_FIELD_NUMBER: _ClassVar[int]
    held_s: float
    decode_queue_s: float
    decode_s: float
    prepare_s: float
    tower_s: float
    cache_write_s: float
    push_s: float
    def __init__(self, held_s: _Optional[float] = ..., decode_queue_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., prepare_s: _Optional[float] = ..., tower_s: _Optional[float] = ..., cache_write_s: _Optional[float] = ..., push_s: _Optional[float] = ...) -> None: ...
