"""The ``kvlend`` console script and the example layout files it reads."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvlend import cli
from kvlend.core.layout import LayerKind, MemoryKind, PageLayout, RowSelection, layout_from_pools
from kvlend.demo import decode, pair
from kvlend.errors import ConfigError
from kvlend.security.credentials import CA_ENV, CERT_ENV, KEY_ENV, Credentials

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "layouts"
LLAMA = str(EXAMPLES / "llama-3.1-8b.json")
JAMBA = str(EXAMPLES / "jamba-hybrid.json")


def load(path: str) -> PageLayout:
    return PageLayout.from_dict(json.loads(Path(path).read_text()))


@pytest.fixture
def llama_fp16(tmp_path) -> str:
    d = json.loads(Path(LLAMA).read_text())
    d["dtype"] = "float16"
    path = tmp_path / "llama-fp16.json"
    path.write_text(json.dumps(d))
    return str(path)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def has_row(out: str, cells: str) -> bool:
    """A table row with these cells, whatever the column widths."""
    return any(line.split() == cells.split() for line in out.splitlines())


# ----------------------------------------------------------- the examples
@pytest.mark.unit
def test_example_files_are_what_make_layouts_writes():
    spec = importlib.util.spec_from_file_location("make_layouts", EXAMPLES / "make_layouts.py")
    make_layouts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_layouts)
    assert set(make_layouts.EXAMPLES) == {"llama-3.1-8b.json", "jamba-hybrid.json"}
    for name, build in make_layouts.EXAMPLES.items():
        assert (EXAMPLES / name).read_text() == make_layouts.render(build())


@pytest.mark.unit
def test_llama_example_is_what_layout_from_pools_makes():
    lay = load(LLAMA)
    assert (len(lay.regions), len(lay.buffers), lay.tokens_per_page, lay.dtype) == (32, 64, 16, "bfloat16")
    assert sum(b.page_bytes for b in lay.buffers) // lay.tokens_per_page == 131072  # Llama-3.1-8B: bytes per token
    # Same per-page shape in small torch pools: same identity (capacity and addresses do not count).
    pools = [torch.empty(2, 2, 8, 16, 128, dtype=torch.bfloat16) for _ in range(32)]
    from_pools = layout_from_pools(pools, kept_window=131072, scope=lay.scope)
    assert from_pools.layout_id == lay.layout_id
    assert [b.name for b in from_pools.buffers] == [b.name for b in lay.buffers]


@pytest.mark.unit
def test_jamba_example_shape():
    lay = load(JAMBA)
    attention = sorted({b.identity.layer for b in lay.buffers if b.identity.kind is LayerKind.ATTENTION})
    assert attention == [4, 12, 20, 28]
    assert len({b.identity.layer for b in lay.buffers}) == 32
    groups = lay.groups
    assert (groups["swa"].read_window, groups["swa"].sinks) == (4096, 1)
    assert groups["full"].read_window == lay.kept_window
    assert groups["mamba"].recurrent and len(groups["mamba"].buffers) == 56
    assert lay.buffer("L0.STATE").page_bytes == 8192 * 16 * 2 and lay.buffer("L0.CONV").page_bytes == 8192 * 3 * 2
    assert lay.region("swa.host").kind is MemoryKind.HOST
    with pytest.raises(Exception, match="HOST regions"):
        lay.check_selection(RowSelection.all())


# ------------------------------------------------------------ layout show
@pytest.mark.unit
def test_show_llama(capsys):
    code, out, err = run(capsys, "layout", "show", LLAMA)
    assert code == 0 and err == ""
    lay = load(LLAMA)
    assert lay.layout_id in out
    for expected in ("tokens per page        16", "dtype                  bfloat16",
                     "replica                tp 0/1, pp 0/1", "attention bytes/token  131072",
                     "regions (32):", "buffers (64):", "groups (1):",
                     "full: ATTENTION, 32 layers, 64 buffers, read window 131072 tokens (8192 pages), 0 sink pages"):
        assert expected in out, expected
    assert has_row(out, "L31.kv DEVICE 0 4096 65536 256.0 MiB")
    assert has_row(out, "L31.V L31.kv 32768 32768 31 V full 8x256B HND INDEXED - 0")


@pytest.mark.unit
def test_show_jamba(capsys):
    code, out, _ = run(capsys, "layout", "show", JAMBA)
    assert code == 0
    assert load(JAMBA).layout_id in out
    assert has_row(out, "swa.host HOST 0 4096 131072 512.0 MiB")
    assert "swa: ATTENTION, 2 layers, 4 buffers, read window 4096 tokens (256 pages), 1 sink page" in out
    assert "mamba: RECURRENT, 28 layers, 56 buffers, one state row per request" in out
    assert has_row(out, "L28.V swa.host 98304 32768 28 V swa 8x256B HND INDEXED 4096 1")


@pytest.mark.unit
def test_show_reads_msgpack(capsys, tmp_path):
    path = tmp_path / "jamba.msgpack"
    path.write_bytes(load(JAMBA).encode())
    code, out, _ = run(capsys, "layout", "show", str(path))
    assert code == 0 and load(JAMBA).layout_id in out


# ----------------------------------------------------------- layout check
@pytest.mark.unit
def test_check_identical_layouts(capsys):
    code, out, err = run(capsys, "layout", "check", LLAMA, LLAMA)
    assert code == 0 and err == ""
    assert out.strip()  # the plan summary


@pytest.mark.unit
def test_check_names_the_mismatch(capsys, llama_fp16):
    code, out, err = run(capsys, "layout", "check", LLAMA, llama_fp16)
    assert code == 1 and err == ""
    assert out.startswith(f"mismatch: {LLAMA} (local) cannot exchange pages with {llama_fp16} (remote)")
    assert "dtype" in out and "bfloat16" in out and "float16" in out


@pytest.mark.system
def test_console_script(llama_fp16):
    script = Path(sys.executable).with_name("kvlend")
    assert script.exists(), f"{script}: run scripts/setup to install the console script"
    show = subprocess.run([str(script), "layout", "show", JAMBA], capture_output=True, text=True, timeout=60)
    assert show.returncode == 0 and load(JAMBA).layout_id in show.stdout
    check = subprocess.run([str(script), "layout", "check", LLAMA, llama_fp16], capture_output=True, text=True,
                           timeout=60)
    assert check.returncode == 1 and "dtype" in check.stdout, check.stderr


# ----------------------------------------------------------------- errors
def write(tmp_path, name: str, data) -> str:
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(path)


@pytest.mark.unit
@pytest.mark.parametrize("name, data, message", [
    ("missing.json", None, "cannot read: No such file or directory"),
    ("bad.json", "{not json", "not valid JSON"),
    ("deep.json", "[" * 100_000, "not valid JSON"),
    ("latin1.json", b"\xff\xfe\x00", "not valid JSON"),
    ("list.json", "[]", "invalid layout: layout: expected a map, got list"),
    ("zero.json", None, "invalid layout: tokens_per_page: must be in [1, 2**63), got 0"),
    ("bad.msgpack", b"\xc1", "invalid layout: layout encoding is not valid msgpack"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, name, data, message):
    if name == "zero.json":
        data = json.dumps({**load(LLAMA).to_dict(), "tokens_per_page": 0})
    path = write(tmp_path, name, data) if data is not None else str(tmp_path / name)
    for argv in (["layout", "show", path], ["layout", "check", path, LLAMA], ["layout", "check", LLAMA, path]):
        code, out, err = run(capsys, *argv)
        assert code == 2 and out == ""
        assert err.count("\n") == 1 and err.startswith(f"kvlend: error: {path}: ")
        assert message in err and "Traceback" not in err


@pytest.mark.unit
@pytest.mark.parametrize("argv", [["--debug", "layout", "show"], ["layout", "show", "--debug"]])
def test_debug_adds_the_traceback(capsys, tmp_path, argv):
    code, _, err = run(capsys, *argv, str(tmp_path / "missing.json"))
    assert code == 2
    assert "Traceback" in err and "CliError" in err
    assert err.splitlines()[-1].startswith("kvlend: error: ")


@pytest.mark.unit
@pytest.mark.parametrize("argv", [[], ["layout"], ["frobnicate"], ["layout", "show"], ["layout", "check", LLAMA],
                                  ["layout", "show", LLAMA, "extra"]])
def test_usage_errors_exit_2(capsys, argv):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert "usage: kvlend" in err


@pytest.mark.unit
def test_help_exits_0(capsys):
    code, out, _ = run(capsys, "layout", "--help")
    assert code == 0 and "show" in out and "check" in out


@pytest.mark.unit
def test_commands_are_a_table(capsys, monkeypatch):
    assert [c.path for c in cli.COMMANDS] == [("layout", "show"), ("layout", "check"), ("demo",), ("bench",),
                                              ("certs", "ca"), ("certs", "issue"), ("certs", "check"),
                                              ("cluster", "status")]
    seen = []

    def add(parser):
        parser.add_argument("--n", type=int, default=1)

    def demo(args):
        seen.append(args.n)
        return 7

    monkeypatch.setattr(cli, "COMMANDS", cli.COMMANDS + (cli.Command(("extra",), "an extra", add, demo),))
    assert cli.main(["extra", "--n", "3"]) == 7 and seen == [3]
    assert cli.main(["layout", "show", LLAMA]) == 0
    capsys.readouterr()


# ------------------------------------------------------------------- demo
SAMPLE_REPORT = {
    "requests": 64, "tokens": 21128, "bytes": 88539136, "bytes_full": 88539136, "gbps": 0.3,
    "latency_ms_p50": 6.6, "latency_ms_p99": 80.9, "descriptors_per_request": 54.4, "handshake_ms": 11.0,
    "model": "llama", "tokens_per_page": [16, 16], "decode_tp": 1, "plan": "identity", "prefills": 2,
    "prefill_requests": [32, 32], "inflight": 16, "max_inflight": 12, "verified": True, "mismatched": [],
    "prefill_exits": [0, 0], "prefill_exit": 0, "wall_s": 7.2,
}


def demo_args(*argv: str):
    return cli.build_parser().parse_args(["demo", *argv])


@pytest.mark.unit
def test_demo_options_default_to_two_prefills_and_16_in_flight():
    args = demo_args()
    assert (args.prefills, args.inflight) == (2, 16)
    args = demo_args("--prefills", "3", "--inflight", "5", "--decode-tp", "2", "--model", "hybrid")
    assert (args.prefills, args.inflight, args.decode_tp, args.model) == (3, 5, 2, "hybrid")


@pytest.mark.unit
def test_demo_launches_every_prefill_rank_and_one_decode_connected_to_all():
    args = demo_args("--prefills", "3", "--inflight", "5", "--requests", "9")
    for rank in range(3):
        argv = pair.prefill_argv(args, rank)
        assert argv[1:3] == ["-m", "kvlend.demo.prefill"]
        flags = dict(zip(argv[3::2], argv[4::2]))
        assert flags["--prefills"] == "3" and flags["--rank"] == str(rank) and flags["--requests"] == "9"
        assert int(flags["--max-inflight"]) >= 5  # each rank lends enough ahead to fill the decode's window
    argv = pair.decode_argv(args, ["127.0.0.1:1001", "127.0.0.1:1002", "127.0.0.1:1003"], "/tmp/report.json")
    assert argv[1:3] == ["-m", "kvlend.demo.decode"]
    connect = [argv[i + 1] for i, a in enumerate(argv) if a == "--connect"]
    assert connect == ["127.0.0.1:1001", "127.0.0.1:1002", "127.0.0.1:1003"]
    assert argv[argv.index("--inflight") + 1] == "5"


@pytest.mark.unit
def test_demo_issues_every_rank_its_own_certificate_and_writes_no_ca_key(tmp_path, monkeypatch):
    prefills, decode_env = pair.rank_envs(demo_args("--prefills", "2", "--decode-tp", "2"), str(tmp_path))
    assert [Credentials.from_env(env).identity for env in prefills] == ["prefill-0", "prefill-1"]
    for name, value in decode_env.items():
        monkeypatch.setenv(name, value)
    assert [c.identity for c in decode.rank_credentials(2)] == ["decode-tp0", "decode-tp1"]
    assert [c.identity for c in decode.rank_credentials(1)] == ["decode-tp0"]
    monkeypatch.setenv(CERT_ENV, str(tmp_path / "decode-tp0.pem"))  # one certificate for two ranks
    with pytest.raises(ConfigError, match="2 ranks share this environment"):
        decode.rank_credentials(2)
    assert sorted(os.listdir(tmp_path)) == ["ca.pem", "decode-tp0.key", "decode-tp0.pem", "decode-tp1.key",
                                            "decode-tp1.pem", "prefill-0.key", "prefill-0.pem", "prefill-1.key",
                                            "prefill-1.pem"]
    assert all(stat.S_IMODE(os.stat(tmp_path / f).st_mode) == 0o600 for f in os.listdir(tmp_path) if f.endswith(".key"))
    assert {env[CA_ENV] for env in (*prefills, decode_env)} == {str(tmp_path / "ca.pem")}
    assert {CA_ENV, CERT_ENV, KEY_ENV} == set(decode_env)


@pytest.mark.unit
@pytest.mark.parametrize("argv, message", [
    (["--inflight", "0"], "--inflight: must be >= 1, got 0"),
    (["--prefills", "0"], "--prefills: must be >= 1, got 0"),
    (["--requests", "2", "--prefills", "3"], "--prefills: 3 prefill ranks for 2 requests"),
    (["--metrics-port", "65534"], "--metrics-port: 65534 + 2 prefill ranks passes port 65535"),
])
def test_demo_refuses_bad_concurrency_options_before_starting_a_rank(capsys, argv, message):
    assert cli.main(["demo", *argv]) == cli.EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and message in err, err


@pytest.mark.unit
def test_demo_text_report_says_how_many_were_in_flight():
    text = pair.format_report(SAMPLE_REPORT)
    lines = [line.strip() for line in text.splitlines()]
    assert "in flight             16 (max seen 12) from 2 prefill ranks" in lines
    assert "requests              64 (32 + 32 from 2 prefill ranks)" in lines
    assert lines[-1] == "verified              yes"
    one = pair.format_report({**SAMPLE_REPORT, "prefills": 1, "prefill_requests": [64], "inflight": 1,
                              "max_inflight": 1, "verified": False, "mismatched": ["req-3"]})
    assert "in flight             1 (max seen 1) from 1 prefill rank" in one
    assert one.splitlines()[-1].strip() == "verified              NO: req-3"


# ---------------------------------------------------------------- cluster
@pytest.mark.system
def test_cluster_status_lists_the_live_ranks_from_a_real_etcd(capsys, monkeypatch, tmp_path):
    from kvlend.cluster import RankRecord
    from kvlend.cluster.etcd_members import EtcdMembers
    from kvlend.cluster.registry import Registry
    from kvlend.security.certs import save_rank
    from tests.support.certs import CA, creds

    layout = load(LLAMA)
    rank_creds = creds("prefill-7", "prefill")
    with (EtcdMembers(1, authority=CA) as etcd,
          Registry(etcd.endpoints, "/kvlend/cli-test", cluster_ca=CA.cert_pem, etcd_credentials=rank_creds, ttl=2,
                   timeout=1) as rank):
        rank.publish(RankRecord("prefill-7", "prefill", "10.1.2.3", 4100, layout.encode(), capacity=8, load=3),
                     rank_creds)
        assert rank.wait_for(lambda view: view.get("prefill-7") is not None, 10)
        files = save_rank(creds("status-tool", "router"), str(tmp_path / "tool"))  # reads and checks records
        for name, value in {**files, "KVLEND_ETCD_CA": files["KVLEND_CA"], "KVLEND_ETCD_CERT": files["KVLEND_CERT"],
                            "KVLEND_ETCD_KEY": files["KVLEND_KEY"]}.items():
            monkeypatch.setenv(name, value)
        code, out, err = run(capsys, "cluster", "status", "--etcd", etcd.endpoints[0], "--prefix", "/kvlend/cli-test")
        assert code == 0, err
        assert "1 live ranks" in out and has_row(
            out, f"prefill-7 prefill 10.1.2.3:4100 {layout.layout_id[:16]} 0/1 0/1 3/8 ok")
        code, out, _ = run(capsys, "cluster", "status", "--etcd", etcd.endpoints[0], "--prefix", "/kvlend/cli-test",
                           "--json")
        assert code == 0 and [r["identity"] for r in json.loads(out)["ranks"]] == ["prefill-7"]


@pytest.mark.unit
def test_cluster_status_without_etcd_is_one_line_and_exit_2(capsys, monkeypatch, tmp_path):
    import socket

    from tests.support.certs import CA

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("KVLEND_CA", str(tmp_path / "ca.pem"))
    (tmp_path / "ca.pem").write_bytes(CA.cert_pem)
    code, out, err = run(capsys, "cluster", "status", "--etcd", f"127.0.0.1:{port}", "--timeout", "1")
    assert code == 2 and out == "" and f"etcd at 127.0.0.1:{port} did not answer within 1 s" in err
    assert len(err.strip().splitlines()) == 1
