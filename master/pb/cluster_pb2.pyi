from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ClusterSpec(_message.Message):
    __slots__ = ("version", "ps", "chief", "worker", "evaluator")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PS_FIELD_NUMBER: _ClassVar[int]
    CHIEF_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    EVALUATOR_FIELD_NUMBER: _ClassVar[int]
    version: int
    ps: _containers.RepeatedScalarFieldContainer[str]
    chief: _containers.RepeatedScalarFieldContainer[str]
    worker: _containers.RepeatedScalarFieldContainer[str]
    evaluator: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., ps: _Optional[_Iterable[str]] = ..., chief: _Optional[_Iterable[str]] = ..., worker: _Optional[_Iterable[str]] = ..., evaluator: _Optional[_Iterable[str]] = ...) -> None: ...
