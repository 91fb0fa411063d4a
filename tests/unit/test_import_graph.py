"""The house rules of the layout: no import circles, parts import only what docs/architecture.md
allows, no hand-written module past the size limit; and the checker itself finds each breach."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import import_graph  # noqa: E402


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in import_graph.PACKAGES:
        (tmp_path / package).mkdir(exist_ok=True)
        (tmp_path / package / "__init__.py").touch()
    return tmp_path


def test_the_project_has_no_import_circle():
    graph, _ = import_graph.import_graph()
    assert "master.job.master" in graph and graph["master.job.master"], "graph looks empty"
    assert import_graph.circles(graph) == []


def test_every_import_follows_the_layer_rules():
    graph, external = import_graph.import_graph()
    assert import_graph.layer_violations(graph, external) == []


def test_no_hand_written_module_is_past_the_size_limit():
    assert import_graph.oversized() == []


def test_a_lazy_import_still_closes_a_circle(tmp_path):
    root = _tree(
        tmp_path,
        {
            "master/job/__init__.py": "",
            "master/job/a.py": "from master.job.b import B\n",
            "master/job/b.py": "def f():\n    from master.job import a\n    return a\n",
            "master/job/c.py": "import master.job.a\n",
        },
    )
    graph, _ = import_graph.import_graph(root)
    assert import_graph.circles(graph) == [["master.job.a", "master.job.b"]]


def test_relative_imports_and_package_reexports_are_resolved(tmp_path):
    root = _tree(
        tmp_path,
        {
            "master/client/__init__.py": "from .kv import KV\n",
            "master/client/kv.py": "from master.client.tls import T\n",
            "master/client/tls.py": "T = 1\n",
        },
    )
    graph, _ = import_graph.import_graph(root)
    assert graph["master.client"] == {"master.client.kv"}
    assert graph["master.client.kv"] == {"master.client.tls"}
    assert import_graph.circles(graph) == []


def test_an_import_against_the_layers_is_named(tmp_path):
    root = _tree(
        tmp_path,
        {
            "master/state/__init__.py": "",
            "master/state/store.py": "from master.job.loop import run\n",
            "master/job/__init__.py": "",
            "master/job/loop.py": "import tensorflow as tf\nfrom master.state import store\n",
        },
    )
    graph, external = import_graph.import_graph(root)
    problems = import_graph.layer_violations(graph, external)
    assert "master.state.store imports master.job.loop (master.state may not)" in problems
    assert "master.job.loop imports tensorflow (master must not)" in problems
    assert not any(p.startswith("master.job.loop imports master.state") for p in problems)


def test_a_long_module_is_reported(tmp_path):
    root = _tree(tmp_path, {"master/big.py": "x = 1\n" * 12, "master/pb/gen.py": "y = 2\n" * 50})
    assert import_graph.oversized(root, limit=10) == ["master.big: 12 lines"]
