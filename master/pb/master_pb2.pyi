from master.pb import common_pb2 as _common_pb2
from master.pb import cluster_pb2 as _cluster_pb2
from master.pb import nodes_pb2 as _nodes_pb2
from master.pb import data_pb2 as _data_pb2
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor
