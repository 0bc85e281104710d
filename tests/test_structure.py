"""The shape of the package, checked from its source (docs/architecture.md states these rules).

- the import graph of ``llamaspec`` has no cycle, counting every import: top-level, function-local and
  ``TYPE_CHECKING``-only ones;
- no class is assembled from mixins (at most one base class defined in llamaspec);
- no module is over 450 lines;
- only ``llamaspec/_llama/`` imports ``llama_cpp``;
- only the rollback module (``llamaspec/memory.py``) calls memory operations (``seq_rm``, ``seq_cp``,
  ``seq_keep``, state save / load) on a context; the probe, whose job is to try them on a scratch context
  at start-up, is the one exception;
- the CLI lives inside the package: there is no top-level ``cli`` package;
- the package ships what a user command needs: no dev tooling (fault injection, load runners, fuzzers, RPC
  server processes, the tiny head fixtures: tests/support) and no import from tests/, scripts/ or benchmarks/;
- drafters/ is a layer: nothing in it imports the chain, its registry or anything above them;
- the public namespace holds what users call, not the CLI's helpers;
- every document a module cites exists in the repository, and every section number (§N) is a row of
  docs/architecture.md's "llama.cpp by section" table.
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


#: dev-only modules: they serve tests/ and scripts/ and live in tests/support (llamaspec.testing keeps the tiny
#: models ``llamaspec bench --quick`` runs on: tiny_models, tiny_arch); the research benchmarks (trace*, copy_set,
#: pool_soak) live in benchmarks/ (python -m benchmarks.research). server_variants stays: it backs bench --server.
DEV_ONLY = {"faults", "fim", "load_client", "load_mix", "load_run", "openapi_fuzz", "rpc_servers", "tiny_eagle",
            "tiny_mtp", "trace", "trace_report", "trace_sessions", "copy_set", "pool_soak", "bench_extra"}
#: top-level names of what does not ship: the package must never import them
UNSHIPPED = {"tests", "support", "benchmarks", "scripts", "conftest", "helpers"}


def test_no_dev_tooling_in_the_package():
    found = sorted(n for n in MODULES if n.rpartition(".")[2] in DEV_ONLY)
    assert not found, f"dev-only modules inside llamaspec/ (they belong in tests/support): {found}"


def _absolute_imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def test_the_package_imports_nothing_that_does_not_ship():
    hits = [f"{p.relative_to(ROOT)}:{line}: {mod}" for p in MODULES.values() for line, mod in _absolute_imports(p)
            if mod.partition(".")[0] in UNSHIPPED]
    assert not hits, "llamaspec imports from tests/, scripts/ or benchmarks/:\n" + "\n".join(hits)


def test_the_wheel_ships_only_the_package():
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    from setuptools import find_packages

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    pkgs = find_packages(str(ROOT), include=find.get("include", ("*",)), exclude=find.get("exclude", ()))
    assert "llamaspec" in pkgs and "llamaspec.testing" in pkgs
    assert all(p == "llamaspec" or p.startswith("llamaspec.") for p in pkgs), pkgs


def test_drafters_import_nothing_above_them():
    above = ("llamaspec.chain", "llamaspec.auto", "llamaspec.chain_registry", "llamaspec.contexts", "llamaspec.engine",
             "llamaspec.round", "llamaspec.draft_phase", "llamaspec.scheduler", "llamaspec.request", "llamaspec.slot",
             "llamaspec.server", "llamaspec.compat", "llamaspec.cli", "llamaspec.bench", "llamaspec.testing")
    graph = _graph()
    hits = sorted(f"{m} -> {t}" for m in graph if m.startswith("llamaspec.drafters") for t in graph[m]
                  if any(t == a or t.startswith(a + ".") for a in above))
    assert not hits, "drafters/ imports upward: " + ", ".join(hits)


def test_the_public_api_holds_no_cli_helpers():
    import llamaspec

    for name in ("check_device_params", "parse_rpc_servers", "write_atomic"):
        assert name not in llamaspec.__all__ and not hasattr(llamaspec, name), name
    for name in llamaspec.__all__:
        assert getattr(llamaspec, name) is not None, name


#: documents named in llamaspec/: a path (docs/limits.md) or a file name; an address (https://...) is elsewhere
_DOC_REF = re.compile(r"(?<![\w/.:-])((?:[\w.-]+/)*[\w-]+\.md)\b")
#: modules whose docstrings another branch rewrites (issue 34's request options); drop once merged


def _doc_refs(text: str) -> set[str]:
    out = set()
    for m in _DOC_REF.finditer(text):
        word_start = max(text.rfind(c, 0, m.start()) for c in " \n\t(`'\"") + 1
        if "://" not in text[word_start:m.start()]:
            out.add(m.group(1))
    return out


def test_cited_documents_exist():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    names = {Path(f).name for f in tracked} | {p.name for p in ROOT.glob("**/*.md") if ".git" not in p.parts}
    missing = []
    for path in MODULES.values():
        rel = str(path.relative_to(ROOT))
        for ref in sorted(_doc_refs(path.read_text())):
            ok = (ROOT / ref).is_file() if "/" in ref else ref in names
            if not ok:
                missing.append(f"{rel}: {ref}")
    assert not missing, "documents cited but not in the repository:\n" + "\n".join(missing)


def test_the_document_check_catches_a_missing_one():
    assert _doc_refs("see docs/limits.md and design.md, not https://x.org/docs/speculative.md") == {
        "docs/limits.md", "design.md"}


def test_every_section_number_is_in_the_architecture_table():
    rows = set(re.findall(r"^\| (§\d+(?:\.\d+)?) \|", (ROOT / "docs" / "architecture.md").read_text(), re.M))
    cited = {}
    for path in MODULES.values():
        for sec in re.findall(r"§ ?(\d+(?:\.\d+)?)", path.read_text()):
            cited.setdefault("§" + sec, str(path.relative_to(ROOT)))
    missing = {s: f for s, f in cited.items() if s not in rows}
    assert rows and not missing, f"section numbers cited without a row in docs/architecture.md: {missing}"


def test_a_real_model_in_an_unmarked_test_fails():
    """helpers.real_model() fails a test that lacks @pytest.mark.real (so -m 'not real' fetches nothing)."""
    import helpers

    class Item:
        nodeid = "tests/test_x.py::test_y"

        def get_closest_marker(self, name):
            return None

    saved = helpers.CURRENT_TEST[0]
    helpers.CURRENT_TEST[0] = Item()
    try:
        with pytest.raises(pytest.fail.Exception, match="without @pytest.mark.real"):
            helpers.real_model("smollm2-135m-q4_1")
    finally:
        helpers.CURRENT_TEST[0] = saved
