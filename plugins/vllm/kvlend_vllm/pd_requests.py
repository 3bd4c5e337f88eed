"""A client's request as the prefill and the decode engines get it, in pull and push mode.

Pure (no HTTP client): the router builds its upstream requests here, and tests check them.
"""

from __future__ import annotations

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
