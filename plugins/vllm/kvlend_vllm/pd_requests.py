"""A client's request as the prefill and the decode engines get it, in pull, push and progressive mode.

Pure (no HTTP client): the router builds its upstream requests here, and tests check them.
"""

from __future__ import annotations

from .scheduler import LEASES_KEY, PROGRESSIVE_KEY, TEMPLATE_KEY, TICKET_KEY

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None,
                  "remote_host": None, "remote_port": None}


def prefill_request(body: dict) -> dict:
    """The prefill's version of a request: one token, not streamed, KV kept."""
    req = dict(body, stream=False, max_tokens=1, kv_transfer_params=dict(PREFILL_PARAMS))
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    req.pop("stream_options", None)
    return req


def push_requests(body: dict, push_params: dict, transfer_id: str) -> tuple[dict, dict]:
    """A push connector's prefill and decode versions of a request, sent at once under the request id
    ``transfer_id`` (NixlPushConnector pairs them by it, MooncakeConnector by the ``transfer_id`` key)."""
    p_body = prefill_request(body)
    p_body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                    "transfer_id": transfer_id}
    d_body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    d_body["kv_transfer_params"] = {**push_params, "do_remote_prefill": True, "do_remote_decode": False,
                                    "transfer_id": transfer_id, "remote_request_id": transfer_id}
    return p_body, d_body


def template_request(model: str | None) -> dict:
    """What a router asks a kvlend prefill once: a one-token request whose answer holds that engine's
    tickets (``TEMPLATE_KEY``), lending nothing; the router mints each request's tickets from them."""
    return {"model": model, "prompt": [0], "max_tokens": 1, "stream": False,
            "kv_transfer_params": {TEMPLATE_KEY: True}}


def progressive_requests(body: dict, leases: list[str], tickets: list[str]) -> tuple[dict, dict]:
    """kvlend's progressive prefill and decode versions of a request, sent at once: the prefill lends under
    the router's lease ids (hex) as its chunks compute, the decode reads the same leases by ``tickets``."""
    p_body = prefill_request(body)
    p_body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, LEASES_KEY: leases}
    d_body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    d_body["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                    TICKET_KEY: tickets, PROGRESSIVE_KEY: True}
    return p_body, d_body
