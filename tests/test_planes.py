"""The folders are the planes: core <- protocol <- runtime, transport and security beside, cluster between
core and runtime, and the pure parts stay pure.

Each pure module is imported alone in a fresh interpreter, which also
catches circular imports, and must not pull in NIXL, torch, sockets, threads
or clocks-with-sleep machinery.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvlend"
PURE = ("core", "protocol")
PURE_CLUSTER = ("kvlend.cluster.records", "kvlend.cluster.view")  # the cluster plane's pure half
# What each plane may import from the package (besides errors and itself).
ALLOWED = {
    "core": set(),
    "protocol": {"core"},
    "transport": {"core"},
    "security": {"core"},
    "cluster": {"core", "ports", "security"},  # security: records are signed with rank certificates
    "runtime": {"core", "protocol", "transport", "security", "metrics", "cluster", "ports"},
    "bench": {"core", "protocol", "transport", "security", "runtime", "ports"},
}
IMPURE = ("nixl", "torch", "socket", "select", "selectors", "asyncio", "subprocess")
# Imported directly by no pure module (``logging`` brings ``threading`` along; that is not a thread).
FORBIDDEN = IMPURE + ("threading", "time", "os")


def modules(plane: str) -> list[str]:
    return sorted(f"kvlend.{plane}.{p.stem}" for p in (PACKAGE / plane).glob("*.py") if p.stem != "__init__")


def planes_imported(path: pathlib.Path, plane: str) -> set[str]:
    """The package planes a module imports (relative or absolute)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                continue  # its own plane
            if node.level == 2:
                name = node.module or ""
            elif node.module and node.module.startswith("kvlend."):
                name = node.module.removeprefix("kvlend.")
            else:
                continue
            top = name.split(".")[0]
            if top and top != plane:
                out.add(top)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kvlend."):
                    out.add(alias.name.split(".")[1])
    return out - {"errors"}


@pytest.mark.unit
@pytest.mark.parametrize("plane", sorted(ALLOWED))
def test_each_plane_imports_only_the_planes_below_it(plane):
    for path in (PACKAGE / plane).glob("*.py"):
        extra = planes_imported(path, plane) - ALLOWED[plane]
        assert not extra, f"{path.relative_to(ROOT)} imports {sorted(extra)}"


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
