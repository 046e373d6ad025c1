"""The house rules docs/design.md states, read from the source: imports point one way (no cycle, counting
imports inside functions), no module over 400 lines unless its docstring says why, no class over 250 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where each installed package lives on disk (pyproject.toml maps passes/, examples/ and benchmarks/ into the
# package's namespace).
PACKAGES = {"comera_compile": "comera_compile", "comera_compile.passes": "passes",
            "comera_compile.examples": "examples", "comera_compile.benchmarks": "benchmarks"}
MAX_MODULE_LINES, MAX_CLASS_LINES = 400, 250
LONGER_SAYS_WHY = "longer than 400 lines:"


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([package, *parts])
            out.setdefault(name, path)
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its code (imports under TYPE_CHECKING left out:
    they never run)."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node)
            for child in node.body for n in ast.walk(child)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def test_imports_have_no_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_cycle(tmp_path):
    """The check above can fail: two modules importing each other, one of them inside a function."""
    (tmp_path / "a.py").write_text("from pkg import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from pkg.a import x\n")
    modules = {"pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py"}
    assert _imports("pkg.a", modules["pkg.a"], modules) == {"pkg.b"}
    assert _imports("pkg.b", modules["pkg.b"], modules) == {"pkg.a"}


def test_no_module_over_400_lines_unless_it_says_why():
    long = []
    for name, path in _modules().items():
        text = path.read_text()
        lines = text.count("\n")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if lines > MAX_MODULE_LINES and LONGER_SAYS_WHY not in doc.lower():
            long.append(f"{name} ({lines} lines)")
    assert not long, f"modules over {MAX_MODULE_LINES} lines whose docstring does not say why: {long}"


def test_no_class_over_250_lines():
    big = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                big.append(f"{name}.{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not big, f"classes over {MAX_CLASS_LINES} lines: {big}"
