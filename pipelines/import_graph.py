"""Static import graph of the project's own modules.

Why: a stage's cache key hashes only the code that stage depends on (the
closure of its module in this graph), so editing an unrelated file does not
invalidate cached stages; and a test asserts the graph is acyclic, since a cycle
would make every module in it part of every other's closure.

Standard library only, so it can run before torch or any dependency is importable.
"""
from __future__ import annotations

import ast
import hashlib
from pathlib import Path


def _module_files(root: Path, packages) -> dict[str, Path]:
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def _targets(tree: ast.AST, module: str, is_package: bool, known) -> set[str]:
    # Relative imports resolve against the importer's package; a package is its own.
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):  # every import: function level, TYPE_CHECKING, try/except
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level > len(package):
                    continue  # beyond the top package: not one of ours
                base = package[: len(package) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in known else source)
    # Loading a module first executes every package above it.
    with_parents = set()
    for target in found:
        parts = target.split(".")
        with_parents.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {t for t in with_parents if t in known and t != module}


def module_graph(root: Path, packages=("pipelines", "quantizers")) -> dict[str, set[str]]:
    """Each module of `packages` under `root` -> the project modules it imports."""
    files = _module_files(Path(root), packages)
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_bytes(), filename=str(path))
        graph[module] = _targets(tree, module, path.name == "__init__.py", files)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        return node, iter(sorted(graph.get(node, ())))

    for start in sorted(graph):
        if start in index:
            continue
        work = [visit(start)]  # explicit stack: no recursion limit on deep graphs
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    at = stack.index(node)
                    component, stack[at:] = stack[at:], []
                    on_stack.difference_update(component)
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                work.append(visit(child))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(found)


def closure(graph: dict[str, set[str]], module: str) -> set[str]:
    """The module and everything it imports, transitively."""
    seen, todo = {module}, [module]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def code_digest(root: Path, modules) -> str:
    """SHA-256 over each module's relative path, a NUL and its bytes, by module name."""
    root = Path(root)
    digest = hashlib.sha256()
    for module in sorted(modules):
        path = root.joinpath(*module.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())  # a missing module raises: never hash absent code
    return digest.hexdigest()


def figures(graph: dict[str, set[str]]) -> dict:
    found = cycles(graph)
    return {
        "files": len(graph),
        "arrows": sum(len(targets) for targets in graph.values()),
        "cycles": len(found),
        "modules_in_cycles": sum(len(component) for component in found),
    }


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    graph = module_graph(root)
    for name, value in figures(graph).items():
        print(f"{name}: {value}")
    for component in cycles(graph):
        print("cycle:", " ".join(component))
