from master.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RendezvousConfig(_message.Message):
    __slots__ = ("min_nodes", "max_nodes", "node_unit", "last_call_ms", "lease_ms")
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    NODE_UNIT_FIELD_NUMBER: _ClassVar[int]
    LAST_CALL_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    min_nodes: int
    max_nodes: int
    node_unit: int
    last_call_ms: int
    lease_ms: int
    def __init__(self, min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., node_unit: _Optional[int] = ..., last_call_ms: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class JoinRoundRequest(_message.Message):
    __slots__ = ("node", "run_id", "config", "rank_hint", "local_world_size", "host")
    NODE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    RANK_HINT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    run_id: str
    config: RendezvousConfig
    rank_hint: int
    local_world_size: int
    host: str
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., run_id: _Optional[str] = ..., config: _Optional[_Union[RendezvousConfig, _Mapping]] = ..., rank_hint: _Optional[int] = ..., local_world_size: _Optional[int] = ..., host: _Optional[str] = ...) -> None: ...

class JoinRoundReply(_message.Message):
    __slots__ = ("round", "closed")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    round: int
    closed: bool
    def __init__(self, round: _Optional[int] = ..., closed: bool = ...) -> None: ...

class WaitRoundRequest(_message.Message):
    __slots__ = ("node", "run_id", "round", "wait_ms")
    NODE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    run_id: str
    round: int
    wait_ms: int
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., run_id: _Optional[str] = ..., round: _Optional[int] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class RoundMember(_message.Message):
    __slots__ = ("node", "local_world_size", "host")
    NODE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    local_world_size: int
    host: str
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., local_world_size: _Optional[int] = ..., host: _Optional[str] = ...) -> None: ...

class RoundReply(_message.Message):
    __slots__ = ("status", "round", "rank", "members")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PENDING: _ClassVar[RoundReply.Status]
        DONE: _ClassVar[RoundReply.Status]
        NEXT: _ClassVar[RoundReply.Status]
        CLOSED: _ClassVar[RoundReply.Status]
    PENDING: RoundReply.Status
    DONE: RoundReply.Status
    NEXT: RoundReply.Status
    CLOSED: RoundReply.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    status: RoundReply.Status
    round: int
    rank: int
    members: _containers.RepeatedCompositeFieldContainer[RoundMember]
    def __init__(self, status: _Optional[_Union[RoundReply.Status, str]] = ..., round: _Optional[int] = ..., rank: _Optional[int] = ..., members: _Optional[_Iterable[_Union[RoundMember, _Mapping]]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("node", "run_id", "round", "known_waiting", "wait_ms")
    NODE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    KNOWN_WAITING_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    run_id: str
    round: int
    known_waiting: int
    wait_ms: int
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., run_id: _Optional[str] = ..., round: _Optional[int] = ..., known_waiting: _Optional[int] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class WatchReply(_message.Message):
    __slots__ = ("waiting", "closed")
    WAITING_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    waiting: int
    closed: bool
    def __init__(self, waiting: _Optional[int] = ..., closed: bool = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("node", "run_id")
    NODE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    run_id: str
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., run_id: _Optional[str] = ...) -> None: ...

class SetClosedRequest(_message.Message):
    __slots__ = ("node", "run_id")
    NODE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    run_id: str
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., run_id: _Optional[str] = ...) -> None: ...
