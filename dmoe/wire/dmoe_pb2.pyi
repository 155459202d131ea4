from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Compression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NONE: _ClassVar[Compression]
    FLOAT16: _ClassVar[Compression]
    UINT8: _ClassVar[Compression]
NONE: Compression
FLOAT16: Compression
UINT8: Compression

class Tensor(_message.Message):
    __slots__ = ("buffer", "shape", "dtype", "compression", "aux", "parts", "pad")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    AUX_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    PAD_FIELD_NUMBER: _ClassVar[int]
    buffer: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    compression: Compression
    aux: bytes
    parts: int
    pad: bytes
    def __init__(self, buffer: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., compression: _Optional[_Union[Compression, str]] = ..., aux: _Optional[bytes] = ..., parts: _Optional[int] = ..., pad: _Optional[bytes] = ...) -> None: ...

class TensorSchema(_message.Message):
    __slots__ = ("shape", "dtype")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class ExpertUID(_message.Message):
    __slots__ = ("uid",)
    UID_FIELD_NUMBER: _ClassVar[int]
    uid: str
    def __init__(self, uid: _Optional[str] = ...) -> None: ...

class ExpertInfo(_message.Message):
    __slots__ = ("uid", "expert_cls", "inputs", "outputs", "max_batch_size", "device", "hparams_json", "forward_calls", "backward_calls", "updates")
    UID_FIELD_NUMBER: _ClassVar[int]
    EXPERT_CLS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HPARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    FORWARD_CALLS_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_CALLS_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    uid: str
    expert_cls: str
    inputs: _containers.RepeatedCompositeFieldContainer[TensorSchema]
    outputs: _containers.RepeatedCompositeFieldContainer[TensorSchema]
    max_batch_size: int
    device: str
    hparams_json: str
    forward_calls: int
    backward_calls: int
    updates: int
    def __init__(self, uid: _Optional[str] = ..., expert_cls: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[TensorSchema, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[TensorSchema, _Mapping]]] = ..., max_batch_size: _Optional[int] = ..., device: _Optional[str] = ..., hparams_json: _Optional[str] = ..., forward_calls: _Optional[int] = ..., backward_calls: _Optional[int] = ..., updates: _Optional[int] = ...) -> None: ...

class ExpertRequest(_message.Message):
    __slots__ = ("uid", "tensors", "response_compression", "activation_id")
    UID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_ID_FIELD_NUMBER: _ClassVar[int]
    uid: str
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    response_compression: Compression
    activation_id: bytes
    def __init__(self, uid: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., response_compression: _Optional[_Union[Compression, str]] = ..., activation_id: _Optional[bytes] = ...) -> None: ...

class ExpertResponse(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    def __init__(self, tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ...) -> None: ...

class BatchRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ExpertRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[ExpertRequest, _Mapping]]] = ...) -> None: ...

class ExpertResult(_message.Message):
    __slots__ = ("tensors", "code", "message")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    code: int
    message: str
    def __init__(self, tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class BatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ExpertResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ExpertResult, _Mapping]]] = ...) -> None: ...

class SharedMemoryCall(_message.Message):
    __slots__ = ("method", "pid", "fd", "key", "request_offset", "request_length", "answer_offset", "answer_capacity")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REQUEST_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ANSWER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ANSWER_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    method: str
    pid: int
    fd: int
    key: bytes
    request_offset: int
    request_length: int
    answer_offset: int
    answer_capacity: int
    def __init__(self, method: _Optional[str] = ..., pid: _Optional[int] = ..., fd: _Optional[int] = ..., key: _Optional[bytes] = ..., request_offset: _Optional[int] = ..., request_length: _Optional[int] = ..., answer_offset: _Optional[int] = ..., answer_capacity: _Optional[int] = ...) -> None: ...

class SharedMemoryAnswer(_message.Message):
    __slots__ = ("answer_length", "inline_answer", "refused")
    ANSWER_LENGTH_FIELD_NUMBER: _ClassVar[int]
    INLINE_ANSWER_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    answer_length: int
    inline_answer: bytes
    refused: str
    def __init__(self, answer_length: _Optional[int] = ..., inline_answer: _Optional[bytes] = ..., refused: _Optional[str] = ...) -> None: ...

class Hold(_message.Message):
    __slots__ = ("seconds",)
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    def __init__(self, seconds: _Optional[float] = ...) -> None: ...

class HoldEnd(_message.Message):
    __slots__ = ("stopping",)
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    stopping: bool
    def __init__(self, stopping: _Optional[bool] = ...) -> None: ...

class AveragingPart(_message.Message):
    __slots__ = ("group_id", "sender", "weight", "values", "signature")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    sender: int
    weight: float
    values: Tensor
    signature: bytes
    def __init__(self, group_id: _Optional[str] = ..., sender: _Optional[int] = ..., weight: _Optional[float] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ..., signature: _Optional[bytes] = ...) -> None: ...

class AveragedPart(_message.Message):
    __slots__ = ("contributors", "total_weight", "values", "weights", "signatures")
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    contributors: _containers.RepeatedScalarFieldContainer[int]
    total_weight: float
    values: Tensor
    weights: _containers.RepeatedScalarFieldContainer[float]
    signatures: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, contributors: _Optional[_Iterable[int]] = ..., total_weight: _Optional[float] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ..., weights: _Optional[_Iterable[float]] = ..., signatures: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class StatePart(_message.Message):
    __slots__ = ("run_id", "step", "lineage", "group_size", "optimizer_json", "tensors", "name", "tensor")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    lineage: str
    group_size: int
    optimizer_json: str
    tensors: int
    name: str
    tensor: Tensor
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., lineage: _Optional[str] = ..., group_size: _Optional[int] = ..., optimizer_json: _Optional[str] = ..., tensors: _Optional[int] = ..., name: _Optional[str] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class NamedTensor(_message.Message):
    __slots__ = ("name", "tensor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor: Tensor
    def __init__(self, name: _Optional[str] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("uid", "expert_cls", "hparams_json", "updates", "forward_calls", "backward_calls", "taken_at", "layout_json", "tensors")
    UID_FIELD_NUMBER: _ClassVar[int]
    EXPERT_CLS_FIELD_NUMBER: _ClassVar[int]
    HPARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_CALLS_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_CALLS_FIELD_NUMBER: _ClassVar[int]
    TAKEN_AT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    uid: str
    expert_cls: str
    hparams_json: str
    updates: int
    forward_calls: int
    backward_calls: int
    taken_at: float
    layout_json: str
    tensors: _containers.RepeatedCompositeFieldContainer[NamedTensor]
    def __init__(self, uid: _Optional[str] = ..., expert_cls: _Optional[str] = ..., hparams_json: _Optional[str] = ..., updates: _Optional[int] = ..., forward_calls: _Optional[int] = ..., backward_calls: _Optional[int] = ..., taken_at: _Optional[float] = ..., layout_json: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[NamedTensor, _Mapping]]] = ...) -> None: ...

class ReplicaHeader(_message.Message):
    __slots__ = ("uid", "updates", "size", "sha256", "taken_at", "signer", "signature")
    UID_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    TAKEN_AT_FIELD_NUMBER: _ClassVar[int]
    SIGNER_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    uid: str
    updates: int
    size: int
    sha256: bytes
    taken_at: float
    signer: bytes
    signature: bytes
    def __init__(self, uid: _Optional[str] = ..., updates: _Optional[int] = ..., size: _Optional[int] = ..., sha256: _Optional[bytes] = ..., taken_at: _Optional[float] = ..., signer: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class ReplicaChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ReplicaHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ReplicaHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReplicaAck(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: int
    def __init__(self, updates: _Optional[int] = ...) -> None: ...

class ReplicaQuery(_message.Message):
    __slots__ = ("uid",)
    UID_FIELD_NUMBER: _ClassVar[int]
    uid: str
    def __init__(self, uid: _Optional[str] = ...) -> None: ...
