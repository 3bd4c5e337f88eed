"""The prefill's small HTTPS API, both ends: ``POST /prefill`` lends one request's pages under a ticket."""

from __future__ import annotations

import http.client
import http.server
import json
import ssl
import sys
from typing import TYPE_CHECKING

from kvlend.errors import KvlendError

from .watch import say

if TYPE_CHECKING:
    from .prefill import Lending

MAX_BODY = 4096


class Api(http.server.BaseHTTPRequestHandler):
    """``POST /prefill``: one request's pages, lent under a ticket.  Mutual TLS: cluster ranks only."""

    timeout = 10  # seconds a connection may stall (handshake included)
    server: ApiServer

    def setup(self) -> None:
        super().setup()
        self.request.do_handshake()  # here, on this connection's thread, not in the accept loop

    def do_POST(self) -> None:
        if self.path != "/prefill":
            return self._answer(404, {"error": f"no {self.path}: POST /prefill"})
        try:
            length = int(self.headers.get("Content-Length", "0"))
            if not 0 < length <= MAX_BODY:
                raise ValueError(f"body of {length} bytes, expected 1..{MAX_BODY}")
            body = json.loads(self.rfile.read(length))
            request, tokens = body["request"], body["tokens"]
            if not isinstance(request, str) or not 0 < len(request) <= 200:
                raise ValueError("request: expected an id of 1..200 characters")
            if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 < tokens <= 1 << 20:
                raise ValueError("tokens: expected an int in [1, 2**20]")
        except (ValueError, KeyError, TypeError) as exc:
            return self._answer(400, {"error": f"bad request: {exc}"})
        try:
            answer = self.server.lending.lend(request, tokens)
        except KvlendError as exc:
            return self._answer(500, {"error": f"{type(exc).__name__}: {exc}"})
        if answer is None:
            return self._answer(503, {"error": "no free pages"})
        self._answer(200, answer)

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args) -> None:  # noqa: A002 -- the base class's name
        pass


class ApiServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, lending: Lending, context: ssl.SSLContext) -> None:
        super().__init__(address, Api)
        self.lending = lending
        self.socket = context.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def handle_error(self, request, client_address) -> None:
        exc = sys.exc_info()[1]
        say(f"API {client_address[0]}: {type(exc).__name__}: {exc}")


class ApiError(Exception):
    """The prefill's API answered something other than 200."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:200]}")
        self.status = status


def post_prefill(api: str, context: ssl.SSLContext, request: str, tokens: int, timeout: float) -> dict:
    host, port = api.rsplit(":", 1)
    conn = http.client.HTTPSConnection(host, int(port), context=context, timeout=timeout)
    try:
        conn.request("POST", "/prefill", json.dumps({"request": request, "tokens": tokens}),
                     {"Content-Type": "application/json"})
        reply = conn.getresponse()
        text = reply.read(MAX_BODY).decode("utf-8", "replace")
        if reply.status != 200:
            raise ApiError(reply.status, text)
        return json.loads(text)
    finally:
        conn.close()
