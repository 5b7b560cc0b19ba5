"""A Mooncake Store on loopback for the benchmarks: one `mooncake_master` (with its HTTP metadata server) and one
store service holding the memory, on free ports, stopped by `stop()` / `with`; the master or the
service alone can be killed and started again on the same ports (the fault phases). Needs the `store` extra and
Debian's libibverbs1 (what `make setup` installs)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from radixcache.cluster.store_processes import master_capacity_bytes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalMooncake:
    def __init__(self, segment_bytes: int = 1 << 30) -> None:
        self.rpc, self.http, self.metrics, self.service_port = (free_port() for _ in range(4))
        self.segment_bytes = segment_bytes
        self.procs: list[subprocess.Popen] = []
        self.master: subprocess.Popen | None = None
        self.service: subprocess.Popen | None = None
        self.url = f"mooncake://127.0.0.1:{self.rpc}"
        self.metadata = f"http://127.0.0.1:{self.http}/metadata"

    def worker_args(self) -> tuple[str, ...]:
        """What `radixcache serve` needs to join this store."""
        return ("--kv-remote", self.url, "--kv-remote-metadata", self.metadata, "--kv-remote-host", "127.0.0.1")

    def start(self, timeout: float = 60.0) -> LocalMooncake:
        self.start_master()
        self.start_service(timeout)
        return self

    def start_master(self) -> None:
        """The master on this store's ports (again after kill_master: a restarted master holds no objects)."""
        master = [
            str(Path(sys.executable).parent / "mooncake_master"),
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.rpc}",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics}",
        ]
        self.master = subprocess.Popen(master, env=self._quiet(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(self.master)

    def start_service(self, timeout: float = 60.0) -> None:
        """The store service; returns once the master counts its memory (before that every put is refused)."""
        service_env = {
            **self._quiet(),
            "MC_TCP_BIND_ADDRESS": "127.0.0.1",
            "MOONCAKE_MASTER": f"127.0.0.1:{self.rpc}",
            "MOONCAKE_TE_META_DATA_SERVER": self.metadata,
            "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
            "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(self.segment_bytes),
            "MOONCAKE_LOCAL_BUFFER_SIZE": "0",
            "MOONCAKE_PROTOCOL": "tcp",
        }
        service = [sys.executable, "-m", "mooncake.mooncake_store_service", f"--port={self.service_port}"]
        self.service = subprocess.Popen(service, env=service_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(self.service)
        deadline = time.monotonic() + timeout
        while self.capacity_bytes() <= 0:
            if time.monotonic() > deadline or any(p.poll() is not None for p in (self.master, self.service)):
                self.stop()
                raise RuntimeError("the local Mooncake store did not come up")
            time.sleep(0.1)

    def kill_master(self) -> None:
        """SIGKILL the master (a crash: its metadata, so every object's whereabouts, is lost)."""
        self._kill(self.master)

    def kill_service(self) -> None:
        """SIGKILL the store service (the memory holding the objects)."""
        self._kill(self.service)

    def all_keys(self) -> list[str]:
        """Every object key the master knows (its HTTP /get_all_keys)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/get_all_keys", timeout=5) as reply:
            return [k for k in reply.read().decode().splitlines() if k]

    @staticmethod
    def _kill(proc: subprocess.Popen | None) -> None:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    @staticmethod
    def _quiet() -> dict[str, str]:
        return {**os.environ, "GLOG_minloglevel": "2"}

    def capacity_bytes(self) -> float:
        return master_capacity_bytes("127.0.0.1", self.metrics)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        self.procs.clear()

    def __enter__(self) -> LocalMooncake:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
