"""The ``kvlend`` console script.

Each subcommand is one row of ``COMMANDS``: its path (``("layout", "show")``),
a help line, a function that adds its arguments and a function that runs it
and returns the exit code.  A new subcommand (``demo``, ``bench``) is one
function and one row.  Every failure is one line on stderr and exit 2 (see
``EPILOG``); ``--debug`` adds the traceback.  Every option's help shows its
default (``DefaultsFormatter``).

Layout files are JSON holding exactly ``PageLayout.to_dict()`` (enums as
strings), or, named ``*.msgpack``, the bytes of ``PageLayout.encode()``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from .core.layout import LayerGroup, PageLayout
from .core.names import ROLES
from .errors import KvlendError, LayoutError, LayoutMismatch

EXIT_OK = 0
EXIT_MISMATCH = 1  # layouts cannot exchange pages; the demo's tokens did not verify
EXIT_USAGE = 2  # bad arguments or input, or a failure (one line on stderr)
EXIT_INTERRUPTED = 130  # Ctrl-C

EPILOG = """\
exit status:
  0    success (layout check: the layouts negotiate; demo: every request verified)
  1    layout check: the layouts cannot exchange pages (every differing field is
       printed); demo: a request's tokens did not verify
  2    bad arguments or input, or a failure such as a timeout or a lost peer
       (one line on stderr; --debug adds the traceback)
  130  interrupted

environment:
  KVLEND_CA, KVLEND_CERT, KVLEND_KEY  a rank's TLS credentials: the cluster CA certificate, its
                                      certificate and key (kvlend certs; the demo makes its own)
  KVLEND_LOG                          log level of the example ranks (default WARNING)
  NIXL_LOG_LEVEL                      NIXL's log level (default: NIXL's INFO lowered to WARNING)
  UCX_NET_DEVICES, UCX_TLS            which devices and transports UCX may use
"""


class DefaultsFormatter(argparse.RawDescriptionHelpFormatter):
    """Append "(default ...)" to an option's help unless it already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.nargs == 0 \
                or action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default {'none' if action.default is None else action.default})"


class CliError(Exception):
    """Bad command-line input (unreadable file, not JSON, invalid layout): exit 2."""


@dataclass(frozen=True)
class Command:
    path: tuple[str, ...]
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    exits: str = "exit status: 0 success, 2 error (one line on stderr)"


# ------------------------------------------------------------------ files
def load_layout(path: str) -> PageLayout:
    """Read a layout file: JSON of ``to_dict()``, or ``*.msgpack`` of ``encode()``."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CliError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        if path.endswith(".msgpack"):
            return PageLayout.decode(data)
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and bad UTF-8 are ValueErrors
            raise CliError(f"{path}: not valid JSON: {exc}") from None
        return PageLayout.from_dict(obj)
    except LayoutError as exc:
        raise CliError(f"{path}: invalid layout: {exc}") from None


# ------------------------------------------------------------- formatting
def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def _group_line(group: LayerGroup, tokens_per_page: int) -> str:
    layers = len({b.identity.layer for b in group.buffers})
    head = f"{group.name}: {group.kind.value}, {layers} layers, {len(group.buffers)} buffers"
    if group.recurrent:
        return f"{head}, one state row per request"
    pages = -(-group.read_window // tokens_per_page)
    sinks = f"{group.sinks} sink page" + ("" if group.sinks == 1 else "s")
    return f"{head}, read window {group.read_window} tokens ({pages} pages), {sinks}"


def format_layout(layout: PageLayout) -> str:
    """A human summary: header fields, then regions, buffers and groups."""
    rep = layout.replica
    per_token = sum(b.page_bytes for b in layout.buffers if not b.recurrent) / layout.tokens_per_page
    lines = _table(("field", "value"), [
        ("layout_id", layout.layout_id),
        ("tokens per page", layout.tokens_per_page),
        ("kept window", f"{layout.kept_window} tokens"),
        ("dtype", layout.dtype),
        ("scope", repr(layout.scope)),
        ("replica", f"tp {rep.tp_rank}/{rep.tp_size}, pp {rep.pp_rank}/{rep.pp_size}"),
        ("attention bytes/token", f"{per_token:g}"),
    ])[1:]
    lines.append(f"regions ({len(layout.regions)}):")
    lines += _table(("name", "kind", "device", "pages", "stride", "size"), [
        (r.name, r.kind.value, r.device_id, r.num_pages, r.page_stride, _size(r.size)) for r in layout.regions
    ])
    lines.append(f"buffers ({len(layout.buffers)}):")
    lines += _table(("name", "region", "offset", "bytes", "layer", "role", "group", "geometry", "window", "sinks"), [
        (b.name, b.region, b.offset, b.page_bytes, b.identity.layer, b.identity.role.value, b.group,
         "-" if b.geometry is None else
         f"{b.geometry.heads}x{b.geometry.bytes_per_head}B {b.geometry.order.value} {b.geometry.sharding.value}",
         "-" if b.window is None else b.window, b.sinks)
        for b in layout.buffers
    ])
    lines.append(f"groups ({len(layout.groups)}):")
    lines += ["  " + _group_line(g, layout.tokens_per_page) for g in layout.groups.values()]
    return "\n".join(lines)


# ------------------------------------------------------------ subcommands
def _add_layout_show(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="layout file (.json, or .msgpack)")


def _run_layout_show(args: argparse.Namespace) -> int:
    layout = load_layout(args.file)
    print(f"layout {args.file}")
    print(format_layout(layout))
    return EXIT_OK


def _add_layout_check(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("local", help="this rank's layout file (e.g. decode)")
    parser.add_argument("remote", help="the peer's layout file (e.g. prefill)")


def _run_layout_check(args: argparse.Namespace) -> int:
    local, remote = load_layout(args.local), load_layout(args.remote)
    try:
        from .core.negotiate import negotiate  # lazily: only this command needs it
    except ImportError as exc:
        raise CliError(f"layout check needs kvlend.core.negotiate: {exc}") from None
    try:
        plan = negotiate(local, remote)
    except LayoutMismatch as exc:
        print(f"mismatch: {args.local} (local) cannot exchange pages with {args.remote} (remote)")
        for name, lv, rv, why in exc.fields:
            print(f"  {name}: local={lv!r} remote={rv!r} ({why})")
        if not exc.fields:
            print(f"  {exc}")
        return EXIT_MISMATCH
    print(plan.summary())
    return EXIT_OK


def _add_demo(parser: argparse.ArgumentParser) -> None:
    from .demo import pair  # here, not at the top: importing kvlend.cli loads none of the demo

    pair.build_parser(parser)


def _run_demo(args: argparse.Namespace) -> int:
    from .demo import pair

    pair.check_args(args)
    report = pair.run_pair(args)
    print(json.dumps(report) if args.json else pair.format_report(report))
    return EXIT_OK if report["verified"] else EXIT_MISMATCH


def _nixl_bench():
    """The bench lives with the plugin it measures; this is the one import of a plugin in kvlend, made only
    when the command runs, so ``kvlend`` and ``kvlend bench --help`` work without the plugin installed."""
    try:
        from kvlend_nixl import bench
    except ImportError as exc:
        raise CliError(f"bench needs the NIXL plugin (pip install plugins/nixl): {exc}") from None
    return bench


def _add_bench(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", default="1,2,3,4,5,6,7",
                        help="comma-separated scenarios to run: 1 large contiguous read, 2 model-shaped "
                             "fragmented pools, 3 small requests back to back, 4 cold peer, 5 many requests in flight, "
                             "6 progressive lending under chunked prefill, 7 decode CPU per request as fetches in "
                             "flight and prefill ranks grow (default 1,2,3,4,5,6,7)")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed repetitions per method in scenarios 1-2 (default 10, or 3 with --quick)")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions (seconds, for tests)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="also plot throughput against request size (needs matplotlib) (default: no plot)")


def _run_bench(args: argparse.Namespace) -> int:
    try:
        scenarios = [int(s) for s in args.scenario.split(",") if s.strip()]
    except ValueError:
        raise CliError(f"--scenario: expected numbers like 1,2,3, got {args.scenario!r}") from None
    if not scenarios:
        raise CliError("--scenario: name at least one scenario, like 1,2,3,4,5,6,7")
    if args.reps is not None and args.reps < 1:
        raise CliError(f"--reps: must be >= 1, got {args.reps}")
    bench = _nixl_bench()
    if args.plot:
        bench.pyplot()
        folder = Path(args.plot).resolve().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise CliError(f"--plot: cannot write into {folder}")
    report = bench.run(scenarios, args.quick, args.reps)
    print(json.dumps(report, indent=1) if args.json else bench.format_report(report))
    if args.plot:
        try:
            bench.plot(report, args.plot)
        except OSError as exc:
            raise CliError(f"--plot: cannot write {args.plot}: {exc.strerror or exc}") from None
    return EXIT_OK


# ------------------------------------------------------------------ certs
def _add_certs_ca(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", required=True, help="where to write ca.pem and ca.key (created if missing)")
    parser.add_argument("--name", default="kvlend cluster CA", help="the CA's common name")
    parser.add_argument("--days", type=int, default=3650, help="validity in days")


def _run_certs_ca(args: argparse.Namespace) -> int:
    from .security.certs import Authority  # lazily: the layout commands need no cryptography

    if args.days < 1:
        raise CliError(f"--days: must be >= 1, got {args.days}")
    for path in Authority.create(args.name, args.days).save(args.dir):
        print(f"wrote {path}")
    print("keep ca.key off the ranks: it issues identities (kvlend certs issue)")
    return EXIT_OK


def _add_certs_issue(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("identity", help="the rank's identity (its certificate's common name), e.g. prefill-0")
    parser.add_argument("--ca", required=True, metavar="DIR", help="the directory holding ca.pem and ca.key")
    parser.add_argument("--out", metavar="DIR", help="where to write IDENTITY.pem, IDENTITY.key and ca.pem, "
                        "never the CA's own directory (default: DIR/ranks under --ca)")
    parser.add_argument("--role", required=True, choices=ROLES,
                        help="what the rank is: a prefill accepts links only from decodes, a decode takes tickets "
                        "and links only from prefills, a router only reads the registry")
    parser.add_argument("--days", type=int, default=365, help="validity in days")


def _run_certs_issue(args: argparse.Namespace) -> int:
    from .security.certs import Authority, save_rank

    if args.days < 1:
        raise CliError(f"--days: must be >= 1, got {args.days}")
    out = args.out or os.path.join(args.ca, "ranks")  # apart from ca.key, which never goes to a rank
    env = save_rank(Authority.load(args.ca).issue(args.identity, args.role, args.days), out)
    print(f"# the rank {args.identity} loads its credentials from:")
    for name, path in env.items():
        print(f"export {name}={os.path.abspath(path)}")
    return EXIT_OK


def _add_certs_check(parser: argparse.ArgumentParser) -> None:
    pass


def _run_certs_check(args: argparse.Namespace) -> int:
    from .security.credentials import Credentials

    creds = Credentials.from_env()  # loading checks issuer, validity and key
    print(f"{creds.identity} ({creds.role}): certificate issued by the CA in $KVLEND_CA, matches its key, "
          f"valid until {creds.expires:%Y-%m-%d %H:%M} UTC")
    return EXIT_OK


# ---------------------------------------------------------------- cluster
def _add_cluster_status(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--etcd", default=os.environ.get("KVLEND_ETCD_ENDPOINTS", "127.0.0.1:2379"),
                        help="etcd endpoints, host:port[,host:port...] (default: $KVLEND_ETCD_ENDPOINTS)")
    parser.add_argument("--prefix", default=os.environ.get("KVLEND_CLUSTER_PREFIX", "/kvlend/default"),
                        help="the cluster's key prefix (default: $KVLEND_CLUSTER_PREFIX)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for etcd")
    parser.add_argument("--json", action="store_true", help="print the status as JSON "
                        "(records are checked against the cluster CA in $KVLEND_CA; refused ones are listed)")


def _run_cluster_status(args: argparse.Namespace) -> int:
    try:
        from .cluster.registry import Registry, cluster_ca_from_env, etcd_security_from_env
    except ImportError as exc:
        raise CliError(f"cluster status needs the etcd client (pip install 'kvlend[cluster]'): {exc}") from None
    if not 0 < args.timeout < 3600:
        raise CliError(f"--timeout: expected seconds in (0, 3600), got {args.timeout}")
    import logging

    logging.getLogger("kvlend.cluster.registry").setLevel(logging.ERROR)  # the failure is our one line
    registry = Registry([e.strip() for e in args.etcd.split(",") if e.strip()], args.prefix,
                        cluster_ca=cluster_ca_from_env(), timeout=min(args.timeout, 2.0),
                        **etcd_security_from_env())
    try:
        registry.start()
        if not registry.ready(args.timeout):
            raise CliError(f"etcd at {args.etcd} did not answer within {args.timeout:g} s: "
                           f"{registry.status()['why'] or 'no connection'}")
        status = registry.status()
    finally:
        registry.close()
    if args.json:
        print(json.dumps(status, indent=1))
        return EXIT_OK
    ranks = status["ranks"]
    print(f"cluster {args.prefix} at etcd {status['endpoint']} (revision {status['revision']}): "
          f"{len(ranks)} live ranks")
    rows = [("IDENTITY", "ROLE", "ENDPOINT", "LAYOUT", "TP", "PP", "LOAD", "HEALTH")] + [
        (r["identity"], r["role"], r["endpoint"], r["layout_id"] or "-", r["tp"], r["pp"],
         f"{r['load']}/{r['capacity']}", "ok" if r["healthy"] else "UNHEALTHY") for r in ranks]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    for key, why in status["rejected"].items():
        print(f"unreadable record {key!r}: {why}")
    return EXIT_OK


COMMANDS: tuple[Command, ...] = (
    Command(("layout", "show"), "print a human summary of a layout file", _add_layout_show, _run_layout_show),
    Command(("layout", "check"), "negotiate two layouts: exit 0 with the plan, or 1 naming every mismatch",
            _add_layout_check, _run_layout_check,
            "exit status: 0 the layouts negotiate (the plan is printed), 1 they cannot exchange pages "
            "(every differing field is printed), 2 bad input"),
    Command(("demo",), "run prefill ranks and a decode rank moving a real KV cache over NIXL on loopback, "
                       "many fetches in flight, with a report",
            _add_demo, _run_demo,
            "exit status: 0 every request verified, 1 a request did not verify or a rank exited non-zero "
            "after the report, 2 bad options or a rank failed before reporting (one line on stderr). "
            "Environment: KVLEND_LOG sets the ranks' log level."),
    Command(("bench",), "measure kvlend's reads against raw NIXL, memcpy, per-page and staging baselines",
            _add_bench, _run_bench),
    Command(("certs", "ca"), "create a cluster certificate authority", _add_certs_ca, _run_certs_ca),
    Command(("certs", "issue"), "issue a rank certificate from a CA; prints the environment that loads it",
            _add_certs_issue, _run_certs_issue),
    Command(("certs", "check"), "load and check this rank's credentials ($KVLEND_CA, $KVLEND_CERT, $KVLEND_KEY)",
            _add_certs_check, _run_certs_check),
    Command(("cluster", "status"), "print the live ranks of a cluster from etcd (role, endpoint, layout, load)",
            _add_cluster_status, _run_cluster_status,
            "exit status: 0 etcd answered (the live ranks are printed, possibly none), 2 etcd did not answer "
            "within --timeout or bad options"),
)
GROUP_HELP = {("layout",): "inspect and compare PageLayout files",
              ("certs",): "TLS credentials: a cluster CA and one certificate per rank",
              ("cluster",): "the cluster registry in etcd: which ranks are alive"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlend", description="KV-cache lending for disaggregated LLM serving.",
                                     epilog=EPILOG, formatter_class=DefaultsFormatter)
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    parser.set_defaults(run=None, parser=parser)
    subparsers = {(): parser.add_subparsers(title="commands", metavar="COMMAND")}
    for cmd in COMMANDS:
        for depth in range(1, len(cmd.path)):
            prefix = cmd.path[:depth]
            if prefix not in subparsers:
                group = subparsers[prefix[:-1]].add_parser(prefix[-1], help=GROUP_HELP.get(prefix),
                                                           description=GROUP_HELP.get(prefix))
                group.set_defaults(run=None, parser=group)
                subparsers[prefix] = group.add_subparsers(title="commands", metavar="COMMAND")
        leaf = subparsers[cmd.path[:-1]].add_parser(cmd.path[-1], help=cmd.help, description=cmd.help,
                                                    epilog=textwrap.fill(cmd.exits, 78),
                                                    formatter_class=DefaultsFormatter)
        leaf.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks of errors")
        cmd.add_arguments(leaf)
        leaf.set_defaults(run=cmd.run, parser=leaf)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits: 0 after --help, 2 on a usage error
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.run is None:
        args.parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.run(args)
    except BrokenPipeError:  # stdout closed early (``| head``): quiet exit, as Python's docs advise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print("kvlend: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # expected failures are CliError/KvlendError; anything else still gets one line
        if args.debug:
            traceback.print_exc()
        message = " ".join(str(exc).split())
        if not isinstance(exc, (CliError, KvlendError)):
            message = f"unexpected {type(exc).__name__}: {message} (--debug shows the traceback)"
        print(f"kvlend: error: {message}", file=sys.stderr)
        return EXIT_USAGE
