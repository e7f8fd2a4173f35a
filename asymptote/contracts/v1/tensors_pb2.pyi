from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DeltaEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DELTA_ENCODING_UNSPECIFIED: _ClassVar[DeltaEncoding]
    DELTA_ENCODING_GAPS: _ClassVar[DeltaEncoding]
    DELTA_ENCODING_MASK: _ClassVar[DeltaEncoding]
    DELTA_ENCODING_DENSE: _ClassVar[DeltaEncoding]
DELTA_ENCODING_UNSPECIFIED: DeltaEncoding
DELTA_ENCODING_GAPS: DeltaEncoding
DELTA_ENCODING_MASK: DeltaEncoding
DELTA_ENCODING_DENSE: DeltaEncoding

class TensorChunk(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "tensor_num_bytes", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    tensor_num_bytes: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., tensor_num_bytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class WeightsHeader(_message.Message):
    __slots__ = ("version", "num_tensors", "num_bytes", "digest", "base_version", "base_digest")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    version: int
    num_tensors: int
    num_bytes: int
    digest: str
    base_version: int
    base_digest: str
    def __init__(self, version: _Optional[int] = ..., num_tensors: _Optional[int] = ..., num_bytes: _Optional[int] = ..., digest: _Optional[str] = ..., base_version: _Optional[int] = ..., base_digest: _Optional[str] = ...) -> None: ...

class TensorDelta(_message.Message):
    __slots__ = ("name", "start", "num_elements", "encoding", "positions", "values")
    NAME_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    NUM_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    name: str
    start: int
    num_elements: int
    encoding: DeltaEncoding
    positions: bytes
    values: bytes
    def __init__(self, name: _Optional[str] = ..., start: _Optional[int] = ..., num_elements: _Optional[int] = ..., encoding: _Optional[_Union[DeltaEncoding, str]] = ..., positions: _Optional[bytes] = ..., values: _Optional[bytes] = ...) -> None: ...

class WeightsPart(_message.Message):
    __slots__ = ("header", "chunk", "delta")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    header: WeightsHeader
    chunk: TensorChunk
    delta: TensorDelta
    def __init__(self, header: _Optional[_Union[WeightsHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., delta: _Optional[_Union[TensorDelta, _Mapping]] = ...) -> None: ...
