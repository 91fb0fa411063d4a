"""Flatten a nested state dict into tensor extents plus a JSON tree, and rebuild it exactly.

Tensor data is never pickled: each tensor becomes (dtype, shape, offset, nbytes) in one flat byte
region. Everything else is written to a small JSON tree with explicit type tags, so python ints,
floats (as hex, bit exact), bools, strings, bytes, tuples, lists, dicts with non-string keys,
OrderedDicts (with torch's ``_metadata``), dtypes, sizes and numpy arrays round-trip exactly.
Any other type is refused with the path of the value, never pickled.
"""

from __future__ import annotations

import base64
import json
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dlrover_torch.checkpoint.errors import CorruptCheckpointError, UnsupportedValueError

ALIGN_BYTES = 64  # every tensor starts on a cache line, so any dtype view is aligned
FORMAT_VERSION = 1


def align(value: int, to: int = ALIGN_BYTES) -> int:
    """Round ``value`` up to a multiple of ``to``."""
    return (value + to - 1) // to * to


@dataclass
class TensorExtent:
    """Where one tensor lives in the flat data region."""

    dtype: str
    shape: list[int]
    offset: int
    nbytes: int
    # Sharded (DTensor) leaves: the global shape and this chunk's offsets in it.
    global_shape: list[int] | None = None
    chunk_offsets: list[int] | None = None

    def to_json(self) -> list[Any]:
        """Compact JSON form."""
        out: list[Any] = [self.dtype, self.shape, self.offset, self.nbytes]
        if self.global_shape is not None:
            out += [self.global_shape, self.chunk_offsets]
        return out

    @classmethod
    def from_json(cls, raw: list[Any]) -> TensorExtent:
        """Inverse of ``to_json``."""
        ext = cls(str(raw[0]), [int(d) for d in raw[1]], int(raw[2]), int(raw[3]))
        if len(raw) > 4:
            ext.global_shape = [int(d) for d in raw[4]]
            ext.chunk_offsets = [int(d) for d in raw[5]]
        return ext


@dataclass
class Layout:
    """The structure of one state dict: its JSON tree and the extents of its tensors."""

    tree: Any
    extents: list[TensorExtent] = field(default_factory=list)
    data_bytes: int = 0
    # The objects each extent came from (only on the saving side; never serialised).
    sources: list[Any] = field(default_factory=list, repr=False, compare=False)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of ``dtype_name``; refuses names that are not dtypes."""
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise CorruptCheckpointError(f"checkpoint metadata names unknown dtype {name!r}")
    return value


def _is_dtensor(value: Any) -> bool:
    # A DTensor exists only once its module was imported; importing it here would put half a
    # second on the first save of every job that has none.
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None) if module is not None else None
    return dtensor is not None and isinstance(value, dtensor)


class _Planner:
    """Walks a state dict once, assigning offsets and building the tree."""

    def __init__(self) -> None:
        self.extents: list[TensorExtent] = []
        self.tensors: list[torch.Tensor] = []
        self.sources: list[Any] = []
        self.cursor = 0

    def add_tensor(self, tensor: torch.Tensor, path: str) -> int:
        self.sources.append(tensor)
        if _is_dtensor(tensor):
            chunks = tensor.__create_chunk_list__()
            if len(chunks) != 1:
                raise UnsupportedValueError(
                    f"state_dict{path}: a DTensor with {len(chunks)} local chunks is not "
                    "supported; use one shard per rank (FSDP's default)"
                )
            local = tensor.to_local()
            ext = self._extent(local, path)
            ext.global_shape = list(tensor.shape)
            ext.chunk_offsets = list(chunks[0].offsets)
            self.tensors.append(local)
        else:
            ext = self._extent(tensor, path)
            self.tensors.append(tensor)
        self.extents.append(ext)
        return len(self.extents) - 1

    def _extent(self, tensor: torch.Tensor, path: str) -> TensorExtent:
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type == "meta":
            raise UnsupportedValueError(
                f"state_dict{path}: cannot checkpoint a {tensor.layout} / quantized / meta "
                "tensor; convert it to a dense tensor (e.g. .to_dense()) before saving"
            )
        nbytes = tensor.numel() * tensor.element_size()
        ext = TensorExtent(dtype_name(tensor.dtype), list(tensor.shape), self.cursor, nbytes)
        self.cursor = align(self.cursor + nbytes)
        return ext

    def encode(self, value: Any, path: str) -> Any:
        # bool before int: bool is an int subclass.
        if value is None or isinstance(value, bool | str):
            return value
        if isinstance(value, int) and type(value) in (int,):
            return value
        if isinstance(value, torch.Tensor):
            return {"t": "T", "i": self.add_tensor(value, path)}
        if isinstance(value, float) and type(value) is float:
            return {"t": "f", "v": value.hex()}
        if isinstance(value, OrderedDict):
            out = self._mapping(value, path, "o")
            meta = getattr(value, "_metadata", None)
            if meta is not None:
                out["m"] = self.encode(meta, path + "._metadata")
            return out
        if type(value) is dict:
            return self._mapping(value, path, "d")
        if type(value) is list:
            return {"t": "l", "v": [self.encode(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if type(value) is tuple:
            return {"t": "u", "v": [self.encode(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, bytes | bytearray):
            kind = "b" if isinstance(value, bytes) else "ba"
            return {"t": kind, "v": base64.b64encode(bytes(value)).decode("ascii")}
        if isinstance(value, complex):
            return {"t": "c", "v": [value.real.hex(), value.imag.hex()]}
        if isinstance(value, torch.dtype):
            return {"t": "dt", "v": dtype_name(value)}
        if isinstance(value, torch.Size):
            return {"t": "S", "v": list(value)}
        if isinstance(value, torch.device):
            return {"t": "dev", "v": str(value)}
        if isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
            tensor = torch.from_numpy(np.ascontiguousarray(value))
            return {"t": "N", "i": self.add_tensor(tensor, path), "d": value.dtype.str}
        if isinstance(value, np.generic) and value.dtype.kind in "biufc":
            raw = base64.b64encode(value.tobytes()).decode("ascii")
            return {"t": "ns", "d": value.dtype.str, "v": raw}
        if isinstance(value, set | frozenset):
            kind = "set" if isinstance(value, set) else "fset"
            items = sorted(value, key=repr)
            return {"t": kind, "v": [self.encode(v, f"{path}{{{v!r}}}") for v in items]}
        raise UnsupportedValueError(
            f"state_dict{path}: cannot checkpoint a value of type {type(value).__qualname__}; "
            "store tensors, numbers, strings, bytes, lists, tuples, dicts or numpy arrays "
            "(convert other objects, e.g. with .state_dict() or to a tensor)"
        )

    def _mapping(self, value: dict[Any, Any], path: str, tag: str) -> dict[str, Any]:
        keys = [self.encode(k, f"{path}<key {k!r}>") for k in value]
        vals = [self.encode(v, f"{path}[{k!r}]") for k, v in value.items()]
        return {"t": tag, "k": keys, "v": vals}


def plan(state_dict: Any) -> tuple[Layout, list[torch.Tensor]]:
    """Lay out ``state_dict``: return its Layout and its tensors in extent order."""
    planner = _Planner()
    tree = planner.encode(state_dict, "")
    return Layout(tree, planner.extents, planner.cursor, planner.sources), planner.tensors


def encode_meta(layout: Layout, extra: dict[str, Any]) -> bytes:
    """Serialise the layout (plus ``extra`` fields such as the step) as UTF-8 JSON."""
    doc = {
        "version": FORMAT_VERSION,
        "tree": layout.tree,
        "extents": [e.to_json() for e in layout.extents],
        "data_bytes": layout.data_bytes,
        **extra,
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def decode_meta(raw: bytes) -> tuple[Layout, dict[str, Any]]:
    """Parse metadata written by ``encode_meta``; return the layout and the whole document."""
    try:
        doc = json.loads(raw)
        if doc.get("version") != FORMAT_VERSION:
            raise CorruptCheckpointError(
                f"checkpoint metadata has version {doc.get('version')!r}, "
                f"this build reads {FORMAT_VERSION}"
            )
        extents = [TensorExtent.from_json(e) for e in doc["extents"]]
        return Layout(doc["tree"], extents, int(doc["data_bytes"])), doc
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise CorruptCheckpointError(f"checkpoint metadata is unreadable: {exc}") from exc


def tensor_view(region: torch.Tensor, ext: TensorExtent) -> torch.Tensor:
    """A typed, shaped view of one extent inside a flat uint8 ``region``."""
    flat = region[ext.offset : ext.offset + ext.nbytes]
    return flat.view(dtype_from_name(ext.dtype)).view(ext.shape)


def rebuild(layout: Layout, leaf: Callable[[int, TensorExtent], torch.Tensor]) -> Any:
    """Rebuild the state dict; ``leaf(index, extent)`` supplies each tensor."""

    def dec(node: Any) -> Any:
        if node is None or isinstance(node, bool | int | str):
            return node
        if not isinstance(node, dict):
            raise CorruptCheckpointError(f"unexpected node {node!r} in checkpoint metadata")
        tag = node["t"]
        if tag == "T":
            return leaf(node["i"], layout.extents[node["i"]])
        if tag == "f":
            return float.fromhex(node["v"])
        if tag in ("d", "o"):
            pairs = zip((dec(k) for k in node["k"]), (dec(v) for v in node["v"]), strict=True)
            if tag == "d":
                return dict(pairs)
            out: OrderedDict[Any, Any] = OrderedDict(pairs)
            if "m" in node:
                out._metadata = dec(node["m"])  # type: ignore[attr-defined]
            return out
        if tag == "l":
            return [dec(v) for v in node["v"]]
        if tag == "u":
            return tuple(dec(v) for v in node["v"])
        if tag == "b":
            return base64.b64decode(node["v"])
        if tag == "ba":
            return bytearray(base64.b64decode(node["v"]))
        if tag == "c":
            return complex(float.fromhex(node["v"][0]), float.fromhex(node["v"][1]))
        if tag == "dt":
            return dtype_from_name(node["v"])
        if tag == "S":
            return torch.Size(node["v"])
        if tag == "dev":
            return torch.device(node["v"])
        if tag == "N":
            tensor = leaf(node["i"], layout.extents[node["i"]])
            return tensor.numpy().copy().view(np.dtype(node["d"]))
        if tag == "ns":
            return np.frombuffer(base64.b64decode(node["v"]), dtype=np.dtype(node["d"]))[0]
        if tag in ("set", "fset"):
            items = [dec(v) for v in node["v"]]
            return set(items) if tag == "set" else frozenset(items)
        raise CorruptCheckpointError(f"unknown tag {tag!r} in checkpoint metadata")

    return dec(layout.tree)
