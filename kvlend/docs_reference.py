"""Write ``docs/reference.md`` from the code, so the reference cannot drift from what the code accepts.

It renders every option of ``kvlend`` and of the example ranks and scripts (their argparse parsers),
the fields of ``NodeConfig`` and ``Quotas`` with their defaults and comments, the fixed limits in the
protocol and the runtime, every environment variable the code reads, and the metrics in
``kvlend.metrics.SPECS``.  ``python -m kvlend.docs_reference`` rewrites the file; ``--check`` exits 1
when it is out of date (``tests/test_docs.py`` does the same).  It runs from a checkout: it reads
``examples/``, ``scripts/`` and ``plugins/`` beside the package.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import importlib.machinery
import importlib.util
import inspect
import math
import re
import sys
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
TABLES_START, TABLES_END = "<!-- state tables: generated -->", "<!-- end of state tables -->"
OUTPUT = ROOT / "docs" / "reference.md"
DESIGN = ROOT / "docs" / "design.md"
COMMAND = "python -m kvlend.docs_reference"

# Entry points whose parsers are built inside ``main()``: (how it is run, file under ROOT).
ENTRY_POINTS = (
    ("python -m kvlend.demo.prefill", "kvlend/demo/prefill.py"),
    ("python -m kvlend.demo.decode", "kvlend/demo/decode.py"),
    ("python examples/multinode_rank.py", "examples/multinode_rank.py"),
    ("python examples/cluster_rank.py", "examples/cluster_rank.py"),
    ("scripts/multinode-loopback", "scripts/multinode-loopback"),
    ("scripts/cluster-demo", "scripts/cluster-demo"),
    ("scripts/bench-codec", "scripts/bench-codec"),
    ("scripts/bench-plan", "scripts/bench-plan"),
    ("scripts/gpu-check", "scripts/gpu-check"),
    ("scripts/vllm-demo", "plugins/vllm/kvlend_vllm/demo.py"),
    ("scripts/vllm-bench", "plugins/vllm/kvlend_vllm/bench.py"),
    ("python -m kvlend_vllm.models", "plugins/vllm/kvlend_vllm/models.py"),
)

# Module-level constants that bound what a peer or a host can cost: (module, name), documented by the
# comment on their line, or (module, name, doc) for one without.
LIMITS = (
    ("kvlend.protocol.wire", "PROTOCOL_VERSION"),
    ("kvlend.protocol.wire", "MAX_FRAME_BYTES", "largest frame either end sends or accepts"),
    ("kvlend.protocol.frame_walk", "MAX_FRAME_DEPTH"),
    ("kvlend.protocol.frame_walk", "MAX_FRAME_CONTAINERS"),
    ("kvlend.protocol.frame_walk", "MAX_FRAME_ELEMENTS"),
    ("kvlend.protocol.wire", "MAX_META"),
    ("kvlend.protocol.ticket", "MAX_TICKET_BYTES", "largest ticket, encoded, a decode accepts"),
    ("kvlend.protocol.ticket", "MAX_TICKET_ROWS"),
    ("kvlend.protocol.connection", "AUTH_TIMEOUT"),
    ("kvlend.runtime.sockets", "READ_BYTES"),
    ("kvlend.runtime.sockets", "HANDSHAKE_READ_BYTES"),
    ("kvlend.runtime.sockets", "LOOKUP_TIMEOUT"),
    ("kvlend.runtime.sockets", "MAX_LOOKUPS"),
    ("kvlend.core.negotiate", "MAX_PAGE_RATIO"),
    ("kvlend.core.negotiate", "MAX_PIECES"),
)

# What each environment variable the code reads means: name -> (default, meaning).  The scan below
# finds the names; one read but not described here, or described but no longer read, is an error.
ENVIRONMENT = {
    "KVLEND_CA": ("none", "the cluster CA certificate (PEM) a rank trusts; `kvlend certs` writes it"),
    "KVLEND_CERT": ("none", "this rank's certificate (PEM); its common name is the rank's identity. In the vLLM "
                            "connector `{rank}` becomes the worker's TP rank"),
    "KVLEND_KEY": ("none", "this rank's private key (PEM, keep it 0600); `{rank}` as for `KVLEND_CERT`"),
    "KVLEND_LOG": ("`WARNING` (`INFO` inside vLLM)", "log level of the example ranks and of kvlend inside vLLM's "
                                                     "engine processes"),
    "KVLEND_LOOP_NICE": ("`-10`", "nice value of kvlend's loop thread inside a vLLM worker (negative needs "
                                 "CAP_SYS_NICE; without it the thread keeps its priority)"),
    "KVLEND_MODEL_DIR": ("`~/.cache/kvlend/models`", "where the local vLLM test models are built and cached"),
    "KVLEND_ETCD_ENDPOINTS": ("`127.0.0.1:2379`", "etcd endpoints `kvlend cluster status` reads"),
    "KVLEND_CLUSTER_PREFIX": ("`/kvlend/default`", "the cluster's key prefix in etcd"),
    "KVLEND_ETCD_USER": ("none", "etcd's own authentication, with `KVLEND_ETCD_PASSWORD`: both or neither"),
    "KVLEND_ETCD_PASSWORD": ("none", "see `KVLEND_ETCD_USER`"),
    "KVLEND_ETCD_CA": ("none: plaintext", "speak TLS to etcd and check its certificate against this CA (PEM)"),
    "KVLEND_ETCD_CERT": ("none", "client certificate (PEM) for etcd's `--client-cert-auth`; needs `KVLEND_ETCD_CA`"),
    "KVLEND_ETCD_KEY": ("none", "the key of `KVLEND_ETCD_CERT`"),
    "KVLEND_ETCD": ("`etcd` on PATH, else `/usr/bin/etcd`", "the etcd binary local members run"),
    "KVLEND_PYTHON": ("`.venv/bin/python`", "the interpreter `scripts/multinode-loopback` runs each rank with"),
    "PYTHON": ("`python3`", "the interpreter `scripts/setup` creates `.venv` with"),
    "NIXL_LOG_LEVEL": ("unset: NIXL's INFO lowered to WARNING", "when set, NIXL's own log level rules"),
    "UCX_TLS": ("UCX's choice", "transports UCX may use; tcp and CPU copies only let the NIXL backend retire a "
                                "reset agent instead of destroying it (`plugins/nixl/README.md`)"),
    "KVLEND_CHAOS_S": ("`20`", "tests: seconds of the chaos run in `tests/test_chaos.py`"),
    "KVLEND_SOAK_S": ("`30`", "tests: seconds of the soak run in `tests/test_chaos.py`"),
    "KVLEND_RANK_STDERR": ("unset: discarded", "tests: keep the stderr of the ranks the fault tests start"),
    "LD_LIBRARY_PATH": ("inherited", "`scripts/vllm-bench`'s MooncakeConnector baseline processes get the libibverbs "
                                     "that `scripts/vllm-setup` unpacked into `.venv-vllm/mooncake-libs` in front "
                                     "of it (never installed system-wide: docs/operations.md, Troubleshooting)"),
    "KVLEND_CPU_DEVICE_INDEX_SHIM": ("unset", "set by `scripts/vllm-bench` for its MooncakeConnector baseline only: "
                                     "`torch.accelerator.current_device_index()` returns 0 on a host without "
                                     "an accelerator (vLLM's Mooncake worker calls it)"),
}
# Read by the libraries underneath, not by kvlend: listed so the reference has them in one place.
UNDERNEATH = {
    "UCX_NET_DEVICES": "which devices UCX may use, e.g. `eth0` or `mlx5_0:1` (per host; set before the agent is made)",
}

SOURCES = ("kvlend", "plugins", "examples", "scripts")  # any variable read here
TEST_SOURCES = ("tests",)  # only KVLEND_* read here
PY_READS = (
    re.compile(r"""environ\[\s*["']([A-Z][A-Z0-9_]*)["']\s*\]"""),
    re.compile(r"""environ\.get\(\s*["']([A-Z][A-Z0-9_]*)["']"""),
    re.compile(r"""getenv\(\s*["']([A-Z][A-Z0-9_]*)["']"""),
    re.compile(r"""["']([A-Z][A-Z0-9_]*)["']\s+in\s+os\.environ"""),
    re.compile(r"""^[A-Z_]*ENV\s*=\s*["']([A-Z][A-Z0-9_]*)["']""", re.M),  # CA_ENV = "KVLEND_CA"
)
SHELL_READS = re.compile(r"\$\{([A-Z][A-Z0-9_]*)(?::?-[^}]*)?\}")


class Undocumented(Exception):
    """The code holds something the reference cannot describe (an undocumented variable or field)."""


# ------------------------------------------------------------------ environment
def _source_files(tops: tuple[str, ...]) -> Iterator[Path]:
    for top in tops:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and not any(p.endswith(".egg-info") or p == "__pycache__" for p in path.parts) \
                    and (path.suffix == ".py" or path.parent.name == "scripts"):
                yield path


def _reads(text: str) -> set[str]:
    names = set()
    for pattern in PY_READS:
        names.update(pattern.findall(text))
    if text.startswith("#!") and "bash" in text.splitlines()[0]:
        names.update(SHELL_READS.findall(text))
    return names


def environment_reads() -> dict[str, list[str]]:
    """Every environment variable the code reads -> the files that read it."""
    found: dict[str, list[str]] = {}
    for tops, keep in ((SOURCES, lambda n: True), (TEST_SOURCES, lambda n: n.startswith("KVLEND_"))):
        for path in _source_files(tops):
            for name in sorted(_reads(path.read_text(errors="replace"))):
                if keep(name):
                    found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def environment_section() -> list[str]:
    """The table of environment variables; a variable read but not described (or the reverse) is an error."""
    reads = environment_reads()
    undocumented = sorted(set(reads) - set(ENVIRONMENT))
    stale = sorted(set(ENVIRONMENT) - set(reads))
    if undocumented or stale:
        raise Undocumented(f"describe in kvlend/docs_reference.py ENVIRONMENT: {undocumented}; "
                           f"no longer read: {stale}")
    rows = [(f"`{name}`", default, meaning, _paths(reads[name])) for name, (default, meaning) in ENVIRONMENT.items()]
    lines = _table(("variable", "default", "meaning", "read by"), rows)
    lines += ["", "Read by the libraries underneath, not by kvlend:", ""]
    lines += _table(("variable", "meaning"), [(f"`{n}`", m) for n, m in UNDERNEATH.items()])
    return lines


def _paths(paths: list[str], most: int = 4) -> str:
    text = ", ".join(f"`{p}`" for p in paths[:most])
    return text if len(paths) <= most else f"{text} and {len(paths) - most} more"


# ------------------------------------------------------------------ options
class _Parsed(BaseException):  # not an Exception: a main() that catches those must not swallow it
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


@contextlib.contextmanager
def _capturing_parsers() -> Iterator[None]:
    """Make ``parse_args`` hand back the parser instead of parsing: the entry points build theirs in
    ``main()``, so this documents exactly the parser each one runs with, without running it."""
    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

    def capture(self, *args, **kwargs):
        raise _Parsed(self)

    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = capture
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved


def entry_point(relative: str) -> tuple[argparse.ArgumentParser, str]:
    """The parser ``main()`` of the file at ``relative`` builds (the file is imported, never run), and
    the file's docstring."""
    path = ROOT / relative
    if (path.parent / "__init__.py").is_file():  # a package's module: import it by its name
        return _main_parser(importlib.import_module(_module_name(path)), relative)
    name = "kvlend_reference_" + re.sub(r"\W", "_", path.stem)
    loader = importlib.machinery.SourceFileLoader(name, str(path))  # scripts have no .py suffix
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    search_path = list(sys.path)
    sys.path.insert(0, str(path.parent))  # as when it runs: a script's own folder comes first
    try:
        loader.exec_module(module)
        return _main_parser(module, relative)
    finally:
        del sys.modules[name]
        sys.path[:] = search_path


def _module_name(path: Path) -> str:
    """The dotted name of the module at ``path``, from the outermost package folder above it."""
    parts = [path.stem]
    while (path.parent / "__init__.py").is_file():
        path = path.parent
        parts.insert(0, path.name)
    return ".".join(parts)


def _main_parser(module, relative: str) -> tuple[argparse.ArgumentParser, str]:
    try:
        with _capturing_parsers():
            module.main()
    except _Parsed as parsed:
        return parsed.parser, module.__doc__ or ""
    raise Undocumented(f"{relative}: main() returned without parsing arguments")


def _option_rows(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    from .cli import DefaultsFormatter

    helper = DefaultsFormatter(parser.prog)
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._SubParsersAction, argparse._HelpAction)) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            name = ", ".join(action.option_strings)
            if action.nargs != 0:
                name += " " + helper._format_args(action, helper._get_default_metavar_for_optional(action))
        else:
            name = helper._format_args(action, helper._get_default_metavar_for_positional(action))
        if action.required and action.option_strings:
            text = action.help or ""
            text += "" if "required" in text else " (required)"
        else:
            text = helper._expand_help(action) if action.help else helper._get_help_string(action)
        text = " ".join(text.split())
        if text.startswith("(default") and text.endswith(")"):  # no help, only the default
            text = text[1:-1]
        rows.append((f"`{name}`", text.replace("|", "\\|") or "-"))
    return rows


def _kvlend_commands() -> list[str]:
    from . import cli

    lines = ["### `kvlend`", "", "```", cli.EPILOG.rstrip(), "```", ""]
    lines += _table(("option", "meaning"), _option_rows(cli.build_parser()))
    parsers = _leaf_parsers(cli.build_parser())
    for command in cli.COMMANDS:
        words = " ".join(command.path)
        lines += ["", f"### `kvlend {words}`", "", command.help[0].upper() + command.help[1:] + ".", "",
                  command.exits[0].upper() + command.exits[1:].rstrip(".") + ".", ""]
        lines += _table(("option", "meaning"), _option_rows(parsers[command.path]))
    return lines


def _leaf_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict:
    found = {path: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found.update(_leaf_parsers(child, path + (name,)))
    return found


def _entry_points() -> list[str]:
    lines = []
    for how, relative in ENTRY_POINTS:
        parser, doc = entry_point(relative)
        lines += [f"### `{how}`", "", f"[`{relative}`](../{relative}): {_first_sentence(doc)}", ""]
        lines += _table(("option", "meaning"), _option_rows(parser))
        lines.append("")
    return lines[:-1]


def _first_sentence(text: str | None) -> str:
    paragraph = " ".join((text or "").strip().split("\n\n")[0].split()).replace("``", "`")
    sentence = paragraph.split(". ")[0].rstrip(".")
    return sentence + "."


# ------------------------------------------------------------------ configuration
def field_docs(cls: type) -> dict[str, str]:
    """Each dataclass field's doc: the comment lines right above it and the comment after it, else the
    class docstring's bullet ``- ``name`` (default): text``.  A comment above a run of fields (no blank
    line between them) describes the run: the fields after the first refer to it."""
    docs: dict[str, str] = {}
    bullets = dict(re.findall(r"- ``(\w+)``(?: \([^)]*\))?: (.*?)(?=\n\s*- ``|\n\s*\n|\Z)", cls.__doc__ or "", re.S))
    above: list[str] = []
    run_head = ""  # the field a comment above a run of fields was written over
    for line in inspect.getsource(cls).splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# "))
            continue
        match = re.match(r"    (\w+)\s*:[^=]*=(.*)$", line)
        if not match:
            above, run_head = [], ""
            continue
        name, rest = match.groups()
        after = [rest.split("  # ", 1)[1]] if "  # " in rest else []
        if above:
            text, run_head = " ".join(above + after), name
        else:
            text = " ".join(after) or bullets.get(name, "") or (f"see `{run_head}`" if run_head else "")
        docs[name] = " ".join(text.replace("``", "`").split())
        above = []
    return docs


def _config_table(cls: type) -> list[str]:
    docs = field_docs(cls)
    rows = []
    for item in dataclasses.fields(cls):
        if not docs.get(item.name):
            raise Undocumented(f"{cls.__name__}.{item.name} has no comment or docstring bullet to document it")
        rows.append((f"`{item.name}`", f"`{_value(item.default, item.name)}`", docs[item.name].replace("|", "\\|")))
    return _table(("field", "default", "meaning"), rows)


def _value(value: object, name: str) -> str:
    if dataclasses.is_dataclass(value):
        return f"{type(value).__name__}()"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10_000:
        if "bytes" in name.lower():
            for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
                if value % (1 << shift) == 0:
                    return f"{value:,} ({value >> shift} {unit})"
        return f"{value:,}"
    return repr(value)


def _configuration() -> list[str]:
    from .protocol.config import NodeConfig, Quotas

    lines = ["### `NodeConfig`", "", f"`kvlend.protocol.config.NodeConfig` (also exported by `kvlend.runtime`): "
             f"{_first_sentence(NodeConfig.__doc__)}", ""]
    lines += _config_table(NodeConfig)
    lines += ["", "### `Quotas`", "",
              f"`kvlend.protocol.config.Quotas`, `NodeConfig.quotas`: {_first_sentence(Quotas.__doc__)}", ""]
    lines += _config_table(Quotas)
    return lines


def _limits() -> list[str]:
    rows = []
    for module_name, name, *doc in LIMITS:
        module = importlib.import_module(module_name)
        value = getattr(module, name)
        rows.append((f"`{module_name}.{name}`", f"`{_value(value, name)}`", _constant_doc(module, name) or doc[0]))
    return _table(("constant", "value", "meaning"), rows)


def _constant_doc(module, name: str) -> str:
    tree = ast.parse(inspect.getsource(module))
    lines = inspect.getsource(module).splitlines()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            line = lines[node.lineno - 1]
            return line.split("  # ", 1)[1].strip() if "  # " in line else ""
    raise Undocumented(f"{module.__name__}.{name} is not assigned at module level")


# ------------------------------------------------------------------ metrics
def _metrics() -> list[str]:
    from .metrics import SIZE_BUCKETS, SPECS, TIME_BUCKETS

    rows = [(f"`{s.name}`", s.kind, ", ".join(f"`{label}`" for label in s.labels) or "-", s.doc)
            for s in SPECS.values()]
    lines = _table(("metric", "type", "labels", "meaning"), rows)
    powers = [round(math.log(b, 4)) for b in SIZE_BUCKETS]
    if SIZE_BUCKETS != tuple(float(4**p) for p in range(powers[0], powers[-1] + 1)):
        raise Undocumented("kvlend.metrics.SIZE_BUCKETS are no longer the powers of 4: say what they are")
    lines += ["", f"Histograms have Prometheus' `_bucket`, `_sum` and `_count` series. Buckets: seconds "
                  f"{', '.join(f'{b:g}' for b in TIME_BUCKETS)}; bytes and descriptors 4^{powers[0]} to "
                  f"4^{powers[-1]}."]
    return lines


# ------------------------------------------------------------------ the page
def _table(headers: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)] + \
        ["| " + " | ".join(row) + " |" for row in rows]


def render() -> str:
    """The whole of ``docs/reference.md``."""
    lines = [
        "# Reference",
        "",
        f"<!-- Generated from the code by `{COMMAND}`: do not edit by hand. -->",
        "",
        "Generated from the code: the command line (argparse), configuration (the dataclasses' fields and "
        "their comments), fixed limits, the environment variables the code reads, and the metrics. "
        f"Regenerate it with `{COMMAND}`; `tests/test_docs.py` fails when it is out of date. "
        "What these mean together: [design.md](design.md), [operations.md](operations.md).",
        "",
        "## Command line",
        "",
        "Every `kvlend` command takes `--debug` (before or after its name) to show tracebacks; otherwise an "
        "error is one line on stderr, `kvlend: error: ...`. `kvlend demo` takes the options of "
        "`kvlend.demo.pair`, which passes them on to its ranks.",
        "",
    ]
    lines += _kvlend_commands()
    lines += ["", "## Example ranks and scripts", "",
              "The NIXL backend's options (`load_backend(\"nixl\", **options)`) are in "
              "[`plugins/nixl/README.md`](../plugins/nixl/README.md); the vLLM connector's "
              "`kv_connector_extra_config` keys in [vllm.md](vllm.md#configuration). "
              "`scripts/chaos` takes `--seconds`, `--runs`, `--seed`, `--inflight`, `--cancel` and `--stops` "
              "([faults.md](faults.md#chaos)).", ""]
    lines += _entry_points()
    lines += ["", "## Configuration", ""]
    lines += _configuration()
    lines += ["", "## Limits", "", "Fixed in the code; they bound what a peer or a slow host can cost.", ""]
    lines += _limits()
    lines += ["", "## Environment variables", "", "Every variable the code reads (found by scanning "
              "`kvlend/`, `plugins/`, `examples/`, `scripts/`, and `tests/` for `KVLEND_*`).", ""]
    lines += environment_section()
    lines += ["", "## Metrics", "", "`kvlend.metrics.METRICS`: `snapshot()` from Python, `serve(port)` for "
              "Prometheus ([operations.md](operations.md#metrics)).", ""]
    lines += _metrics()
    return "\n".join(lines) + "\n"


def with_state_tables(design: str) -> str:
    """``docs/design.md`` with the sessions' transition tables rendered between its two markers."""
    from kvlend.protocol import states

    start, end = design.index(TABLES_START) + len(TABLES_START), design.index(TABLES_END)
    return design[:start] + "\n\n" + states.markdown().strip() + "\n\n" + design[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="Write docs/reference.md and the state tables "
                                     "of docs/design.md from the code.")
    parser.add_argument("--check", action="store_true", help="exit 1 if either is out of date")
    args = parser.parse_args(argv)
    design = DESIGN.read_text() if DESIGN.is_file() else ""
    wanted = {OUTPUT: render(), DESIGN: with_state_tables(design)}
    stale = [path for path, text in wanted.items() if not path.is_file() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is out of date: run {COMMAND}", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path])
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
