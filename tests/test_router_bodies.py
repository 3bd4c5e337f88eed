"""Issue 34, 5: kvlend's HTTP router (``kvlend_vllm.router``) refuses what it cannot serve, and keeps serving.

The real router runs as vLLM's venv runs it (a child process under uvicorn), in front of a stub upstream
in this process that answers as a prefill and a decode engine do (the router's job here is only the
client's body: no engine is needed to show it).  Each refusal is checked on the wire: an oversized body
is answered 413 while most of it is still unsent (``Content-Length``) or once the cap is passed (chunked);
a body that is not JSON, not an object, or nested too deep is answered 400; each with a message; and a
normal request routed through both legs succeeds after every one of them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvlend.ports import spare_port
from kvlend_vllm import launch
from tests.support.children import ROOT
from tests.support.nodes import wait_until

pytestmark = pytest.mark.system

CAP = 1 << 20  # the router's --max-body-bytes here: 1 MiB
DEADLINE = 60.0  # the router starting (imports fastapi), and any one answer


class Upstream(BaseHTTPRequestHandler):
    """A prefill and decode in one: answers every completion, remembering what it was sent."""

    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        Upstream.seen.append(body)
        prefill = body.get("max_tokens") == 1 and (body.get("kv_transfer_params") or {}).get("do_remote_decode")
        answer = {"choices": [{"text": "x" if prefill else "decoded"}]}
        if prefill:
            answer["kv_transfer_params"] = {"kvlend_ticket": "kvl1.stub"}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{upstream.server_address[1]}"
    port = spare_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "plugins" / "vllm"), str(ROOT),
                                                        os.environ.get("PYTHONPATH", "")])}
    log = open(tmp_path_factory.mktemp("router") / "router.log", "wb")
    proc = subprocess.Popen([launch.VLLM_VENV_PYTHON, "-m", "kvlend_vllm.router", "--port", str(port),
                             "--prefill", url, "--decode", url, "--max-body-bytes", str(CAP)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_until(lambda: proc.poll() is None and get(port, "/health")[0] == 200, "the router serving", DEADLINE)
        yield port, proc
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(DEADLINE)
        upstream.shutdown()
        log.close()


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        return exchange(port, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    except OSError:
        return 0, b""


def exchange(port: int, head: bytes, body: bytes = b"", more=None) -> tuple[int, bytes]:
    """Send ``head`` and ``body`` (then ``more()``'s chunks until the router answers); its status and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as s:
        s.sendall(head + body)
        if more is not None:
            s.setblocking(False)
            for chunk in more():
                try:
                    s.send(chunk)
                except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                    break
            s.setblocking(True)
        data = b""
        while True:
            try:
                got = s.recv(65536)
            except ConnectionResetError:
                break
            if not got:
                break
            data += got
            if b"\r\n\r\n" in data and _complete(data):
                break
    if b"\r\n\r\n" not in data:
        return 0, b""
    head, body = data.split(b"\r\n\r\n", 1)
    return int(head.split(b" ", 2)[1]), _unchunked(body) if b"transfer-encoding: chunked" in head.lower() else body


def _unchunked(body: bytes) -> bytes:
    out = b""
    while body:
        size, body = body.split(b"\r\n", 1)
        n = int(size, 16)
        if not n:
            break
        out, body = out + body[:n], body[n + 2:]
    return out


def _complete(data: bytes) -> bool:
    head, body = data.split(b"\r\n\r\n", 1)
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return body.endswith(b"0\r\n\r\n")


def post(port: int, body: bytes) -> tuple[int, bytes]:
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    return exchange(port, head, body)


def message(body: bytes) -> str:
    return json.loads(body)["error"]["message"]


def still_serves(port: int) -> None:
    Upstream.seen.clear()
    status, body = post(port, json.dumps({"model": "m", "prompt": "hello", "max_tokens": 4}).encode())
    assert status == 200 and json.loads(body)["choices"][0]["text"] == "decoded", (status, body)
    prefill, decode = Upstream.seen
    assert prefill["max_tokens"] == 1 and decode["kv_transfer_params"] == {"kvlend_ticket": "kvl1.stub"}


def test_a_declared_oversized_body_is_413_before_it_is_sent(router):
    port, proc = router
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {200 << 20}\r\nConnection: close\r\n\r\n").encode()
    status, body = exchange(port, head, b'{"prompt": "')  # 12 bytes of the 200 MB it announced
    assert status == 413 and str(CAP) in message(body) and "--max-body-bytes" in message(body)
    still_serves(port)


def test_a_chunked_body_is_413_once_past_the_cap_without_reading_the_rest(router):
    port, proc = router
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    sent = []

    def chunks():
        piece = b"x" * 65536
        for _ in range(200 << 20 >> 16):  # up to 200 MB, while the router still reads
            sent.append(len(piece))
            yield b"%x\r\n%s\r\n" % (len(piece), piece)

    status, body = exchange(port, head, b"", chunks)
    assert status == 413 and str(CAP) in message(body)
    assert sum(sent) < 200 << 20  # it stopped reading: the rest was never taken
    still_serves(port)


@pytest.mark.parametrize("raw, says", [
    (b"not json at all", "not JSON"),
    (b'{"prompt": "unterminated', "not JSON"),
    (b"\xff\xfe{}", "not JSON"),
    (b"[1, 2, 3]", "JSON object"),
    (b'"a string"', "JSON object"),
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper"),
    (b'{"a": ' * 100_000 + b"1" + b"}" * 100_000, "nested deeper"),
    (b'{"prompt": "x", "extra": ' + b"[" * 100 + b"]" * 100 + b"}", "nested deeper"),  # under Python's limit
], ids=["text", "truncated", "not-utf8", "list", "string", "deep-list", "deep-object", "deep-100"])
def test_a_malformed_body_is_400_with_a_message_and_the_router_keeps_serving(router, raw, says):
    port, proc = router
    status, body = post(port, raw)
    assert status == 400 and says in message(body), (status, body[:300])
    still_serves(port)
    assert proc.poll() is None
