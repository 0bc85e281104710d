"""The shape of the package, checked from its source (docs/architecture.md states these rules).

- the import graph of ``llamaspec`` has no cycle, counting every import: top-level, function-local and
  ``TYPE_CHECKING``-only ones;
- no class is assembled from mixins (at most one base class defined in llamaspec);
- no module is over 450 lines;
- only ``llamaspec/_llama/`` imports ``llama_cpp``;
- only the rollback module (``llamaspec/memory.py``) calls memory operations (``seq_rm``, ``seq_cp``,
  ``seq_keep``, state save / load) on a context; the probe, whose job is to try them on a scratch context
  at start-up, is the one exception;
- the CLI lives inside the package: there is no top-level ``cli`` package.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "llamaspec"
MAX_LINES = 450


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(importer: str, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not _is_package(importer):
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def import_edges(name: str) -> set[str]:
    """Every llamaspec module ``name`` imports, wherever the import statement is (TYPE_CHECKING included)."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    edges: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve(name, node.level, node.module)
            for a in node.names:
                sub = f"{mod}.{a.name}" if mod else a.name
                targets.append(sub if sub in MODULES else mod)
        for t in targets:
            # importing a.b.c imports a.b.c's nearest module that we know
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("llamaspec"):
                edges.add(t)
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _graph() -> dict[str, set[str]]:
    graph = {m: import_edges(m) for m in MODULES}
    # a package's __init__ that re-exports its submodules is imported by them only through ``from . import x``
    # of a submodule (resolved above to the submodule itself), so it stays an ordinary node here
    return graph


def test_import_graph_has_no_cycle():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (type-only imports count): " + "; ".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_class_is_assembled_from_mixins():
    local_classes: set[str] = set()
    trees = {}
    for name, path in MODULES.items():
        trees[name] = ast.parse(path.read_text())
        local_classes |= {n.name for n in ast.walk(trees[name]) if isinstance(n, ast.ClassDef)}
    offenders = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in node.bases]
            own = [b for b in bases if b in local_classes]
            if len(own) > 1 or "mixin" in node.name.lower():
                offenders.append(f"{name}.{node.name}({', '.join(bases)})")
    assert not offenders, "classes assembled from several llamaspec classes: " + ", ".join(offenders)


def test_no_module_is_over_the_line_limit():
    big = {n: len(p.read_text().splitlines()) for n, p in MODULES.items()}
    over = {n: k for n, k in big.items() if k > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"


def _calls_outside(pattern: str, allowed) -> list[str]:
    rx = re.compile(pattern)
    hits = []
    for name, path in MODULES.items():
        if allowed(name):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if rx.search(code) and not code.lstrip().startswith(('"', "'")):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    return hits


def test_only_the_boundary_imports_llama_cpp():
    hits = _calls_outside(r"^\s*(import llama_cpp\b|from llama_cpp\b)", lambda n: n.startswith("llamaspec._llama"))
    assert not hits, "llama_cpp imported outside llamaspec/_llama/:\n" + "\n".join(hits)


def test_only_the_rollback_module_calls_memory_operations():
    ops = r"\.(seq_rm|seq_cp|seq_keep|state_seq_get|state_seq_set|state_get_data|state_set_data)\("
    allowed = {"llamaspec.memory", "llamaspec.probe"}
    hits = _calls_outside(ops, lambda n: n.startswith("llamaspec._llama") or n in allowed)
    assert not hits, "memory operations outside llamaspec/memory.py:\n" + "\n".join(hits)


def test_the_grep_rules_catch_a_violation(tmp_path):
    # the patterns above match the calls they are meant to forbid (so the two tests above can fail)
    assert re.search(r"\.(seq_rm|state_seq_get)\(", "        self.ctx_dft.memory.seq_rm(seq, 0, -1)")
    assert re.search(r"^\s*(import llama_cpp\b|from llama_cpp\b)", "    from llama_cpp import Llama")


def test_the_cli_is_inside_the_package():
    assert not (ROOT / "cli").exists(), "the CLI belongs in llamaspec/cli/, not a top-level package"
    assert (PKG / "cli" / "__init__.py").exists()
    assert (PKG / "__main__.py").exists()


def test_python_dash_m_llamaspec_runs():
    r = subprocess.run([sys.executable, "-m", "llamaspec", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "generate" in r.stdout
