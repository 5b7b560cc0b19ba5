"""A fleet's store started on this node: one `mooncake_master` (with its HTTP metadata server) and one Mooncake store
service holding the store's memory, on given or free ports, stopped by `stop()` / `with`.

`radixcache cluster --kv-remote-start` runs one for its replicas; the benchmarks run one on loopback. Needs the
`store` extra and Debian's libibverbs1 (the package's binaries link it even for TCP). The store is inside the
operator's trust boundary (its master and its service answer anyone who reaches them): `bind` is loopback unless
the operator names an address on the cluster network.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import IO

LOOPBACK = "127.0.0.1"
STOP_WAIT_S = 10.0


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def store_serve_args(url: str, metadata: str, worker_host: str | None) -> list[str]:
    """The `radixcache serve` flags that join a worker to the store whose master is `url` (mooncake://HOST:PORT)
    and whose metadata server is `metadata`; `worker_host` is the worker's own address for transfers (None: the
    worker picks its address on the route to the master)."""
    args = ["--kv-remote", url, "--kv-remote-metadata", metadata]
    return [*args, "--kv-remote-host", worker_host] if worker_host else args


def store_url(host: str, rpc_port: int) -> str:
    """The master as `--kv-remote` names it."""
    return f"mooncake://{host}:{rpc_port}"


def metadata_url(host: str, metadata_port: int) -> str:
    """The master's HTTP metadata server as `--kv-remote-metadata` and the store service name it."""
    return f"http://{host}:{metadata_port}/metadata"


MASTER_BINARY = "mooncake_master"  # the store extra's console script, next to the interpreter
STORE_SERVICE_MODULE = "mooncake.mooncake_store_service"


def master_flags(bind: str, rpc_port: int, metadata_port: int, metrics_port: int) -> list[str]:
    """`mooncake_master`'s flags: RPC, its HTTP metadata server and its metrics (/metrics, /health), all on `bind`.
    deploy/mooncake.yaml's master runs these (tests/test_deploy.py checks it)."""
    return [
        f"--rpc_address={bind}",
        f"--rpc_port={rpc_port}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_host={bind}",
        f"--http_metadata_server_port={metadata_port}",
        f"--metrics_host={bind}",
        f"--metrics_port={metrics_port}",
    ]


def store_service_argv(python: str, port: int) -> list[str]:
    """The store service's command line: Mooncake's module, its HTTP API (which binds 0.0.0.0) on `port`."""
    return [python, "-m", STORE_SERVICE_MODULE, f"--port={port}"]


def store_service_env(master: str, metadata: str, host: str, segment_bytes: int) -> dict[str, str]:
    """The store service's configuration (Mooncake reads it from the environment): the master's HOST:PORT, the
    metadata URL, `host` (its own address, where the workers reach its memory, and the one it listens on) and
    `segment_bytes`, the memory it contributes. deploy/mooncake.yaml's DaemonSet sets these (tests/test_deploy.py)."""
    return {
        "MC_TCP_BIND_ADDRESS": host,
        "MOONCAKE_MASTER": master,
        "MOONCAKE_TE_META_DATA_SERVER": metadata,
        "MOONCAKE_LOCAL_HOSTNAME": host,
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(segment_bytes),
        "MOONCAKE_LOCAL_BUFFER_SIZE": "0",  # the service only holds memory; it reads nothing itself
        "MOONCAKE_PROTOCOL": "tcp",
    }


def master_capacity_bytes(host: str, metrics_port: int) -> float:
    """The memory the master at `host` counts in its store services (master_total_capacity_bytes on its metrics
    port): 0 until a service has registered, or when the master does not answer. Puts land only once it is > 0."""
    try:
        with urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics", timeout=1) as reply:
            text = reply.read().decode()
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("master_total_capacity_bytes "):
            return float(line.split()[1])
    return 0.0


class LocalStore:
    """A master and one store service of `segment_bytes` on `bind`. Ports 0 are picked free.

    It runs what master_flags / store_service_argv / store_service_env say, the one statement of how this project
    runs them (the benchmarks, the e2e tests and `radixcache cluster --kv-remote-start` all start them here;
    deploy/'s manifests are checked against the same functions). The master or the service alone can be killed
    (SIGKILL: a crash) and started again on the same ports, as the fault tests do: a restarted master holds no
    objects and knows no segment, so the service must be started again after it."""

    def __init__(
        self,
        segment_bytes: int = 1 << 30,
        *,
        bind: str = LOOPBACK,
        master_port: int = 0,
        metadata_port: int = 0,
        log: IO[bytes] | None = None,
    ) -> None:
        if segment_bytes <= 0:
            raise ValueError(f"segment_bytes must be > 0, got {segment_bytes}")
        for name, port in (("master_port", master_port), ("metadata_port", metadata_port)):
            if not 0 <= port < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {port}")
        self.bind = bind
        self.segment_bytes = segment_bytes
        self.rpc = master_port or free_port(bind)
        self.http = metadata_port or free_port(bind)
        self.metrics, self.service_port = free_port(bind), free_port(bind)
        self.log = log  # where the processes write (None: discarded)
        self.master: subprocess.Popen | None = None
        self.service: subprocess.Popen | None = None
        self.url = store_url(bind, self.rpc)
        self.metadata = metadata_url(bind, self.http)

    @property
    def procs(self) -> list[subprocess.Popen]:
        """The processes started and not yet reaped by stop(), service first."""
        return [p for p in (self.service, self.master) if p is not None]

    def worker_args(self) -> tuple[str, ...]:
        """What `radixcache serve` needs to join this store (on loopback the worker's own address is loopback too)."""
        return tuple(store_serve_args(self.url, self.metadata, LOOPBACK if self.bind == LOOPBACK else None))

    def _spawn(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        return spawn_quiet(argv, env, self.log)

    def start(self, timeout: float = 60.0) -> LocalStore:
        """Starts both and returns once the master counts the service's memory (before that every put fails);
        RuntimeError (both stopped) if that takes over `timeout` or either exits."""
        self.start_master()
        self.start_service(timeout)
        return self

    def start_master(self) -> None:
        """The master on this store's ports (again after kill_master); returns at once: start_service waits."""
        binary = str(Path(sys.executable).parent / MASTER_BINARY)
        self.master = self._spawn([binary, *master_flags(self.bind, self.rpc, self.http, self.metrics)], {})

    def start_service(self, timeout: float = 60.0) -> None:
        """The store service; returns once the master counts its memory. RuntimeError (everything stopped) if that
        takes over `timeout` or a process exits."""
        env = store_service_env(f"{self.bind}:{self.rpc}", self.metadata, self.bind, self.segment_bytes)
        self.service = self._spawn(store_service_argv(sys.executable, self.service_port), env)
        deadline = time.monotonic() + timeout
        while self.capacity_bytes() <= 0:
            exited = [p.args[0] for p in self.procs if p.poll() is not None]
            if exited or time.monotonic() > deadline:
                self.stop()
                why = f"{exited} exited" if exited else f"not ready after {timeout:.0f} s"
                raise RuntimeError(f"the local Mooncake store did not come up: {why}")
            time.sleep(0.1)

    def kill_master(self) -> None:
        """SIGKILL the master (a crash: every object's whereabouts is lost with it)."""
        _kill(self.master)

    def kill_service(self) -> None:
        """SIGKILL the store service (the memory holding the objects)."""
        _kill(self.service)

    def all_keys(self) -> list[str]:
        """Every object key the master knows (its HTTP /get_all_keys)."""
        with urllib.request.urlopen(f"http://{self.bind}:{self.metrics}/get_all_keys", timeout=5) as reply:
            return [k for k in reply.read().decode().splitlines() if k]

    def capacity_bytes(self) -> float:
        """The store's memory as the master counts it (its metrics' master_total_capacity_bytes); 0 if unknown."""
        return master_capacity_bytes(self.bind, self.metrics)

    def running(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def stop(self) -> None:
        """Stops the service, then the master (SIGTERM, SIGKILL after STOP_WAIT_S); idempotent."""
        for proc in self.procs:
            stop_process(proc)
        self.master = self.service = None

    def __enter__(self) -> LocalStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn_quiet(argv: list[str], env: dict[str, str], log: IO[bytes] | None = None) -> subprocess.Popen:
    """A Mooncake process with `env` over ours, its glog quiet unless GLOG_minloglevel says otherwise, writing to
    `log` (None: discarded)."""
    out = log if log is not None else subprocess.DEVNULL
    quiet = {"GLOG_minloglevel": os.environ.get("GLOG_minloglevel", "2")}
    return subprocess.Popen(argv, env={**os.environ, **quiet, **env}, stdout=out, stderr=subprocess.STDOUT)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, SIGKILL after STOP_WAIT_S; nothing if it has exited."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _kill(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(10)
