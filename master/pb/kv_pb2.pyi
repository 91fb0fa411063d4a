from master.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVSetRequest(_message.Message):
    __slots__ = ("node", "key", "value")
    NODE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    key: bytes
    value: bytes
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., key: _Optional[bytes] = ..., value: _Optional[bytes] = ...) -> None: ...

class KVGetRequest(_message.Message):
    __slots__ = ("node", "key", "wait_ms")
    NODE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    key: bytes
    wait_ms: int
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., key: _Optional[bytes] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class KVGetReply(_message.Message):
    __slots__ = ("found", "value")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    found: bool
    value: bytes
    def __init__(self, found: bool = ..., value: _Optional[bytes] = ...) -> None: ...

class KVAddRequest(_message.Message):
    __slots__ = ("node", "key", "amount")
    NODE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    key: bytes
    amount: int
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., key: _Optional[bytes] = ..., amount: _Optional[int] = ...) -> None: ...

class KVAddReply(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class KVCompareSetRequest(_message.Message):
    __slots__ = ("node", "key", "expected", "desired")
    NODE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    key: bytes
    expected: bytes
    desired: bytes
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., key: _Optional[bytes] = ..., expected: _Optional[bytes] = ..., desired: _Optional[bytes] = ...) -> None: ...

class KVValueReply(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    def __init__(self, value: _Optional[bytes] = ...) -> None: ...

class KVWaitRequest(_message.Message):
    __slots__ = ("node", "keys", "wait_ms")
    NODE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    wait_ms: int
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class KVBoolReply(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: bool
    def __init__(self, value: bool = ...) -> None: ...

class KVKeysRequest(_message.Message):
    __slots__ = ("node", "keys")
    NODE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KVKeyRequest(_message.Message):
    __slots__ = ("node", "key")
    NODE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    key: bytes
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., key: _Optional[bytes] = ...) -> None: ...

class KVNumKeysRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ...) -> None: ...

class KVNumKeysReply(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...
