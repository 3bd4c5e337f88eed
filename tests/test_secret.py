"""The pair's shared secret: generated fresh, loaded from ``$KVLEND_SECRET`` (hex) or ``$KVLEND_SECRET_FILE``."""

import pytest

from kvlend.errors import AuthError, KvlendError
from kvlend.runtime.secret import SECRET_ENV, SECRET_FILE_ENV, generate_secret, load_secret

SECRET = bytes(range(32))
WRONG = bytes(range(1, 33))


def test_the_variable_names():
    assert (SECRET_ENV, SECRET_FILE_ENV) == ("KVLEND_SECRET", "KVLEND_SECRET_FILE")


def test_generate_secret_is_fresh_and_loadable():
    a, b = generate_secret(), generate_secret()
    assert isinstance(a, bytes) and len(a) == 32 and a != b
    assert load_secret({SECRET_ENV: a.hex()}) == a


def test_load_secret_from_hex_env():
    assert load_secret({SECRET_ENV: SECRET.hex()}) == SECRET
    assert load_secret({SECRET_ENV: SECRET.hex().upper()}) == SECRET


def test_load_secret_env_wins_over_file(tmp_path):
    path = tmp_path / "secret"
    path.write_text(WRONG.hex())
    assert load_secret({SECRET_ENV: SECRET.hex(), SECRET_FILE_ENV: str(path)}) == SECRET


def test_an_empty_env_falls_back_to_the_file(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET.hex())
    assert load_secret({SECRET_ENV: "", SECRET_FILE_ENV: str(path)}) == SECRET


def test_load_secret_from_hex_file_with_newline(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET.hex() + "\n")
    assert load_secret({SECRET_FILE_ENV: str(path)}) == SECRET


def test_load_secret_from_raw_file(tmp_path):
    raw = b"\xfe\x00not hex at all\x80\x81" + bytes(range(100, 120))
    path = tmp_path / "secret.bin"
    path.write_bytes(raw)
    assert load_secret({SECRET_FILE_ENV: str(path)}) == raw


@pytest.mark.parametrize("environ, needle", [
    ({}, "no shared secret"),
    ({SECRET_ENV: ""}, "no shared secret"),
    ({SECRET_ENV: "", SECRET_FILE_ENV: ""}, "no shared secret"),
    ({SECRET_ENV: "zz" * 32}, "must be hex"),
    ({SECRET_ENV: "abc"}, "must be hex"),
    ({SECRET_ENV: "ab" * 15}, "at least 16 bytes"),
    ({SECRET_FILE_ENV: "/nonexistent/kvlend-secret"}, "/nonexistent/kvlend-secret"),
], ids=["nothing", "empty-env", "both-empty", "not-hex", "odd-hex", "short-hex", "missing-file"])
def test_load_secret_refusals(environ, needle):
    with pytest.raises(AuthError, match=needle) as info:
        load_secret(environ)
    assert isinstance(info.value, KvlendError)


def test_load_secret_refuses_a_short_file(tmp_path):
    path = tmp_path / "short"
    path.write_text("ab" * 15)
    with pytest.raises(AuthError, match="at least 16"):
        load_secret({SECRET_FILE_ENV: str(path)})
    path.write_bytes(b"short raw")
    with pytest.raises(AuthError, match="at least 16"):
        load_secret({SECRET_FILE_ENV: str(path)})


def test_load_secret_refuses_an_unreadable_file(tmp_path):
    with pytest.raises(AuthError, match="cannot read"):
        load_secret({SECRET_FILE_ENV: str(tmp_path)})  # a directory


def test_load_secret_reads_the_process_environment(monkeypatch):
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv(SECRET_ENV, SECRET.hex())
    assert load_secret() == SECRET


def test_load_secret_reads_the_file_named_in_the_process_environment(monkeypatch, tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET.hex())
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    assert load_secret() == SECRET
