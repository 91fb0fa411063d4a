"""Flash-checkpoint layout: nested state dicts round-trip exactly through tensor extents + JSON."""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrover_torch.checkpoint import layout
from dlrover_torch.checkpoint.errors import CorruptCheckpointError, UnsupportedValueError
from tests.unit.ckpt_helpers import assert_same, training_state


def round_trip(state):
    lay, tensors = layout.plan(state)
    region = torch.zeros(lay.data_bytes, dtype=torch.uint8)
    for ext, t in zip(lay.extents, tensors, strict=True):
        layout.tensor_view(region, ext).copy_(t)
    meta = layout.encode_meta(lay, {"step": 5})
    lay2, doc = layout.decode_meta(meta)
    assert doc["step"] == 5
    return layout.rebuild(lay2, lambda _i, ext: layout.tensor_view(region, ext))


def test_training_state_round_trips_exactly():
    state = training_state()
    out = round_trip(state)
    assert_same(state, out)
    assert isinstance(out["model"], OrderedDict)
    assert out["model"]._metadata == state["model"]._metadata
    # The restored state really drives a model and an optimizer.
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 3)
    )
    model.load_state_dict(out["model"])
    opt = torch.optim.AdamW(model.parameters())
    opt.load_state_dict(out["optimizer"])
    assert opt.param_groups[0]["betas"] == (0.9, 0.95)


def test_awkward_values_round_trip():
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    state = {
        1: "int key",
        (2, "t"): [None, True, False, 2**80, -0.0, math.inf, -math.inf, float("nan")],
        "bytes": b"\x00\xff",
        "ba": bytearray(b"ab"),
        "c": 1 + 2j,
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "dev": torch.device("cpu"),
        "noncontig": base.t(),
        "bf16": torch.randn(5).to(torch.bfloat16),
        "bool": torch.tensor([True, False, True]),
        "cplx": torch.randn(3, dtype=torch.complex64),
        "scalar": torch.tensor(7, dtype=torch.int16),
        "empty": torch.empty(0, 3),
        "np": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "np_scalar": np.float32(1.5),
        "set": {3, 1},
        "fset": frozenset({"a"}),
    }
    assert_same(state, round_trip(state))


def test_tensors_are_aligned_and_not_pickled():
    lay, _ = layout.plan({"a": torch.zeros(3, dtype=torch.uint8), "b": torch.zeros(2)})
    assert [e.offset % layout.ALIGN_BYTES for e in lay.extents] == [0, 0]
    meta = layout.encode_meta(lay, {})
    assert b"pickle" not in meta and len(meta) < 1000


class Opaque:
    pass


def test_unsupported_value_names_its_path():
    with pytest.raises(UnsupportedValueError, match=r"\['opt'\]\['x'\].*Opaque"):
        layout.plan({"opt": {"x": Opaque()}})
    with pytest.raises(UnsupportedValueError, match="sparse|dense"):
        layout.plan({"s": torch.eye(3).to_sparse()})


def test_corrupt_metadata_is_reported():
    with pytest.raises(CorruptCheckpointError):
        layout.decode_meta(b"{not json")
    lay, _ = layout.plan({"x": 1})
    meta = layout.encode_meta(lay, {}).replace(b'"version":1', b'"version":99')
    with pytest.raises(CorruptCheckpointError, match="version"):
        layout.decode_meta(meta)


leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.builds(
        lambda n, dt: torch.arange(n).to(dt),
        st.integers(0, 5),
        st.sampled_from([torch.float32, torch.int64, torch.bfloat16, torch.uint8]),
    ),
)
trees = st.recursive(
    leaves,
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.lists(kids, max_size=3).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=3), st.integers()), kids, max_size=3),
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(trees)
def test_random_trees_round_trip(tree):
    assert_same({"t": tree}, round_trip({"t": tree}))
