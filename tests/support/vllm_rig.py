"""Real vLLM servers for the end-to-end tests: start, query, kill, by process group.

Servers run from ``.venv-vllm`` (``scripts/vllm-setup``); this module needs
only the standard library, ``kvlend_vllm.launch`` and kvlend's certificate
authority, so it runs under the project's own venv.  Requests go through plain HTTP with token-id prompts,
so outputs are compared token for token with no tokenizer in between.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from kvlend.cluster.etcd_members import EtcdMembers
from kvlend.ports import spare_port
from kvlend.security.certs import Authority, save_rank
from kvlend_vllm import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOOT_S = 300  # one engine boots in 15-25 s on a quiet 2-core box, minutes on a busy one


class Rig:
    """Every server started through it, stopped (by group) on ``close``.

    Its servers form one throwaway cluster: each engine with a connector gets a certificate
    for its own name (two decodes, say, are two identities to the prefill they share).
    """

    def __init__(self, model: str, logs: str) -> None:
        self.model, self.logs = model, logs
        self.servers: list[launch.Server] = []
        self._authority = Authority.create()
        self._certs = os.path.join(logs, "certs")
        self._etcd: list[EtcdMembers] = []
        self._tool: dict[str, str] | None = None

    def etcd(self) -> EtcdMembers:
        """An etcd member run from this cluster's CA (TLS, client certificates required): the engines reach
        it with their own certificates, ``tool_env`` gives ``kvlend cluster status`` a router's."""
        members = EtcdMembers(1, authority=self._authority)
        self._etcd.append(members)
        return members

    def tool_env(self) -> dict[str, str]:
        """The environment of a command that reads the registry: a router certificate, for etcd and records."""
        if self._tool is None:
            self._tool = save_rank(self._authority.issue("rig-tool", "router"), os.path.join(self._certs, "tool"))
        files = self._tool
        return {**files, "KVLEND_ETCD_CA": files["KVLEND_CA"], "KVLEND_ETCD_CERT": files["KVLEND_CERT"],
                "KVLEND_ETCD_KEY": files["KVLEND_KEY"]}

    def engine(self, name: str, config: dict | None = None, *, extra=(), env=None,
               dtype: str = "bfloat16", prefix_caching: bool = True, tp: int = 1) -> launch.Server:
        """A ``vllm serve``; with ``tp`` > 1 its workers are ``name-0`` ... (``{rank}`` in the cert paths)."""
        port = spare_port()
        parallel = ["--tensor-parallel-size", str(tp)] if tp > 1 else []
        argv = launch.vllm_serve_argv(self.model, port, kv_transfer_config=config, max_model_len=2048,
                                      dtype=dtype, prefix_caching=prefix_caching, extra=[*parallel, *extra])
        tls = {}
        if config and tp == 1:
            tls = save_rank(self._authority.issue(name, launch.role_of(config)), self._certs)
        elif config:
            for rank in range(tp):
                tls = save_rank(self._authority.issue(f"{name}-{rank}", launch.role_of(config)), self._certs)
            tls = {k: v.replace(f"{name}-{tp - 1}.", f"{name}-{{rank}}.") for k, v in tls.items()}
        return self._start(name, port, argv, launch.vllm_env(1, {**tls, **(env or {})}))

    def router(self, name: str, prefill: launch.Server, decode: launch.Server, *,
               progressive: bool = False) -> launch.Server:
        port = spare_port()
        argv = [launch.VLLM_VENV_PYTHON, "-m", "kvlend_vllm.router", "--port", str(port),
                "--prefill", prefill.url, "--decode", decode.url, "--timeout", "120",
                *(["--progressive"] if progressive else [])]
        return self._start(name, port, argv, dict(os.environ), ready=("/health",))

    def vllm_router(self, name: str, prefills, decodes, policy: str = "round_robin") -> launch.Server:
        """vLLM's own P/D router (``vllm-router``, Rust) in front of running engines: it passes the
        prefill's ``kv_transfer_params`` to the decode unchanged, so kvlend's tickets ride it.  Health
        checks every second take a dead worker out of rotation quickly."""
        port = spare_port()
        argv = [os.path.join(os.path.dirname(launch.VLLM_VENV_PYTHON), "vllm-router"), "--host", "127.0.0.1",
                "--port", str(port), "--vllm-pd-disaggregation", "--policy", policy,
                "--prometheus-port", str(spare_port()), "--request-timeout-secs", "120",
                "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                "--worker-startup-timeout-secs", "60"]
        for server in prefills:
            argv += ["--prefill", server.url]
        for server in decodes:
            argv += ["--decode", server.url]
        return self._start(name, port, argv, dict(os.environ), ready=("/health",))

    def _start(self, name, port, argv, env, ready=("/health", "/v1/models")) -> launch.Server:
        server = launch.Server(name, f"http://127.0.0.1:{port}", ready)
        server.start(argv, env, os.path.join(self.logs, f"{name}.log"))
        self.servers.append(server)
        return server

    def wait(self, *servers: launch.Server, timeout: float = BOOT_S) -> None:
        deadline = time.monotonic() + timeout
        for server in servers:
            server.wait_ready(max(1.0, deadline - time.monotonic()))

    def kill(self, server: launch.Server) -> None:
        """SIGKILL the whole server (API server, EngineCore, worker) at once."""
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.stop(5.0)
        self.servers.remove(server)

    def stop(self, server: launch.Server) -> None:
        server.stop()
        self.servers.remove(server)

    def close(self) -> None:
        for server in reversed(self.servers):
            server.stop()
        self.servers.clear()
        for members in self._etcd:
            members.close()
        self._etcd.clear()


def post(url: str, body: dict, timeout: float = 120.0) -> dict:
    """POST JSON; the parsed answer, or ``{"error": ..., "status": ...}`` for an HTTP error."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return {"error": exc.read().decode(errors="replace")[:500], "status": exc.code}
    except (urllib.error.URLError, OSError) as exc:
        return {"error": repr(exc), "status": None}


def completion(model: str, prompt: list[int], max_tokens: int, **kw) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **kw}


def generate(server: launch.Server, model: str, prompts, max_tokens: int, *, concurrency: int = 4,
             timeout: float = 120.0) -> list[dict]:
    """Each prompt's answer: ``{"tokens": [...], "finish": ...}`` or ``{"error": ...}``."""
    def one(prompt):
        return _tokens(post(server.url + "/v1/completions", completion(model, prompt, max_tokens), timeout))
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


def plain_answers(model: str, prompts, max_tokens: int, logs: str, **engine) -> list[dict]:
    """A plain server's greedy answers to ``prompts`` (the server is stopped after), each checked whole."""
    rig = Rig(model, logs)
    try:
        server = rig.engine("plain", **engine)
        rig.wait(server)
        expected = generate(server, model, prompts, max_tokens)
    finally:
        rig.close()
    assert all("tokens" in e and len(e["tokens"]) == max_tokens for e in expected), expected
    return expected


def prefill_only(server: launch.Server, model: str, prompt: list[int]) -> dict:
    """What a router's first leg gets: the prefill's ``kv_transfer_params`` (a kvlend ticket)."""
    answer = post(server.url + "/v1/completions",
                  completion(model, prompt, 1, kv_transfer_params={"do_remote_decode": True}))
    return answer["kv_transfer_params"]


def decode_with(server: launch.Server, model: str, prompt: list[int], params: dict, max_tokens: int,
                timeout: float = 120.0) -> dict:
    return _tokens(post(server.url + "/v1/completions",
                        completion(model, prompt, max_tokens, kv_transfer_params=params), timeout))


def _tokens(answer: dict) -> dict:
    """A completion's ``{"tokens", "finish"}``, or the error answer unchanged."""
    if "error" in answer:
        return answer
    choice = answer["choices"][0]
    return {"tokens": choice["token_ids"], "finish": choice["finish_reason"]}


def cluster_ranks(rig: Rig, etcd: str, prefix: str, want: set[str], timeout: float) -> list[dict]:
    """``kvlend cluster status``'s live ranks once their identities are exactly ``want`` (or at the deadline)."""
    kvlend = os.path.join(os.path.dirname(sys.executable), "kvlend")  # the command users run
    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run([kvlend, "cluster", "status", "--etcd", etcd, "--prefix", prefix, "--json",
                              "--timeout", "10"], capture_output=True, text=True, timeout=60,
                             env={**os.environ, **rig.tool_env()})
        if out.returncode != 0:
            raise AssertionError(f"kvlend cluster status failed: {out.stderr}")
        ranks = json.loads(out.stdout)["ranks"]
        if {r["identity"] for r in ranks} == want or time.monotonic() > deadline:
            return ranks
        time.sleep(0.5)


def served(server: launch.Server) -> int:
    """Requests the engine finished (vLLM's ``request_success_total``, every finish reason)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return int(sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+-]+)$", text, re.M)))


def preemptions(server: launch.Server) -> int:
    """Requests the engine preempted (vLLM's ``num_preemptions_total``)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return int(sum(float(v) for v in re.findall(r"^vllm:num_preemptions_total\{[^}]*\} ([0-9.e+-]+)$", text, re.M)))


def kv_usage(server: launch.Server) -> float:
    """vLLM's ``kv_cache_usage_perc`` gauge: above 0 while any block is held (lent ones included)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    match = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1))


def fetch_stats(path: str) -> list[dict]:
    """The decode connector's per-fetch lines (``stats_path``) written so far, whole lines only."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f.read().split("\n")[:-1] if line.strip()]


def wait_for_stats(path: str, count: int, timeout: float = 60.0) -> list[dict]:
    """The decode's per-fetch lines once there are ``count``: a fetch's line is written when the prefill's
    done ack comes, which may be after the request was answered."""
    end = time.monotonic() + timeout
    while len(lines := fetch_stats(path)) < count and time.monotonic() < end:
        time.sleep(0.05)
    return lines


def worker_metrics(server: launch.Server, model: str, names: dict[str, str], reached, timeout: float = 60.0) -> dict:
    """``names``' values scraped from ``server`` once ``reached(values)`` holds (or at ``timeout``).

    A worker's connector stats travel to the front end only with an engine step's output, and an idle
    engine takes no steps: each round sends the engine a one-token request of its own, so the stats of
    the last fetch are shipped however the fetch and the last step raced."""
    from kvlend_vllm.demo import scrape
    end, got = time.monotonic() + timeout, {}
    while True:
        got = scrape(server.url, names)
        if reached(got) or time.monotonic() >= end:
            return got
        post(server.url + "/v1/completions", completion(model, [5, 6, 7], 1), timeout=30.0)  # paces the loop


def ensure_model(size: str) -> str:
    out = subprocess.run([launch.VLLM_VENV_PYTHON, "-m", "kvlend_vllm.models", "--size", size],
                         check=True, capture_output=True, text=True, timeout=300)
    return out.stdout.strip().splitlines()[-1]
