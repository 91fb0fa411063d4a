from master.pb import common_pb2 as _common_pb2
from master.pb import nodes_pb2 as _nodes_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DatasetSpec(_message.Message):
    __slots__ = ("name", "size", "batch_size", "records_per_shard", "epochs", "shuffle", "seed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    RECORDS_PER_SHARD_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    batch_size: int
    records_per_shard: int
    epochs: int
    shuffle: bool
    seed: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., batch_size: _Optional[int] = ..., records_per_shard: _Optional[int] = ..., epochs: _Optional[int] = ..., shuffle: bool = ..., seed: _Optional[int] = ...) -> None: ...

class CreateDatasetRequest(_message.Message):
    __slots__ = ("node", "spec")
    NODE_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    spec: DatasetSpec
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., spec: _Optional[_Union[DatasetSpec, _Mapping]] = ...) -> None: ...

class CreateDatasetReply(_message.Message):
    __slots__ = ("created",)
    CREATED_FIELD_NUMBER: _ClassVar[int]
    created: bool
    def __init__(self, created: bool = ...) -> None: ...

class GetShardRequest(_message.Message):
    __slots__ = ("node", "dataset", "wait_ms", "request_id", "indices_local")
    NODE_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDICES_LOCAL_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    dataset: str
    wait_ms: int
    request_id: int
    indices_local: bool
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., dataset: _Optional[str] = ..., wait_ms: _Optional[int] = ..., request_id: _Optional[int] = ..., indices_local: bool = ...) -> None: ...

class Shard(_message.Message):
    __slots__ = ("shard_id", "epoch", "start", "end", "record_indices")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    RECORD_INDICES_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    epoch: int
    start: int
    end: int
    record_indices: bytes
    def __init__(self, shard_id: _Optional[int] = ..., epoch: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., record_indices: _Optional[bytes] = ...) -> None: ...

class GetShardReply(_message.Message):
    __slots__ = ("status", "shard")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        SHARD: _ClassVar[GetShardReply.Status]
        PENDING: _ClassVar[GetShardReply.Status]
        END: _ClassVar[GetShardReply.Status]
    SHARD: GetShardReply.Status
    PENDING: GetShardReply.Status
    END: GetShardReply.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    status: GetShardReply.Status
    shard: Shard
    def __init__(self, status: _Optional[_Union[GetShardReply.Status, str]] = ..., shard: _Optional[_Union[Shard, _Mapping]] = ...) -> None: ...

class ProgressReport(_message.Message):
    __slots__ = ("shard_id", "records_consumed")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    RECORDS_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    records_consumed: int
    def __init__(self, shard_id: _Optional[int] = ..., records_consumed: _Optional[int] = ...) -> None: ...

class ReportProgressRequest(_message.Message):
    __slots__ = ("node", "dataset", "reports", "global_step", "loss", "steps", "heartbeat_stats")
    NODE_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_STATS_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    dataset: str
    reports: _containers.RepeatedCompositeFieldContainer[ProgressReport]
    global_step: int
    loss: float
    steps: int
    heartbeat_stats: _nodes_pb2.ResourceStats
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., dataset: _Optional[str] = ..., reports: _Optional[_Iterable[_Union[ProgressReport, _Mapping]]] = ..., global_step: _Optional[int] = ..., loss: _Optional[float] = ..., steps: _Optional[int] = ..., heartbeat_stats: _Optional[_Union[_nodes_pb2.ResourceStats, _Mapping]] = ...) -> None: ...

class ReportProgressReply(_message.Message):
    __slots__ = ("applied", "stale")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    applied: int
    stale: int
    def __init__(self, applied: _Optional[int] = ..., stale: _Optional[int] = ...) -> None: ...

class ReturnShardsRequest(_message.Message):
    __slots__ = ("node", "dataset")
    NODE_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    dataset: str
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., dataset: _Optional[str] = ...) -> None: ...

class ReturnShardsReply(_message.Message):
    __slots__ = ("records_returned",)
    RECORDS_RETURNED_FIELD_NUMBER: _ClassVar[int]
    records_returned: int
    def __init__(self, records_returned: _Optional[int] = ...) -> None: ...

class LedgerRequest(_message.Message):
    __slots__ = ("node", "dataset", "global_step")
    NODE_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    dataset: str
    global_step: int
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., dataset: _Optional[str] = ..., global_step: _Optional[int] = ...) -> None: ...

class ShardRange(_message.Message):
    __slots__ = ("epoch", "start", "end")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    start: int
    end: int
    def __init__(self, epoch: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class LedgerSnapshot(_message.Message):
    __slots__ = ("dataset", "global_step", "spec", "epoch", "todo", "doing", "records_done", "records_redone")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TODO_FIELD_NUMBER: _ClassVar[int]
    DOING_FIELD_NUMBER: _ClassVar[int]
    RECORDS_DONE_FIELD_NUMBER: _ClassVar[int]
    RECORDS_REDONE_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    global_step: int
    spec: DatasetSpec
    epoch: int
    todo: _containers.RepeatedCompositeFieldContainer[ShardRange]
    doing: _containers.RepeatedCompositeFieldContainer[ShardRange]
    records_done: int
    records_redone: int
    def __init__(self, dataset: _Optional[str] = ..., global_step: _Optional[int] = ..., spec: _Optional[_Union[DatasetSpec, _Mapping]] = ..., epoch: _Optional[int] = ..., todo: _Optional[_Iterable[_Union[ShardRange, _Mapping]]] = ..., doing: _Optional[_Iterable[_Union[ShardRange, _Mapping]]] = ..., records_done: _Optional[int] = ..., records_redone: _Optional[int] = ...) -> None: ...

class CheckpointReport(_message.Message):
    __slots__ = ("node", "global_step", "path", "datasets")
    NODE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    global_step: int
    path: str
    datasets: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., global_step: _Optional[int] = ..., path: _Optional[str] = ..., datasets: _Optional[_Iterable[str]] = ...) -> None: ...

class CheckpointReply(_message.Message):
    __slots__ = ("latest_step",)
    LATEST_STEP_FIELD_NUMBER: _ClassVar[int]
    latest_step: int
    def __init__(self, latest_step: _Optional[int] = ...) -> None: ...
