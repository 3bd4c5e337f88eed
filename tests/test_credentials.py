"""Rank credentials: issuing, saving, loading and the checks a rank makes on its own files at start.

``kvlend certs`` is tested through ``cli.main`` as a user runs it: create a
CA, issue rank certificates, load them from the environment it prints.
"""

from __future__ import annotations

import datetime
import os
import stat

import pytest

from kvlend import cli
from kvlend.errors import AuthError, ConfigError
from kvlend.security.certs import Authority, check_identity, save_rank
from kvlend.security.credentials import CA_ENV, CERT_ENV, KEY_ENV, Credentials
from tests.support.certs import CA, creds

pytestmark = pytest.mark.unit


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def test_an_issued_certificate_names_its_identity_and_passes_its_own_checks():
    c = CA.issue("prefill-0", "prefill", days=2)
    assert c.identity == "prefill-0" and repr(c).startswith("Credentials('prefill-0'")
    assert datetime.timedelta(days=1) < c.expires - _now() <= datetime.timedelta(days=2)
    c.check()
    assert "PRIVATE" not in repr(c)


@pytest.mark.parametrize("identity", ["", "-lead", "a b", "x" * 65, "naïve", "a/b", None, 7])
def test_identities_are_short_plain_names(identity):
    with pytest.raises(ConfigError, match="rank identity"):
        check_identity(identity)
    with pytest.raises(ConfigError, match="rank identity"):
        CA.issue(identity, "decode")


def test_a_rank_refuses_its_own_bad_credentials_at_start():
    other = Authority.create("other")
    stranger = other.issue("decode", "decode")
    with pytest.raises(AuthError, match="not issued by the CA"):
        Credentials(CA.cert_pem, stranger.cert_pem, stranger.key_pem).check()
    with pytest.raises(AuthError, match="valid from"):
        CA.issue("late", "decode", days=1, valid_from=_now() - datetime.timedelta(days=5)).check()
    with pytest.raises(AuthError, match="valid from"):
        CA.issue("early", "decode", days=9, valid_from=_now() + datetime.timedelta(days=2)).check()
    mine, theirs = creds("prefill", "prefill"), creds("decode", "decode")
    with pytest.raises(AuthError, match="key does not match"):
        Credentials(mine.ca_pem, mine.cert_pem, theirs.key_pem).check()
    with pytest.raises(ConfigError, match="not a valid PEM certificate"):
        Credentials(mine.ca_pem, b"-----BEGIN CERTIFICATE-----\nnope\n", mine.key_pem)


def test_saved_credentials_load_from_the_environment_and_never_overwrite(tmp_path):
    directory = str(tmp_path / "ranks")
    env = save_rank(creds("decode-1", "decode"), directory)
    assert set(env) == {CA_ENV, CERT_ENV, KEY_ENV}
    assert stat.S_IMODE(os.stat(env[KEY_ENV]).st_mode) == 0o600
    loaded = Credentials.from_env(env)
    assert loaded.identity == "decode-1" and loaded.cert_pem == creds("decode-1", "decode").cert_pem
    with pytest.raises(ConfigError, match="exists"):
        save_rank(creds("decode-1", "decode"), directory)
    with pytest.raises(ConfigError, match="another CA"):
        save_rank(Authority.create().issue("decode-2", "decode"), directory)
    assert not os.path.exists(os.path.join(directory, "decode-2.pem"))
    with pytest.raises(ConfigError, match=r"\$KVLEND_CERT, \$KVLEND_KEY"):
        Credentials.from_env({CA_ENV: env[CA_ENV]})
    with pytest.raises(ConfigError, match="cannot read"):
        Credentials.from_env({**env, KEY_ENV: str(tmp_path / "missing.key")})


def test_kvlend_certs_creates_a_ca_and_issues_loadable_rank_certificates(tmp_path, capsys, monkeypatch):
    ca_dir, out = str(tmp_path / "ca"), str(tmp_path / "rank")
    assert cli.main(["certs", "ca", "--dir", ca_dir, "--days", "30"]) == 0
    assert stat.S_IMODE(os.stat(os.path.join(ca_dir, "ca.key")).st_mode) == 0o600
    capsys.readouterr()
    issue = ["certs", "issue", "prefill-3", "--role", "prefill", "--ca", ca_dir, "--out", out]
    assert cli.main([*issue, "--days", "7"]) == 0
    exports = dict(line.removeprefix("export ").split("=", 1) for line in capsys.readouterr().out.splitlines()
                   if line.startswith("export "))
    assert set(exports) == {CA_ENV, CERT_ENV, KEY_ENV}
    assert not os.path.exists(os.path.join(out, "ca.key")), "the CA key stays with the CA"
    for name, path in exports.items():
        monkeypatch.setenv(name, path)
    assert cli.main(["certs", "check"]) == 0
    assert capsys.readouterr().out.startswith("prefill-3 (prefill): certificate issued by the CA")
    assert Credentials.from_env().identity == "prefill-3"
    # Refusals are one line and exit 2.
    assert cli.main(issue) == cli.EXIT_USAGE
    assert "exists" in capsys.readouterr().err
    assert cli.main(["certs", "ca", "--dir", ca_dir]) == cli.EXIT_USAGE
    assert cli.main(["certs", "issue", "x", "--role", "decode", "--ca", str(tmp_path / "nowhere")]) == cli.EXIT_USAGE
    assert "cannot read" in capsys.readouterr().err
    monkeypatch.delenv(KEY_ENV)
    assert cli.main(["certs", "check"]) == cli.EXIT_USAGE
    assert "$KVLEND_KEY" in capsys.readouterr().err


def test_kvlend_certs_keeps_keys_private_whatever_the_umask_and_rank_keys_apart_from_the_ca_key(tmp_path, capsys):
    ca_dir = tmp_path / "cluster" / "ca"
    umask = os.umask(0)  # the loosest: nothing it lets through may reach a key or a directory made for one
    try:
        assert cli.main(["certs", "ca", "--dir", str(ca_dir)]) == 0
        assert cli.main(["certs", "issue", "prefill-0", "--role", "prefill", "--ca", str(ca_dir)]) == 0
        exports = dict(line.removeprefix("export ").split("=", 1) for line in capsys.readouterr().out.splitlines()
                       if line.startswith("export "))
        into_ca = ["certs", "issue", "prefill-1", "--role", "prefill", "--ca", str(ca_dir), "--out", str(ca_dir)]
        assert cli.main(into_ca) == cli.EXIT_USAGE
        assert "holds the CA's key" in capsys.readouterr().err
    finally:
        os.umask(umask)
    ranks = ca_dir / "ranks"

    def mode(path):
        return stat.S_IMODE(os.stat(path).st_mode)

    assert [mode(d) for d in (tmp_path / "cluster", ca_dir, ranks)] == [0o700] * 3
    assert mode(ca_dir / "ca.key") == mode(exports[KEY_ENV]) == 0o600
    assert exports == {CA_ENV: str(ranks / "ca.pem"), CERT_ENV: str(ranks / "prefill-0.pem"),
                       KEY_ENV: str(ranks / "prefill-0.key")}
    assert sorted(os.listdir(ranks)) == ["ca.pem", "prefill-0.key", "prefill-0.pem"], "no ca.key among the ranks'"
    assert sorted(os.listdir(ca_dir)) == ["ca.key", "ca.pem", "ranks"]
    assert Credentials.from_env(exports).identity == "prefill-0"


def test_credentials_loaded_from_files_reload_from_them(tmp_path):
    env = save_rank(CA.issue("decode-renewing", "decode", days=1), str(tmp_path))
    first = Credentials.from_env(env)
    assert first.reload() == first  # the same files, read again
    renewed = CA.issue("decode-renewing", "decode", days=30)
    for name, data in ((CERT_ENV, renewed.cert_pem), (KEY_ENV, renewed.key_pem)):
        (tmp_path / "next").write_bytes(data)
        os.replace(tmp_path / "next", env[name])
    again = first.reload()
    assert again == renewed and again.files == first.files
    with pytest.raises(ConfigError, match="not loaded from files"):
        renewed.reload()


# ------------------------------------------------------------ several ranks
@pytest.fixture
def ranked(tmp_path):
    """Certificates prefill-0 and prefill-1, and the environment naming them by ``{rank}``."""
    directory = str(tmp_path / "certs")
    for rank in (0, 1):
        save_rank(creds(f"prefill-{rank}", "prefill"), directory)
    return {CA_ENV: f"{directory}/ca.pem", CERT_ENV: f"{directory}/prefill-{{rank}}.pem",
            KEY_ENV: f"{directory}/prefill-{{rank}}.key"}


def test_ranks_sharing_an_environment_each_load_the_certificate_their_rank_names(ranked):
    assert [Credentials.from_env(ranked, rank=r, ranks=2).identity for r in (0, 1)] == ["prefill-0", "prefill-1"]
    assert Credentials.from_env(ranked).identity == "prefill-0"  # {rank} is 0 for a lone rank too


@pytest.mark.parametrize("shared", [CERT_ENV, KEY_ENV, "both"])
def test_ranks_sharing_a_certificate_or_key_are_refused_at_start(tmp_path, ranked, shared):
    single = save_rank(creds("decode", "decode"), str(tmp_path / "single"))
    env = {**ranked, **{k: single[k] for k in (CERT_ENV, KEY_ENV) if shared in (k, "both")}}
    with pytest.raises(ConfigError, match=r"2 ranks share this environment and each needs its own certificate"):
        Credentials.from_env(env, rank=1, ranks=2)
