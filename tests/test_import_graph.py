"""The static import graph: its resolver on a synthetic tree, and the project's layering rules."""
import hashlib
import textwrap
from pathlib import Path

import pytest

from pipelines.import_graph import closure, code_digest, cycles, figures, module_graph

ROOT = Path(__file__).resolve().parent.parent

TREE = {
    "pkg/__init__.py": """
        VALUE = 1
        from .core import run
    """,
    # `from pkg import VALUE`: VALUE is an attribute, so the edge goes to pkg.
    "pkg/core.py": """
        import os
        from pkg import VALUE
        def run():
            pass
    """,
    # `from pkg import core`: core is a submodule.
    "pkg/tools.py": """
        from pkg import core
        helper = 1
    """,
    "pkg/sub/__init__.py": """
        from . import leaf
    """,
    "pkg/sub/leaf.py": """
        from ..tools import helper
        from . import sibling
    """,
    "pkg/sub/sibling.py": """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from pkg.sub import leaf
        def late():
            import pkg.core
        try:
            from ..tools import helper
        except ImportError:
            import json
    """,
    "pkg/sub/deep/__init__.py": """
        from ... import core
        from ....... import nowhere
    """,
    "pkg/sub/lonely.py": """
        import json
        import torch.nn
    """,
    "other/__init__.py": "",
    "other/uses.py": """
        import pkg.sub.deep
        from other import missing_attribute
    """,
}


@pytest.fixture()
def tree(tmp_path):
    for name, text in TREE.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def test_resolver_exact_edges(tree):
    graph = module_graph(tree, packages=("pkg", "other"))
    assert graph == {
        # level 1 from an __init__ resolves against the package itself
        "pkg": {"pkg.core"},
        # an attribute of pkg: edge to pkg; os is not ours
        "pkg.core": {"pkg"},
        # a submodule of pkg: edge to it and to the package it loads first
        "pkg.tools": {"pkg.core", "pkg"},
        # `from . import leaf` in pkg/sub/__init__: no self-edge to pkg.sub
        "pkg.sub": {"pkg.sub.leaf", "pkg"},
        # level 2 from a module: pkg.sub -> pkg; helper is an attribute of pkg.tools
        "pkg.sub.leaf": {"pkg.tools", "pkg.sub.sibling", "pkg.sub", "pkg"},
        # TYPE_CHECKING, function-level and try/except imports all count
        "pkg.sub.sibling": {"pkg.sub.leaf", "pkg.sub", "pkg.core", "pkg.tools", "pkg"},
        # level 3 from an __init__; an import above the top package is dropped
        "pkg.sub.deep": {"pkg.core", "pkg"},
        # being a child of pkg.sub is not importing it
        "pkg.sub.lonely": set(),
        "other": set(),
        # `import A.B.C` goes to A.B.C and its packages; a missing attribute of other goes to other
        "other.uses": {"pkg.sub.deep", "pkg.sub", "pkg", "other"},
    }


def test_star_import_and_package_scope(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a/__init__.py").write_text("")
    (tmp_path / "a/x.py").write_text("from .y import *\n")
    (tmp_path / "a/y.py").write_text("from a import x\n")
    (tmp_path / "b.py").write_text("")  # outside the scanned packages: never a node
    graph = module_graph(tmp_path, packages=("a",))
    assert graph == {"a": set(), "a.x": {"a.y", "a"}, "a.y": {"a.x", "a"}}
    assert cycles(graph) == [["a.x", "a.y"]]


def test_cycles_three_and_two():
    graph = {
        "a": {"b"}, "b": {"c"}, "c": {"a", "d"},  # three-module cycle
        "d": {"e"}, "e": {"d"},  # two-module cycle, reached from the first
        "f": {"a"}, "g": set(),
    }
    assert cycles(graph) == [["a", "b", "c"], ["d", "e"]]
    assert figures(graph) == {"files": 7, "arrows": 7, "cycles": 2, "modules_in_cycles": 5}


def test_no_cycles_in_a_dag():
    graph = {"a": {"b", "c"}, "b": {"c", "d"}, "c": {"d"}, "d": set(), "e": {"d"}}
    assert cycles(graph) == []
    assert figures(graph)["cycles"] == 0


def test_cycles_deep_chain_without_recursion():
    n = 5000  # far past the default recursion limit
    graph = {f"m{i}": {f"m{i + 1}"} for i in range(n)}
    graph[f"m{n}"] = {"m0"}
    assert cycles(graph) == [sorted(graph)]


def test_closure():
    graph = {"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a"}, "e": {"e2"}, "e2": {"e"}}
    assert closure(graph, "a") == {"a", "b", "c"}
    assert closure(graph, "c") == {"c"}
    assert closure(graph, "d") == {"a", "b", "c", "d"}
    assert closure(graph, "e") == {"e", "e2"}


def test_code_digest(tree):
    expected = hashlib.sha256()
    for rel in ("pkg/__init__.py", "pkg/core.py", "pkg/sub/deep/__init__.py"):
        expected.update(rel.encode() + b"\0" + (tree / rel).read_bytes())
    modules = ["pkg.sub.deep", "pkg.core", "pkg"]
    digest = code_digest(tree, modules)
    assert digest == expected.hexdigest()
    assert code_digest(tree, reversed(modules)) == digest  # sorted by name, not by argument order

    (tree / "pkg/tools.py").write_text("# outside the set\n")
    assert code_digest(tree, modules) == digest
    (tree / "pkg/core.py").write_text("# edited\n")
    assert code_digest(tree, modules) != digest
    with pytest.raises(FileNotFoundError):
        code_digest(tree, ["pkg.absent"])


# The project itself.


@pytest.fixture(scope="module")
def project():
    return module_graph(ROOT)


def test_project_graph_is_not_empty(project):
    # Guards the rules below from passing on an empty or unresolved graph.
    assert "pipelines.cli" in project["pipelines.__main__"]
    assert "quantizers.errors" in project["quantizers.rtn"]
    assert any(name.startswith("quantizers.") for name in project)


def test_quantizers_never_import_pipelines(project):
    edges = sorted(
        f"{source} -> {target}"
        for source, targets in project.items() if source.split(".")[0] == "quantizers"
        for target in targets if target.split(".")[0] == "pipelines"
    )
    assert edges == [], "quantizers must not depend on pipelines:\n" + "\n".join(edges)


def test_project_graph_is_acyclic(project):
    found = cycles(project)
    assert found == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_only_main_imports_cli(project):
    importers = sorted(source for source, targets in project.items() if "pipelines.cli" in targets)
    assert set(importers) <= {"pipelines.__main__"}, f"pipelines.cli imported by {importers}"
