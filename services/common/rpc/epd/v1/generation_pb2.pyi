from services.common.rpc.epd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Media(_message.Message):
    __slots__ = ("data", "url", "mime_type")
    DATA_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    url: str
    mime_type: str
    def __init__(self, data: _Optional[bytes] = ..., url: _Optional[str] = ..., mime_type: _Optional[str] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("text", "image", "video")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: Media
    video: Media
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[Media, _Mapping]] = ..., video: _Optional[_Union[Media, _Mapping]] = ...) -> None: ...

class Message(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: _containers.RepeatedCompositeFieldContainer[ContentPart]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "messages", "sampling", "cache_salt", "prompt", "tools", "tool_choice")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    prompt: str
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    def __init__(self, request_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., prompt: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "function")
    MODE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    mode: str
    function: str
    def __init__(self, mode: _Optional[str] = ..., function: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "text_tokens", "image_tokens", "completion_tokens", "cached_tokens", "video_tokens", "migrations")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VIDEO_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    text_tokens: int
    image_tokens: int
    completion_tokens: int
    cached_tokens: int
    video_tokens: int
    migrations: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., text_tokens: _Optional[int] = ..., image_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., video_tokens: _Optional[int] = ..., migrations: _Optional[int] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_s", "encode_s", "prefill_s", "first_token_s", "total_s", "intake_s", "embedding_wait_s", "encode_stages")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    ENCODE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    INTAKE_S_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    ENCODE_STAGES_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    encode_s: float
    prefill_s: float
    first_token_s: float
    total_s: float
    intake_s: float
    embedding_wait_s: float
    encode_stages: _common_pb2.EncodeStages
    def __init__(self, queue_s: _Optional[float] = ..., encode_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., first_token_s: _Optional[float] = ..., total_s: _Optional[float] = ..., intake_s: _Optional[float] = ..., embedding_wait_s: _Optional[float] = ..., encode_stages: _Optional[_Union[_common_pb2.EncodeStages, _Mapping]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("token_ids", "text", "index", "logprobs", "prompt_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class ChoiceEnd(_message.Message):
    __slots__ = ("index", "finish_reason", "completion_tokens", "tool_calls")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    index: int
    finish_reason: str
    completion_tokens: int
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, index: _Optional[int] = ..., finish_reason: _Optional[str] = ..., completion_tokens: _Optional[int] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("finish_reason", "usage", "timing", "request_id", "choices")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    usage: Usage
    timing: Timing
    request_id: str
    choices: _containers.RepeatedCompositeFieldContainer[ChoiceEnd]
    def __init__(self, finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., request_id: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[ChoiceEnd, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "final")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    final: Final
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., final: _Optional[_Union[Final, _Mapping]] = ...) -> None: ...

class TokenCount(_message.Message):
    __slots__ = ("prompt_tokens", "text_tokens", "image_tokens", "max_tokens", "projected_tokens", "tokens_per_item", "video_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROJECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_ITEM_FIELD_NUMBER: _ClassVar[int]
    VIDEO_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    text_tokens: int
    image_tokens: int
    max_tokens: int
    projected_tokens: int
    tokens_per_item: _containers.RepeatedScalarFieldContainer[int]
    video_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., text_tokens: _Optional[int] = ..., image_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., projected_tokens: _Optional[int] = ..., tokens_per_item: _Optional[_Iterable[int]] = ..., video_tokens: _Optional[int] = ...) -> None: ...
