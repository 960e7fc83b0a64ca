from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]

class Sharing(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHARING_UNSPECIFIED: _ClassVar[Sharing]
    CUDA_IPC: _ClassVar[Sharing]
    SHARED_MEMORY: _ClassVar[Sharing]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
BFLOAT16: DType
FLOAT16: DType
INT32: DType
INT64: DType
SHARING_UNSPECIFIED: Sharing
CUDA_IPC: Sharing
SHARED_MEMORY: Sharing

class Handle(_message.Message):
    __slots__ = ("slot", "generation")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    slot: int
    generation: int
    def __init__(self, slot: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("model", "token_ids_le_i32", "lease_ms", "rows")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_LE_I32_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    model: str
    token_ids_le_i32: bytes
    lease_ms: int
    rows: _containers.RepeatedCompositeFieldContainer[SweepRow]
    def __init__(self, model: _Optional[str] = ..., token_ids_le_i32: _Optional[bytes] = ..., lease_ms: _Optional[int] = ..., rows: _Optional[_Iterable[_Union[SweepRow, _Mapping]]] = ...) -> None: ...

class SweepRow(_message.Message):
    __slots__ = ("token_ids_le_i32", "picks")
    TOKEN_IDS_LE_I32_FIELD_NUMBER: _ClassVar[int]
    PICKS_FIELD_NUMBER: _ClassVar[int]
    token_ids_le_i32: bytes
    picks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids_le_i32: _Optional[bytes] = ..., picks: _Optional[_Iterable[int]] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("handle", "document_length", "cached", "lease_id", "lease_expires_unix_ms", "doc_key", "swept", "row_probabilities")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    DOC_KEY_FIELD_NUMBER: _ClassVar[int]
    SWEPT_FIELD_NUMBER: _ClassVar[int]
    ROW_PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    handle: Handle
    document_length: int
    cached: bool
    lease_id: str
    lease_expires_unix_ms: int
    doc_key: str
    swept: bool
    row_probabilities: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, handle: _Optional[_Union[Handle, _Mapping]] = ..., document_length: _Optional[int] = ..., cached: _Optional[bool] = ..., lease_id: _Optional[str] = ..., lease_expires_unix_ms: _Optional[int] = ..., doc_key: _Optional[str] = ..., swept: _Optional[bool] = ..., row_probabilities: _Optional[_Iterable[float]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("handle", "lease_id")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    handle: Handle
    lease_id: str
    def __init__(self, handle: _Optional[_Union[Handle, _Mapping]] = ..., lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class TensorDescriptor(_message.Message):
    __slots__ = ("name", "shape", "stride", "storage_offset", "dtype", "device", "sharing", "descriptor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SHARING_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    storage_offset: int
    dtype: DType
    device: str
    sharing: Sharing
    descriptor: bytes
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., storage_offset: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., device: _Optional[str] = ..., sharing: _Optional[_Union[Sharing, str]] = ..., descriptor: _Optional[bytes] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("model", "node", "instance", "slot_count", "block_size", "block_count", "pools", "weights_shared", "weights", "layout_version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COUNT_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SHARED_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    node: str
    instance: str
    slot_count: int
    block_size: int
    block_count: int
    pools: _containers.RepeatedCompositeFieldContainer[TensorDescriptor]
    weights_shared: bool
    weights: _containers.RepeatedCompositeFieldContainer[TensorDescriptor]
    layout_version: int
    def __init__(self, model: _Optional[str] = ..., node: _Optional[str] = ..., instance: _Optional[str] = ..., slot_count: _Optional[int] = ..., block_size: _Optional[int] = ..., block_count: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[TensorDescriptor, _Mapping]]] = ..., weights_shared: _Optional[bool] = ..., weights: _Optional[_Iterable[_Union[TensorDescriptor, _Mapping]]] = ..., layout_version: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("slots_used", "slots_total", "blocks_used", "blocks_total", "pins_held", "hits", "misses", "evictions", "node", "instance")
    SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PINS_HELD_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    slots_used: int
    slots_total: int
    blocks_used: int
    blocks_total: int
    pins_held: int
    hits: int
    misses: int
    evictions: int
    node: str
    instance: str
    def __init__(self, slots_used: _Optional[int] = ..., slots_total: _Optional[int] = ..., blocks_used: _Optional[int] = ..., blocks_total: _Optional[int] = ..., pins_held: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., node: _Optional[str] = ..., instance: _Optional[str] = ...) -> None: ...
