"""The planes: kvlend's folders (core <- protocol <- runtime, transport and security beside, cluster between
core and runtime), its top-level modules, the plugins and the examples; no import runs upward, and the pure
parts stay pure.

Every import in every module counts, lazy ones too: it must reach a plane that ``ALLOWED`` lists for the
importer's, and ``ALLOWED`` has no cycle, so no import points up.  Each pure module is also imported alone in a fresh
interpreter, which also catches circular imports, and must not pull in NIXL, torch, sockets, threads or
clocks-with-sleep machinery.
"""

from __future__ import annotations

import ast
import graphlib
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvlend"
EXAMPLES = ROOT / "examples"
PLUGINS = {"kvlend_nixl": ROOT / "plugins" / "nixl", "kvlend_vllm": ROOT / "plugins" / "vllm"}
PURE = ("core", "protocol")
PURE_CLUSTER = ("kvlend.cluster.records", "kvlend.cluster.view")  # the cluster plane's pure half
KVLEND = ("core", "protocol", "transport", "security", "cluster", "runtime", "metrics", "ports", "demo")
# What each plane may import (besides errors and itself).  ``kvlend`` is the package's face (kvlend/__init__.py);
# a plugin's ``bench`` (its package, or a script beside it) is a plane above the plugin.
ALLOWED = {
    "core": set(),
    "protocol": {"core"},
    "transport": {"core"},
    "security": {"core"},
    "cluster": {"core", "ports", "security"},  # security: records are signed with rank certificates
    "runtime": {"core", "protocol", "transport", "security", "metrics", "cluster", "ports"},
    "metrics": set(),
    "ports": set(),
    "testing": {"core", "protocol"},  # public API for tests: the sessions over an in-memory world
    "demo": {"core", "transport", "security", "runtime", "metrics"},  # kvlend demo's ranks: an engine's view
    "kvlend": {"core"},
    "cli": {"core", "security", "cluster", "demo", "kvlend_nixl.bench"},  # the bench only lazily: LAZY_ONLY
    "docs_reference": {"cli", "protocol", "metrics"},
    "kvlend_nixl": {"core", "transport", "metrics"},
    "kvlend_nixl.bench": {"core", "protocol", "transport", "security", "runtime", "ports", "kvlend_nixl"},
    # The connector and router need no NIXL to import; the bench's in-process yardstick is the NIXL plugin's.
    "kvlend_vllm": {"core", "protocol", "transport", "security", "cluster", "runtime", "ports"},
    "kvlend_vllm.bench": {"ports", "kvlend_vllm", "kvlend_nixl.bench"},
    "examples": {"kvlend", *KVLEND},
}
# Edges taken only inside a function, never when the importer is imported: ``kvlend bench`` reaches the
# bench where it lives, with the plugin it measures, and kvlend imports without the plugin installed.
LAZY_ONLY = {("cli", "kvlend_nixl.bench")}
IMPURE = ("nixl", "torch", "socket", "select", "selectors", "asyncio", "subprocess")
# Imported directly by no pure module (``logging`` brings ``threading`` along; that is not a thread).
FORBIDDEN = IMPURE + ("threading", "time", "os")
EXAMPLE_NAMES = {p.stem for p in EXAMPLES.glob("*.py")} | {p.parent.name for p in EXAMPLES.glob("*/__init__.py")}


def modules(plane: str) -> list[str]:
    return sorted(f"kvlend.{plane}.{p.stem}" for p in (PACKAGE / plane).glob("*.py") if p.stem != "__init__")


def sources() -> list[pathlib.Path]:
    """Every module of every plane: the package, the plugins (their packages and the scripts beside them)
    and the examples."""
    paths = [*PACKAGE.rglob("*.py"), *EXAMPLES.rglob("*.py")]
    for folder in PLUGINS.values():
        paths += folder.rglob("*.py")
    return sorted(paths)


def module_name(path: pathlib.Path) -> str:
    """The dotted name ``path`` is imported under (examples/ is on the path of its scripts)."""
    for base in (EXAMPLES, *PLUGINS.values(), ROOT):
        if base in path.parents:
            parts = path.relative_to(base).with_suffix("").parts
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise AssertionError(f"{path} is in no plane")


def plane_of(name: str) -> str | None:
    """The plane a dotted module (or module.attribute) name belongs to; None outside ours."""
    parts = name.split(".")
    if parts[0] == "kvlend":
        return parts[1] if len(parts) > 1 and (parts[1] in ALLOWED or parts[1] == "errors") else "kvlend"
    if parts[0] in PLUGINS:
        return f"{parts[0]}.bench" if parts[1:2] == ["bench"] else parts[0]
    return "examples" if parts[0] in EXAMPLE_NAMES else None


def file_plane(path: pathlib.Path) -> str:
    if EXAMPLES in path.parents:
        return "examples"
    for package, folder in PLUGINS.items():
        if path.parent == folder:
            return f"{package}.bench"  # a script beside the package (plugins/nixl/bench.py) measures it
    return plane_of(module_name(path))


def imports(path: pathlib.Path) -> list[tuple[str, bool]]:
    """(dotted name, imported inside a function) for every import in ``path``, relative ones resolved."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text())
    lazy = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, id(node) in lazy) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out += [(f"{module}.{alias.name}", id(node) in lazy) for alias in node.names]
    return out


@pytest.mark.unit
def test_no_plane_imports_upward():
    assert list(graphlib.TopologicalSorter(ALLOWED).static_order())  # raises CycleError if any plane points up
    assert set().union(*ALLOWED.values()) <= set(ALLOWED)
    for path in sources():
        plane = file_plane(path)
        for name, lazy in imports(path):
            target = plane_of(name)
            if target in (None, "errors", plane):
                continue
            where = f"{path.relative_to(ROOT)} imports {name}"
            assert target in ALLOWED[plane], f"{where}: the {plane} plane may not import the {target} plane"
            assert lazy or (plane, target) not in LAZY_ONLY, f"{where} when imported: only inside a function"


def design_table() -> dict[str, set[str]]:
    """docs/design.md's planes table: each row's plane and what it may import, named as ``ALLOWED`` names them."""
    def name(cell: str, bench: str) -> str:
        cell = cell.removesuffix("/").removesuffix(".py")
        cell = {f"plugins/{folder.name}": package for package, folder in PLUGINS.items()}.get(cell, cell)
        return f"{cell}.bench" if bench else cell

    text = (ROOT / "docs" / "design.md").read_text()
    rows = [line.split(" | ") for line in text.split("## Planes")[1].split("\n## ")[0].splitlines()
            if line.startswith("| `")]
    return {name(*re.match(r"\| `([^`]+)`( bench)?", row[0]).groups()):
            {name(*m) for m in re.findall(r"`([^`]+)`( bench)?", row[2])} for row in rows}


@pytest.mark.unit
def test_design_table_says_what_each_plane_may_import():
    assert design_table() == ALLOWED


@pytest.mark.unit
def test_every_module_is_in_a_plane():
    kvlend = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
              if (p.suffix == ".py" or (p / "__init__.py").is_file()) and p.stem != "__init__"}
    assert kvlend - {"errors"} <= set(ALLOWED), "a kvlend module or folder without a plane in ALLOWED"


@pytest.mark.system
@pytest.mark.parametrize("module", [m for plane in PURE for m in modules(plane)] + list(PURE_CLUSTER))
def test_pure_modules_import_alone_without_io(module):
    code = (f"import sys, {module}\n"
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {IMPURE!r})\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{module} pulls in {out.stdout.strip()}"


@pytest.mark.unit
def test_pure_modules_import_no_clock_thread_socket_or_os():
    paths = [p for plane in PURE for p in (PACKAGE / plane).glob("*.py")]
    paths += [PACKAGE / "cluster" / f"{m.rsplit('.', 1)[1]}.py" for m in PURE_CLUSTER]
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.relative_to(ROOT)} imports {name}"
