from services.common.rpc.epd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeItem(_message.Message):
    __slots__ = ("ref", "data")
    REF_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ref: _common_pb2.MediaRef
    data: bytes
    def __init__(self, ref: _Optional[_Union[_common_pb2.MediaRef, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "items", "destination", "deadline_s", "booked")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    BOOKED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    items: _containers.RepeatedCompositeFieldContainer[EncodeItem]
    destination: str
    deadline_s: float
    booked: bool
    def __init__(self, request_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[EncodeItem, _Mapping]]] = ..., destination: _Optional[str] = ..., deadline_s: _Optional[float] = ..., booked: _Optional[bool] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("encoded", "cached", "encode_s", "stages")
    ENCODED_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    ENCODE_S_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    encoded: int
    cached: int
    encode_s: float
    stages: _common_pb2.EncodeStages
    def __init__(self, encoded: _Optional[int] = ..., cached: _Optional[int] = ..., encode_s: _Optional[float] = ..., stages: _Optional[_Union[_common_pb2.EncodeStages, _Mapping]] = ...) -> None: ...
