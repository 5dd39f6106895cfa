"""The import graph of pipeline/ and flows/ has no cycle (issue 24): two modules that import
each other, however indirectly, cannot be read or tested one at a time. Every import counts,
a lazy one inside a function included. And their shape (issue 61): no module over 600 lines
(pipeline/config.py apart) and no function over 80."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OWN = ("pipeline", "flows")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = OWN) -> dict[str, set[str]]:
    """Each module of `packages` under `root` -> the modules of `packages` it imports."""
    files = {_module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pipeline.privacy import noise` imports the submodule noise when there is one
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                           for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in files and t != name}
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_pipeline_and_flows_have_no_import_cycle():
    graph = import_graph()
    assert "pipeline.stages.distill" in graph and "flows.pipeline_flow" in graph  # the walk sees the tree
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_check_finds_a_cycle_through_a_lazy_import(tmp_path):
    pkg = tmp_path / "pipeline"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "__init__.py").write_text("")
    (pkg / "models" / "base.py").write_text("def f():\n    from pipeline.evaluate import g\n")
    (pkg / "evaluate.py").write_text("from pipeline.models import base\n")
    cycle = find_cycle(import_graph(tmp_path, ("pipeline",)))
    assert cycle is not None and set(cycle) == {"pipeline.models.base", "pipeline.evaluate"}


def test_the_library_never_imports_the_orchestration():
    """pipeline/ is callable from plain Python: no module of it imports flows/ (or Prefect)."""
    bad = {m: sorted(d for d in deps if d.startswith("flows")) for m, deps in import_graph().items()
           if m.startswith("pipeline")}
    assert not {m: d for m, d in bad.items() if d}


def test_the_privacy_package_imports_no_stage():
    """pipeline/privacy/ decides the guarantee and a reviewer reads it alone (its README): none
    of its modules imports a stage, lazily or not (the records it reads come from
    pipeline/records.py; the audits that rebuild splits live in pipeline/audits/)."""
    graph = import_graph()
    assert "pipeline.privacy.dpsgd" in graph  # the walk sees the package
    bad = {m: sorted(d for d in deps if d.startswith("pipeline.stages")) for m, deps in graph.items()
           if m.startswith("pipeline.privacy")}
    assert not {m: d for m, d in bad.items() if d}


MAX_LINES = 600  # a module longer than this holds more than one thing (pipeline/config.py: one model per stage)
MAX_FUNCTION_LINES = 80  # a function a reader holds on one screen (CONVENTIONS 14)


def _modules() -> list[Path]:
    return [p for pkg in OWN for p in sorted((ROOT / pkg).rglob("*.py"))]


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`path:line name (n lines)` of each function or method of `path` longer than `limit` lines,
    from its `def` to its last line (decorators apart), nested ones too."""
    tree = ast.parse(path.read_text(), str(path))
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{node.lineno} {node.name} ({n} lines)"
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (n := node.end_lineno - node.lineno + 1) > limit]


def test_no_module_is_longer_than_a_reader_holds():
    long = {str(p.relative_to(ROOT)): n for p in _modules()
            if (n := len(p.read_text().splitlines())) > MAX_LINES and p != ROOT / "pipeline" / "config.py"}
    assert not long, f"over {MAX_LINES} lines: {long}; split the module by what its parts decide"


def test_no_function_is_longer_than_a_screen():
    long = [f for p in _modules() for f in long_functions(p)]
    assert not long, f"over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_the_function_check_counts_from_def_to_the_last_line(tmp_path):
    def body(indent: int) -> str:
        return "".join(f"{' ' * indent}x{i} = {i}\n" for i in range(79))

    (tmp_path / "m.py").write_text(f"def fits():\n{body(4)}\n\nclass C:\n    def too_long(self):\n{body(8)}        pass\n")
    assert long_functions(tmp_path / "m.py") == [f"{tmp_path / 'm.py'}:84 too_long (81 lines)"]
