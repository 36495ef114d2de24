from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeMessage(_message.Message):
    __slots__ = ("join", "failure")
    JOIN_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    join: JoinRequest
    failure: NodeFailure
    def __init__(self, join: _Optional[_Union[JoinRequest, _Mapping]] = ..., failure: _Optional[_Union[NodeFailure, _Mapping]] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("node_rank", "nnodes", "tensor_parallel_size", "model_config_sha256", "dtype", "block_size", "rank_addresses", "quantization", "draft_model_config_sha256", "max_model_len", "pipeline_parallel_size", "enable_expert_parallel", "kv_cache_dtype")
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    NNODES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_SHA256_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_CONFIG_SHA256_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENABLE_EXPERT_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    node_rank: int
    nnodes: int
    tensor_parallel_size: int
    model_config_sha256: str
    dtype: str
    block_size: int
    rank_addresses: _containers.RepeatedScalarFieldContainer[str]
    quantization: str
    draft_model_config_sha256: str
    max_model_len: int
    pipeline_parallel_size: int
    enable_expert_parallel: bool
    kv_cache_dtype: str
    def __init__(self, node_rank: _Optional[int] = ..., nnodes: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., model_config_sha256: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., rank_addresses: _Optional[_Iterable[str]] = ..., quantization: _Optional[str] = ..., draft_model_config_sha256: _Optional[str] = ..., max_model_len: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., enable_expert_parallel: _Optional[bool] = ..., kv_cache_dtype: _Optional[str] = ...) -> None: ...

class NodeFailure(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class LeaderMessage(_message.Message):
    __slots__ = ("accepted", "shutdown")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    accepted: JoinAccepted
    shutdown: GroupShutdown
    def __init__(self, accepted: _Optional[_Union[JoinAccepted, _Mapping]] = ..., shutdown: _Optional[_Union[GroupShutdown, _Mapping]] = ...) -> None: ...

class JoinAccepted(_message.Message):
    __slots__ = ("init_method",)
    INIT_METHOD_FIELD_NUMBER: _ClassVar[int]
    init_method: str
    def __init__(self, init_method: _Optional[str] = ...) -> None: ...

class GroupShutdown(_message.Message):
    __slots__ = ("reason", "failed")
    REASON_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    reason: str
    failed: bool
    def __init__(self, reason: _Optional[str] = ..., failed: _Optional[bool] = ...) -> None: ...
