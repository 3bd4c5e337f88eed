"""The README documents every CLI option and every environment variable the code reads."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest

from kvlend import cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SOURCES = ("kvlend", "plugins", "examples", "scripts")

PY_READS = (
    re.compile(r"""environ\[\s*["']([A-Z][A-Z0-9_]*)["']\s*\]"""),
    re.compile(r"""environ\.get\(\s*["']([A-Z][A-Z0-9_]*)["']"""),
    re.compile(r"""getenv\(\s*["']([A-Z][A-Z0-9_]*)["']"""),
    re.compile(r"""["']([A-Z][A-Z0-9_]*)["']\s+in\s+os\.environ"""),
    re.compile(r"""^[A-Z_]*ENV\s*=\s*["']([A-Z][A-Z0-9_]*)["']""", re.M),  # CA_ENV = "KVLEND_CA"
)
SHELL_READS = re.compile(r"\$\{([A-Z][A-Z0-9_]*)(?::?-[^}]*)?\}")


def source_files() -> list[Path]:
    files = []
    for top in SOURCES:
        for path in (ROOT / top).rglob("*"):
            if path.is_file() and "egg-info" not in str(path) and "__pycache__" not in path.parts \
                    and (path.suffix == ".py" or path.parent.name == "scripts"):
                files.append(path)
    return files


def env_vars_read() -> set[str]:
    names = set()
    for path in source_files():
        text = path.read_text(errors="replace")
        for pattern in PY_READS:
            names.update(pattern.findall(text))
        if text.startswith("#!") and "bash" in text.splitlines()[0]:
            names.update(SHELL_READS.findall(text))
    return names


def option_strings() -> set[tuple[str, str]]:
    """(command, option) for every option of every (sub)command."""
    found = set()

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    walk(child, f"{name} {sub}")
            else:
                found.update((name, opt) for opt in action.option_strings if opt.startswith("--"))

    walk(cli.build_parser(), "kvlend")
    return found


def test_the_scan_finds_what_we_know_is_read():
    names = env_vars_read()
    assert {"KVLEND_CA", "KVLEND_CERT", "KVLEND_KEY", "KVLEND_LOG", "KVLEND_EXAMPLES", "NIXL_LOG_LEVEL",
            "KVLEND_PYTHON", "PYTHON"} <= names


@pytest.mark.parametrize("name", sorted(env_vars_read()))
def test_every_environment_variable_is_in_the_readme(name):
    assert f"`{name}`" in README, f"README.md does not document ${name}"


def test_every_cli_option_is_in_the_readme():
    options = option_strings()
    commands = {command for command, _ in options}
    assert {"kvlend", "kvlend demo", "kvlend bench", "kvlend layout show", "kvlend layout check",
            "kvlend certs ca", "kvlend certs issue", "kvlend certs check"} <= commands
    assert {("kvlend demo", "--metrics-port"), ("kvlend demo", "--decode-tp"), ("kvlend bench", "--plot")} <= options
    missing = sorted((c, o) for c, o in options if o != "--help" and not re.search(rf"`{re.escape(o)}[` ]", README))
    assert not missing, f"README.md does not document {missing}"


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
    assert block and README.index("```sh") < README.index("##"), "the two commands come first"
    commands = [line.split()[0] for line in block.group(1).splitlines() if line.strip()]
    assert commands == ["scripts/demo", "scripts/test"]
    for command in commands:
        path = ROOT / command
        assert path.is_file() and os.access(path, os.X_OK), f"{command} is not an executable file"


def test_readme_documents_every_metric():
    from kvlend.metrics import SPECS

    for name in SPECS:
        assert f"`{name}" in README, f"README.md does not list metric {name}"


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
