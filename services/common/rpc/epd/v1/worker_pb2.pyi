from services.common.rpc.epd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVTransferSpec(_message.Message):
    __slots__ = ("direction", "skip_blocks", "peer")
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    direction: str
    skip_blocks: int
    peer: str
    def __init__(self, direction: _Optional[str] = ..., skip_blocks: _Optional[int] = ..., peer: _Optional[str] = ...) -> None: ...

class KVBlocks(_message.Message):
    __slots__ = ("request_id", "first_block", "num_tokens", "keys", "values", "data", "last", "has_first_token", "first_token", "first_logprobs", "has_logprobs", "rope_delta", "pair_id", "keys_tag", "values_tag")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    HAS_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ROPE_DELTA_FIELD_NUMBER: _ClassVar[int]
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_TAG_FIELD_NUMBER: _ClassVar[int]
    VALUES_TAG_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_block: int
    num_tokens: int
    keys: _common_pb2.TensorMeta
    values: _common_pb2.TensorMeta
    data: bytes
    last: bool
    has_first_token: bool
    first_token: int
    first_logprobs: _common_pb2.TokenLogprob
    has_logprobs: bool
    rope_delta: int
    pair_id: str
    keys_tag: int
    values_tag: int
    def __init__(self, request_id: _Optional[str] = ..., first_block: _Optional[int] = ..., num_tokens: _Optional[int] = ..., keys: _Optional[_Union[_common_pb2.TensorMeta, _Mapping]] = ..., values: _Optional[_Union[_common_pb2.TensorMeta, _Mapping]] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., has_first_token: _Optional[bool] = ..., first_token: _Optional[int] = ..., first_logprobs: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., has_logprobs: _Optional[bool] = ..., rope_delta: _Optional[int] = ..., pair_id: _Optional[str] = ..., keys_tag: _Optional[int] = ..., values_tag: _Optional[int] = ...) -> None: ...

class WorkerRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "media", "sampling", "cache_salt", "embedding_timeout_s", "generated_tokens", "relay_id", "kv_transfer")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RELAY_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    media: _containers.RepeatedCompositeFieldContainer[_common_pb2.MediaRef]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    embedding_timeout_s: float
    generated_tokens: int
    relay_id: str
    kv_transfer: KVTransferSpec
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., media: _Optional[_Iterable[_Union[_common_pb2.MediaRef, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., embedding_timeout_s: _Optional[float] = ..., generated_tokens: _Optional[int] = ..., relay_id: _Optional[str] = ..., kv_transfer: _Optional[_Union[KVTransferSpec, _Mapping]] = ...) -> None: ...

class WorkerResponse(_message.Message):
    __slots__ = ("token_ids", "finished", "finish_reason", "cached_tokens", "prefill_s", "encode_wait_s", "admitted", "state_at", "index", "logprobs", "request_id", "kv_skip_blocks")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    ENCODE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    STATE_AT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: str
    cached_tokens: int
    prefill_s: float
    encode_wait_s: float
    admitted: bool
    state_at: float
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    request_id: str
    kv_skip_blocks: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., prefill_s: _Optional[float] = ..., encode_wait_s: _Optional[float] = ..., admitted: _Optional[bool] = ..., state_at: _Optional[float] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., request_id: _Optional[str] = ..., kv_skip_blocks: _Optional[int] = ...) -> None: ...

class RelayOpen(_message.Message):
    __slots__ = ("relay_id",)
    RELAY_ID_FIELD_NUMBER: _ClassVar[int]
    relay_id: str
    def __init__(self, relay_id: _Optional[str] = ...) -> None: ...

class RelayBatch(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[WorkerResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[WorkerResponse, _Mapping]]] = ...) -> None: ...

class EmbeddingChunk(_message.Message):
    __slots__ = ("mm_hash", "meta", "data", "last")
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    mm_hash: str
    meta: _common_pb2.TensorMeta
    data: bytes
    last: bool
    def __init__(self, mm_hash: _Optional[str] = ..., meta: _Optional[_Union[_common_pb2.TensorMeta, _Mapping]] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("items", "bytes")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    items: int
    bytes: int
    def __init__(self, items: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class DistConnectRequest(_message.Message):
    __slots__ = ("pair_id", "backend", "timeout_s")
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    backend: str
    timeout_s: float
    def __init__(self, pair_id: _Optional[str] = ..., backend: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class DistConnectReply(_message.Message):
    __slots__ = ("store_addr",)
    STORE_ADDR_FIELD_NUMBER: _ClassVar[int]
    store_addr: str
    def __init__(self, store_addr: _Optional[str] = ...) -> None: ...

class DistItem(_message.Message):
    __slots__ = ("mm_hash", "meta", "tag")
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    mm_hash: str
    meta: _common_pb2.TensorMeta
    tag: int
    def __init__(self, mm_hash: _Optional[str] = ..., meta: _Optional[_Union[_common_pb2.TensorMeta, _Mapping]] = ..., tag: _Optional[int] = ...) -> None: ...

class DistTransfer(_message.Message):
    __slots__ = ("pair_id", "items", "timeout_s")
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    items: _containers.RepeatedCompositeFieldContainer[DistItem]
    timeout_s: float
    def __init__(self, pair_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[DistItem, _Mapping]]] = ..., timeout_s: _Optional[float] = ...) -> None: ...
