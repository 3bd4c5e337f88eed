"""Prefill-then-decode HTTP router for disaggregated vLLM serving.

Why: with a KV connector, a request must first run on a prefill server as a
one-token request that keeps its KV (``do_remote_decode``), then on a decode
server with the ``kv_transfer_params`` the prefill returned.  This speaks the
same protocol as vLLM's toy proxy for NixlConnector, so it drives vLLM's
NixlConnector and kvlend's connector alike.  The decode always gets the
prefill's ``kv_transfer_params`` (or none), never the client's.

    python -m kvlend_vllm.router --port P --prefill URL [--prefill URL ...] --decode URL [...]
                                 [--push-params JSON]

With ``--push-params`` it drives a *push* connector instead (vLLM's
NixlPushConnector, MooncakeConnector): the request goes to the prefill and the
decode at once under one ``X-Request-Id``, which is also their ``transfer_id``;
the decode's ``kv_transfer_params`` are the given JSON (the prefill's
coordinates) plus ``do_remote_prefill`` and that id; the prefill then writes
into the blocks the decode registered.  One prefill only.

With ``--progressive`` it drives kvlend's progressive lending: it asks each
prefill once for its tickets (``template_request``), then sends each request
to a prefill and a decode at once, the prefill with lease ids the router chose
and the decode with tickets for them; the prefill lends each chunk as vLLM
computes it (chunked prefill) and the decode reads while the rest computes.
A prefill that answers no template is used in the default (serial) mode.

A request body is a JSON object of at most ``--max-body-bytes`` (32 MiB) nested at most 64 deep
(``bodies``): an oversized one is answered 413, refused before it is read whole; a malformed one
(not JSON, not an object, too deep) 400, each with a message saying why.

Each response carries ``x-kvlend-prefill-ms`` (time in the prefill call) and
``x-kvlend-prefill``/``x-kvlend-decode`` (the upstreams used), for measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import secrets
import time
import uuid
from dataclasses import replace

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvlend.core.lender import LEASE_ID_BYTES
from kvlend.errors import KvlendError
from kvlend.protocol.ticket import Ticket

from .bodies import MAX_BODY_BYTES, BodyRefused, parse_body, read_body
from .pd_requests import prefill_request, progressive_requests, push_requests, template_request
from .scheduler import TEMPLATE_KEY, TICKET_KEY

log = logging.getLogger("kvlend_vllm.router")


def build_app(prefill: list[str], decode: list[str], *, timeout_s: float = 600.0,
              connect_timeout_s: float = 10.0, push_params: dict | None = None,
              progressive: bool = False, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The router app; round-robins over the prefill and the decode URLs.  ``max_body_bytes``: the
    largest request body it reads (413 past it)."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be at least 1, got {max_body_bytes}")
    if not prefill or not decode:
        raise ValueError("need at least one prefill and one decode URL")
    if push_params is not None and len(prefill) != 1:
        raise ValueError("push mode names one prefill (its coordinates are in the push params)")
    if push_params is not None and progressive:
        raise ValueError("push mode and progressive mode exclude each other")
    prefills = itertools.cycle([u.rstrip("/") for u in prefill])
    decodes = itertools.cycle([u.rstrip("/") for u in decode])
    timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    state: dict[str, httpx.AsyncClient] = {}
    templates: dict[str, list[Ticket]] = {}  # prefill URL -> its tickets' shape (progressive mode)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        state["client"] = httpx.AsyncClient(timeout=timeout, limits=limits)
        try:
            yield
        finally:
            await state["client"].aclose()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    async def route(api: str, request: Request):
        try:
            body = parse_body(await read_body(request.headers, request.stream(), max_body_bytes))
        except BodyRefused as e:
            log.info("refused a request body (%d): %s", e.status, e.message)
            return JSONResponse({"error": {"message": e.message, "type": "invalid_request_error"}},
                                status_code=e.status)
        client = state["client"]
        rid = request.headers.get("x-request-id") or str(uuid.uuid4())
        headers = {"X-Request-Id": rid}
        if "authorization" in request.headers:
            headers["Authorization"] = request.headers["authorization"]
        p_url, d_url = next(prefills), next(decodes)
        if push_params is not None:
            return await at_once(api, *push_requests(body, push_params, rid), headers, rid, p_url, d_url)
        template = await template_of(p_url, body.get("model"), headers) if progressive else None
        if template is not None:
            leases = [secrets.token_bytes(LEASE_ID_BYTES) for _ in template]
            tickets = [replace(t, lease=lease).to_text() for t, lease in zip(template, leases)]
            p_body, d_body = progressive_requests(body, [lease.hex() for lease in leases], tickets)
            return await at_once(api, p_body, d_body, headers, rid, p_url, d_url)

        t0 = time.perf_counter()
        try:
            p = await client.post(p_url + api, json=prefill_request(body), headers=headers)
        except httpx.HTTPError as e:
            log.warning("prefill %s unreachable: %r", p_url, e)
            return JSONResponse({"error": {"message": f"prefill {p_url} unreachable: {e!r}",
                                           "type": "upstream_error"}}, status_code=502)
        prefill_ms = (time.perf_counter() - t0) * 1000
        if p.status_code != 200:
            return JSONResponse(_json_or_text(p), status_code=p.status_code)
        kv_params = _json_or_text(p).get("kv_transfer_params") or None
        if kv_params is None:
            log.warning("prefill %s returned no kv_transfer_params (rid %s)", p_url, rid)
        # Only the prefill's: a client's own kv_transfer_params (another request's ticket, say) never reach the
        # decode, which then computes what the prefill did not lend.
        d_body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        if kv_params:
            d_body["kv_transfer_params"] = kv_params
        meta = {"x-kvlend-prefill-ms": f"{prefill_ms:.1f}", "x-kvlend-prefill": p_url,
                "x-kvlend-decode": d_url, "x-request-id": rid}

        log.info("rid %s prefill %s %.1f ms -> decode %s", rid, p_url, prefill_ms, d_url)
        return await relay(api, d_body, headers, d_url, meta)

    async def template_of(p_url: str, model: str | None, headers: dict) -> list[Ticket] | None:
        """The prefill's tickets (lease ids aside), asked once; None if it answers none (not kvlend)."""
        if p_url not in templates:
            try:
                p = await state["client"].post(p_url + "/v1/completions", json=template_request(model),
                                               headers={k: v for k, v in headers.items() if k != "X-Request-Id"})
                texts = (_json_or_text(p).get("kv_transfer_params") or {}).get(TEMPLATE_KEY)
                template = [Ticket.from_text(t) for t in texts] if isinstance(texts, list) and texts else None
            except (httpx.HTTPError, KvlendError) as e:
                log.warning("prefill %s: no ticket template (%r); serial mode for it", p_url, e)
                return None
            if template is None:
                log.warning("prefill %s answered no ticket template; serial mode for it", p_url)
                return None
            templates[p_url] = template
        return templates[p_url]

    async def at_once(api: str, p_body: dict, d_body: dict, headers: dict, rid: str, p_url: str, d_url: str):
        """Prefill and decode at once: a push connector's prefill writes into the blocks the decode
        registered; kvlend's lends progressively under the leases the decode reads."""
        client = state["client"]
        meta = {"x-kvlend-prefill": p_url, "x-kvlend-decode": d_url, "x-request-id": rid}

        async def prefill_call() -> float:
            t0 = time.perf_counter()
            try:
                p = await client.post(p_url + api, json=p_body, headers=headers)
                if p.status_code != 200:
                    log.warning("prefill %s answered %d (rid %s)", p_url, p.status_code, rid)
                    templates.pop(p_url, None)  # restarted, perhaps: ask again
                elif p_url in templates and not _same_endpoints(templates[p_url], _json_or_text(p)):
                    log.warning("prefill %s lent from other endpoints than its template's: asking again", p_url)
                    templates.pop(p_url, None)
            except httpx.HTTPError as e:
                log.warning("prefill %s unreachable: %r", p_url, e)
                templates.pop(p_url, None)
            return (time.perf_counter() - t0) * 1000

        prefill = asyncio.ensure_future(prefill_call())
        response = await relay(api, d_body, headers, d_url, meta)
        meta["x-kvlend-prefill-ms"] = f"{await prefill:.1f}"
        response.headers["x-kvlend-prefill-ms"] = meta["x-kvlend-prefill-ms"]
        return response

    async def relay(api: str, d_body: dict, headers: dict, d_url: str, meta: dict):
        """The decode's answer, streamed back as it comes."""
        client = state["client"]
        try:
            d = await client.send(client.build_request("POST", d_url + api, json=d_body,
                                                       headers=headers), stream=True)
        except httpx.HTTPError as e:
            log.warning("decode %s unreachable: %r", d_url, e)
            return JSONResponse({"error": {"message": f"decode {d_url} unreachable: {e!r}",
                                           "type": "upstream_error"}}, status_code=502,
                                headers=meta)

        async def chunks():
            try:
                async for chunk in d.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:   # headers are gone: all we can do is log and end
                log.warning("decode %s broke mid-stream: %r", d_url, e)
            finally:
                await d.aclose()

        return StreamingResponse(chunks(), status_code=d.status_code, headers=meta,
                                 media_type=d.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await route("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await route("/v1/chat/completions", request)

    return app


def _same_endpoints(template: list[Ticket], answer: dict) -> bool:
    """Whether a progressive prefill's answer names the endpoints of its template (or names none)."""
    texts = (answer.get("kv_transfer_params") or {}).get(TICKET_KEY)
    if texts is None:
        return True
    try:
        tickets = [Ticket.from_text(t) for t in ([texts] if isinstance(texts, str) else texts)]
    except (KvlendError, TypeError):
        return False
    return [(t.host, t.port, t.prefill, t.layout_id) for t in tickets] == [
        (t.host, t.port, t.prefill, t.layout_id) for t in template]


def _json_or_text(r: httpx.Response) -> dict:
    try:
        out = r.json()
        return out if isinstance(out, dict) else {"response": out}
    except ValueError:
        return {"error": {"message": r.text[:2000], "type": "upstream_error"}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="prefill-then-decode router for vLLM")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", action="append", required=True, help="prefill base URL")
    ap.add_argument("--decode", action="append", required=True, help="decode base URL")
    ap.add_argument("--timeout", type=float, default=600.0, help="per upstream call, seconds")
    ap.add_argument("--push-params", type=json.loads,
                    help="push mode: the decode's kv_transfer_params (JSON), the prefill's coordinates")
    ap.add_argument("--progressive", action="store_true",
                    help="kvlend progressive lending: prefill and decode at once, the decode reading as chunks compute")
    ap.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                    help="largest request body read, bytes (larger: HTTP 413)")
    ap.add_argument("--log-level", default="info")
    a = ap.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s router %(message)s")
    import uvicorn
    app = build_app(a.prefill, a.decode, timeout_s=a.timeout, push_params=a.push_params,
                    progressive=a.progressive, max_body_bytes=a.max_body_bytes)
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, access_log=False)


if __name__ == "__main__":
    main()
