"""open_state_store / parse_state_url: which store a state URL names, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from master.state.api import StateStoreError
from master.state.factory import StateStoreURL, open_state_store, parse_state_url
from master.state.sqlite import SQLiteStateStore


@pytest.mark.parametrize(
    ("url", "path"),
    [
        (":memory:", ":memory:"),
        ("runs/x/state.sqlite", "runs/x/state.sqlite"),
        ("/abs/state.db", "/abs/state.db"),
        ("sqlite:///abs/state.db", "/abs/state.db"),
        ("sqlite://relative.db", "relative.db"),
        ("sqlite://:memory:", ":memory:"),
    ],
)
def test_sqlite_forms(url: str, path: str) -> None:
    assert parse_state_url(url) == StateStoreURL("sqlite", path=path)


@pytest.mark.parametrize(
    ("url", "endpoints", "prefix"),
    [
        ("etcd://10.0.0.5:2379/dlrover/j", ("10.0.0.5:2379",), "/dlrover/j/"),
        ("etcd://a:1,b:2/x/y/", ("a:1", "b:2"), "/x/y/"),
        ("etcd://a", ("a:2379",), "/dlrover/myjob/"),
        ("ETCD://a:1/", ("a:1",), "/dlrover/myjob/"),
        ("etcd://[::1]:2379/p", ("[::1]:2379",), "/p/"),
    ],
)
def test_etcd_forms(url: str, endpoints: tuple[str, ...], prefix: str) -> None:
    assert parse_state_url(url, job="myjob") == StateStoreURL(
        "etcd", endpoints=endpoints, prefix=prefix
    )


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("", "is empty"),
        ("redis://h:1", "unknown scheme 'redis'"),
        ("sqlite://", "names no file"),
        ("etcd://", "'' is not host"),
        ("etcd://a:1,:2/p", "':2' is not host"),
        ("etcd://a:port/p", "'a:port' is not host"),
        ("etcd://a:70000/p", "'a:70000' is not host"),
    ],
)
def test_bad_urls_name_the_url_and_the_forms(url: str, match: str) -> None:
    with pytest.raises(StateStoreError, match=match) as info:
        parse_state_url(url)
    assert repr(url) in str(info.value) or not url
    assert "etcd://host:port" in str(info.value)


def test_opens_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with open_state_store(f"sqlite://{path}") as store:
        assert isinstance(store, SQLiteStateStore) and store.path == str(path)
        store.put("t", "k", b"v")
    with open_state_store(str(path)) as store:
        assert store.get("t", "k") == b"v"
    with open_state_store(":memory:") as store:
        assert isinstance(store, SQLiteStateStore) and store.get("t", "k") is None
