"""The docs stay true: docs/reference.md is what the code generates, links resolve, commands exist."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest

from kvlend import cli, docs_reference

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md"),
                *(ROOT / "plugins").glob("*/README.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A repository path in backticks, e.g. `scripts/demo --json` or `examples/engine_integration.py`.
REPO_PATH = re.compile(r"`(?:\.venv/bin/python |python )?((?:scripts|examples|kvlend|plugins|tests|docs)/[\w./-]+)")


@pytest.fixture(scope="module")
def rendered() -> str:
    return docs_reference.render()  # imports every entry point: once


def test_the_reference_is_what_the_code_generates(rendered):
    assert (ROOT / "docs" / "reference.md").read_text() == rendered, \
        "docs/reference.md is out of date: run python -m kvlend.docs_reference"


def test_design_md_shows_the_sessions_tables_as_the_code_has_them():
    from kvlend.protocol import states

    design = (ROOT / "docs" / "design.md").read_text()
    assert design == docs_reference.with_state_tables(design), \
        "docs/design.md's state tables are out of date: run python -m kvlend.docs_reference"
    assert states.markdown().strip() in design


def test_the_check_mode_says_so(capsys, tmp_path, monkeypatch, rendered):
    monkeypatch.setattr(docs_reference, "render", lambda: rendered)
    assert docs_reference.main(["--check"]) == 0
    stale = tmp_path / "reference.md"
    stale.write_text("# Reference\n")
    monkeypatch.setattr(docs_reference, "OUTPUT", stale)
    monkeypatch.setattr(docs_reference, "ROOT", tmp_path)
    assert docs_reference.main(["--check"]) == 1
    assert "out of date" in capsys.readouterr().err


def test_the_scan_finds_what_we_know_is_read():
    names = set(docs_reference.environment_reads())
    assert {"KVLEND_CA", "KVLEND_CERT", "KVLEND_KEY", "KVLEND_LOG", "NIXL_LOG_LEVEL",
            "KVLEND_PYTHON", "PYTHON", "KVLEND_CHAOS_S"} <= names


def test_an_undescribed_variable_fails_the_generator(monkeypatch):
    monkeypatch.setattr(docs_reference, "ENVIRONMENT",
                        {k: v for k, v in docs_reference.ENVIRONMENT.items() if k != "KVLEND_LOG"})
    with pytest.raises(docs_reference.Undocumented, match="KVLEND_LOG"):
        docs_reference.environment_section()


def test_the_reference_has_every_option_variable_field_and_metric():
    """What the old README test demanded, now of the generated page."""
    from kvlend.metrics import SPECS
    from kvlend.protocol.config import NodeConfig, Quotas

    text = (ROOT / "docs" / "reference.md").read_text()
    stack = [("kvlend", cli.build_parser())]
    while stack:
        name, parser = stack.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend((f"{name} {sub}", child) for sub, child in action.choices.items())
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    assert f"`{option}" in text, f"reference.md lacks {name} {option}"
    for name in docs_reference.environment_reads():
        assert f"| `{name}` |" in text
    for cls in (NodeConfig, Quotas):
        for field in cls.__dataclass_fields__:
            assert f"| `{field}` |" in text
    for name in SPECS:
        assert f"| `{name}` |" in text


def test_every_option_has_help_naming_its_default():
    parser = cli.build_parser()
    formatter = cli.DefaultsFormatter("kvlend")
    stack = [parser]
    while stack:
        p = stack.pop()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
            elif action.option_strings and action.dest != "help":
                text = formatter._get_help_string(action)
                assert text, f"{p.prog} {action.option_strings[0]} has no help"
                if action.nargs != 0:  # flags default to off
                    assert "default" in text, f"{p.prog} {action.option_strings[0]}: help names no default"


def test_top_level_help_documents_exit_codes(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "exit status:" in out
    for code in (" 0 ", " 1 ", " 2 ", " 130 "):
        assert code in out


def test_readme_starts_with_the_two_commands_and_they_exist():
    block = re.search(r"```sh\n(.*?)```", README, re.S)
    assert block and README.index("```sh") < README.index("\n## "), "the two commands come first"
    commands = [line.split()[0] for line in block.group(1).splitlines() if line.strip()]
    assert commands == ["scripts/demo", "scripts/test"]
    for command in commands:
        path = ROOT / command
        assert path.is_file() and os.access(path, os.X_OK), f"{command} is not an executable file"
    assert "\nscripts/test\n" in (ROOT / ".ci" / "run").read_text(), "CI runs the README's test command"


def test_readme_stays_short():
    assert len(README.splitlines()) <= 220, "README.md is the front page: move detail into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page):
    text = page.read_text()
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
        if anchor and resolved.suffix == ".md":
            anchors = {_anchor(h) for h in re.findall(r"^#+ (.*)$", resolved.read_text(), re.M)}
            assert anchor in anchors, f"{page.relative_to(ROOT)} links to {target}: no such heading"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_in_docs_exist(page):
    missing = sorted({p.rstrip(".") for p in REPO_PATH.findall(page.read_text())
                      if not (ROOT / p.rstrip(".")).exists() and "*" not in p and "<" not in p})
    assert not missing, f"{page.relative_to(ROOT)} names files that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_point_nowhere_outside_the_project(page):
    text = page.read_text()
    for outside in ("../shared", "DESIGN.md", "/work/", "/root/", "models.md"):
        assert outside not in text, f"{page.relative_to(ROOT)} points outside the project: {outside}"


@pytest.mark.parametrize("argv, message", [
    (["demo", "--requests", "0"], "--requests: must be >= 1, got 0"),
    (["demo", "--min-len", "50", "--max-len", "10"], "--max-len: 10 is shorter than --min-len 50"),
    (["demo", "--decode-tp", "3"], "--decode-tp: 3 does not divide the model's 4 KV heads"),
    (["demo", "--decode-tokens-per-page", "5"], "neither a multiple nor a fraction of the prefill's 16"),
    (["demo", "--metrics-port", "70000"], "--metrics-port: must be in [1, 65534]"),
    (["bench", "--scenario", ","], "--scenario: name at least one scenario"),
    (["bench", "--plot", "/nonexistent-kvlend-dir/x.png"], "--plot: cannot write into /nonexistent-kvlend-dir"),
])
def test_documented_failures_are_one_line_and_exit_2(capsys, argv, message):
    """Caught before any rank or lender process starts: one line, no traceback."""
    assert cli.main(argv) == cli.EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and message in err and "Traceback" not in err


def test_an_unexpected_error_is_one_line_too(capsys, monkeypatch):
    def broken(args):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(cli, "COMMANDS", cli.COMMANDS + (cli.Command(("broken",), "fails", lambda p: None, broken),))
    assert cli.main(["broken"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err == "kvlend: error: unexpected RuntimeError: boom second line (--debug shows the traceback)\n"
    assert cli.main(["broken", "--debug"]) == cli.EXIT_USAGE
    assert "Traceback" in capsys.readouterr().err
