from master.pb import common_pb2 as _common_pb2
from master.pb import cluster_pb2 as _cluster_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExitReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXIT_REASON_UNSPECIFIED: _ClassVar[ExitReason]
    SUCCEEDED: _ClassVar[ExitReason]
    OOM: _ClassVar[ExitReason]
    KILLED: _ClassVar[ExitReason]
    USER_ERROR: _ClassVar[ExitReason]
    HARDWARE: _ClassVar[ExitReason]
    HEARTBEAT_LOST: _ClassVar[ExitReason]
    UNKNOWN: _ClassVar[ExitReason]
EXIT_REASON_UNSPECIFIED: ExitReason
SUCCEEDED: ExitReason
OOM: ExitReason
KILLED: ExitReason
USER_ERROR: ExitReason
HARDWARE: ExitReason
HEARTBEAT_LOST: ExitReason
UNKNOWN: ExitReason

class RegisterRequest(_message.Message):
    __slots__ = ("node", "host", "pid")
    NODE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    host: str
    pid: int
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("cluster", "heartbeat_interval_ms")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    cluster: _cluster_pb2.ClusterSpec
    heartbeat_interval_ms: int
    def __init__(self, cluster: _Optional[_Union[_cluster_pb2.ClusterSpec, _Mapping]] = ..., heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class ResourceStats(_message.Message):
    __slots__ = ("cpu_percent", "memory_rss_bytes", "memory_limit_bytes", "gpus")
    CPU_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    cpu_percent: float
    memory_rss_bytes: int
    memory_limit_bytes: int
    gpus: _containers.RepeatedCompositeFieldContainer[GpuStats]
    def __init__(self, cpu_percent: _Optional[float] = ..., memory_rss_bytes: _Optional[int] = ..., memory_limit_bytes: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuStats, _Mapping]]] = ...) -> None: ...

class GpuStats(_message.Message):
    __slots__ = ("index", "utilization_percent", "memory_used_bytes", "memory_total_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    utilization_percent: float
    memory_used_bytes: int
    memory_total_bytes: int
    def __init__(self, index: _Optional[int] = ..., utilization_percent: _Optional[float] = ..., memory_used_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node", "stats", "global_step")
    NODE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    stats: ResourceStats
    global_step: int
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., stats: _Optional[_Union[ResourceStats, _Mapping]] = ..., global_step: _Optional[int] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("kind", "cluster", "reason")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        NONE: _ClassVar[Command.Kind]
        STOP: _ClassVar[Command.Kind]
        UPDATE_CLUSTER: _ClassVar[Command.Kind]
        CHECKPOINT: _ClassVar[Command.Kind]
    NONE: Command.Kind
    STOP: Command.Kind
    UPDATE_CLUSTER: Command.Kind
    CHECKPOINT: Command.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    kind: Command.Kind
    cluster: _cluster_pb2.ClusterSpec
    reason: str
    def __init__(self, kind: _Optional[_Union[Command.Kind, str]] = ..., cluster: _Optional[_Union[_cluster_pb2.ClusterSpec, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("commands",)
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    commands: _containers.RepeatedCompositeFieldContainer[Command]
    def __init__(self, commands: _Optional[_Iterable[_Union[Command, _Mapping]]] = ...) -> None: ...

class ExitReport(_message.Message):
    __slots__ = ("node", "exit_code", "reason", "message")
    NODE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    exit_code: int
    reason: ExitReason
    message: str
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., exit_code: _Optional[int] = ..., reason: _Optional[_Union[ExitReason, str]] = ..., message: _Optional[str] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("type", "rank", "id", "status", "exit_reason", "relaunches", "address")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EXIT_REASON_FIELD_NUMBER: _ClassVar[int]
    RELAUNCHES_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    type: str
    rank: int
    id: int
    status: str
    exit_reason: str
    relaunches: int
    address: str
    def __init__(self, type: _Optional[str] = ..., rank: _Optional[int] = ..., id: _Optional[int] = ..., status: _Optional[str] = ..., exit_reason: _Optional[str] = ..., relaunches: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class DatasetProgress(_message.Message):
    __slots__ = ("name", "size", "epochs", "current_epoch", "records_done", "records_redone", "records_todo", "records_doing", "finished")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RECORDS_DONE_FIELD_NUMBER: _ClassVar[int]
    RECORDS_REDONE_FIELD_NUMBER: _ClassVar[int]
    RECORDS_TODO_FIELD_NUMBER: _ClassVar[int]
    RECORDS_DOING_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    epochs: int
    current_epoch: int
    records_done: int
    records_redone: int
    records_todo: int
    records_doing: int
    finished: bool
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., epochs: _Optional[int] = ..., current_epoch: _Optional[int] = ..., records_done: _Optional[int] = ..., records_redone: _Optional[int] = ..., records_todo: _Optional[int] = ..., records_doing: _Optional[int] = ..., finished: bool = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("name", "status", "reason", "global_step", "nodes", "datasets", "elapsed_seconds", "dashboard_url", "cluster_version", "autoscale_decision", "autoscale_note")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DASHBOARD_URL_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    AUTOSCALE_DECISION_FIELD_NUMBER: _ClassVar[int]
    AUTOSCALE_NOTE_FIELD_NUMBER: _ClassVar[int]
    name: str
    status: str
    reason: str
    global_step: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetProgress]
    elapsed_seconds: float
    dashboard_url: str
    cluster_version: int
    autoscale_decision: str
    autoscale_note: str
    def __init__(self, name: _Optional[str] = ..., status: _Optional[str] = ..., reason: _Optional[str] = ..., global_step: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., datasets: _Optional[_Iterable[_Union[DatasetProgress, _Mapping]]] = ..., elapsed_seconds: _Optional[float] = ..., dashboard_url: _Optional[str] = ..., cluster_version: _Optional[int] = ..., autoscale_decision: _Optional[str] = ..., autoscale_note: _Optional[str] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("node_type", "replicas", "reason")
    NODE_TYPE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_type: str
    replicas: int
    reason: str
    def __init__(self, node_type: _Optional[str] = ..., replicas: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ScaleReply(_message.Message):
    __slots__ = ("previous", "replicas", "cluster_version")
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    previous: int
    replicas: int
    cluster_version: int
    def __init__(self, previous: _Optional[int] = ..., replicas: _Optional[int] = ..., cluster_version: _Optional[int] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("node_type", "rank", "memory_mb", "cpu", "reason")
    NODE_TYPE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    CPU_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_type: str
    rank: int
    memory_mb: int
    cpu: float
    reason: str
    def __init__(self, node_type: _Optional[str] = ..., rank: _Optional[int] = ..., memory_mb: _Optional[int] = ..., cpu: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class MigrateReply(_message.Message):
    __slots__ = ("node_id", "checkpoint_step")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    node_id: int
    checkpoint_step: int
    def __init__(self, node_id: _Optional[int] = ..., checkpoint_step: _Optional[int] = ...) -> None: ...
