"""MooncakeObjectStore: radixcache.object_store.ObjectStore over Mooncake Store (`serve --kv-remote mooncake://...`).

Mooncake Store: `mooncake_master` keeps the metadata (which object lives in which segment), store processes
(`python -m mooncake.mooncake_store_service`, one per node) contribute the memory, and clients put and get objects
by key over TCP (or RDMA). A worker is a client that contributes `segment_bytes` of its own (0 by default: the
fleet's memory lives in the store services, so a worker that dies takes nothing of the store with it) and a
`buffer_bytes` staging buffer.

The package (`mooncake-transfer-engine-non-cuda`, the `store` extra) is imported by `connect`, never at import
time: a worker without --kv-remote never loads it.

Deadlines: the client's calls block and take no deadline of their own, so each runs on a small pool of call
threads while the caller waits at most `timeout`; a call that overran keeps its thread until it returns, and while
MAX_STUCK calls are stuck every new call fails at once (StoreUnavailable) instead of queueing behind them.
MC_RPC_TIMEOUT_MS (the client's own RPC timeout, read from the environment) defaults to the call timeout, so stuck
calls end too. What the client answers: `get_size` -704 is "no such object", `get` b"" is a miss (the object went
between the two calls, or the read failed: either way nothing is served), any other negative code is an error.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from radixcache.object_store import StoreAddress, StoreUnavailable

log = logging.getLogger("radixcache.mooncake_store")

OBJECT_NOT_FOUND = -704  # Mooncake's ErrorCode for a key it does not hold
CALL_THREADS = 4
MAX_STUCK = 2
T = TypeVar("T")


def local_address(master: StoreAddress) -> str:
    """This host's address on the route to the master (127.0.0.1 when the master is on loopback): what other
    clients of the store reach this one at."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # connect() on UDP sends nothing: it picks a route
        s.connect((master.host, master.port))
        return str(s.getsockname()[0])


class MooncakeObjectStore:
    """See the module docstring. `metadata`: the transfer engine's metadata server (the master's
    --enable_http_metadata_server URL, e.g. http://HOST:8080/metadata); `replicas`: copies per object."""

    def __init__(
        self,
        master: StoreAddress,
        metadata: str,
        *,
        local_host: str | None = None,
        segment_bytes: int = 0,
        buffer_bytes: int = 64 << 20,
        replicas: int = 1,
        protocol: str = "tcp",
    ) -> None:
        self.master = master
        self.metadata = metadata
        self.local_host = local_host
        self.segment_bytes = segment_bytes
        self.buffer_bytes = buffer_bytes
        self.replicas = replicas
        self.protocol = protocol
        self._client: Any = None
        self._replicate: Any = None
        self._calls = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="radixcache-mooncake")
        self._lock = threading.Lock()
        self._stuck = 0

    def connect(self, timeout: float) -> None:
        if self._client is not None:
            return
        host = self.local_host or local_address(self.master)
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)  # listen where other clients reach us, nowhere else
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(max(100, int(timeout * 1000))))
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        client = MooncakeDistributedStore()
        master = f"{self.master.host}:{self.master.port}"
        args = (host, self.metadata, self.segment_bytes, self.buffer_bytes, self.protocol, "", master)
        rc = self._call(lambda: client.setup(*args), timeout)
        if rc != 0:
            raise StoreUnavailable(f"joining the Mooncake store at {self.master} failed (code {rc})")
        replicate = ReplicateConfig()
        replicate.replica_num = self.replicas
        self._client, self._replicate = client, replicate

    def get(self, key: str, timeout: float) -> bytes | None:
        client = self._connected()
        size = self._call(lambda: client.get_size(key), timeout)
        if size == OBJECT_NOT_FOUND:
            return None
        if size < 0:
            raise StoreUnavailable(f"get_size({key!r}) failed (code {size})")
        data = self._call(lambda: client.get(key), timeout)
        return bytes(data) if data else None

    def get_many(self, keys: list[str], timeout: float) -> list[bytes | None]:
        """One get_batch call. Mooncake answers an empty value for an object it does not hold (a page object never
        is empty: it starts with its header)."""
        client = self._connected()
        values = self._call(lambda: client.get_batch(keys), timeout)
        if len(values) != len(keys):
            raise StoreUnavailable(f"get_batch answered {len(values)} values for {len(keys)} keys")
        return [value if value else None for value in values]

    def put(self, key: str, data: bytes, timeout: float) -> None:
        client = self._connected()
        rc = self._call(lambda: client.put(key, data, self._replicate), timeout)
        if rc != 0:
            raise StoreUnavailable(f"put({key!r}) failed (code {rc})")

    def exists(self, key: str, timeout: float) -> bool:
        client = self._connected()
        rc = self._call(lambda: client.is_exist(key), timeout)
        if rc < 0:
            raise StoreUnavailable(f"is_exist({key!r}) failed (code {rc})")
        return rc == 1

    def exists_many(self, keys: list[str], timeout: float) -> list[bool]:
        client = self._connected()
        answers = self._call(lambda: client.batch_is_exist(keys), timeout)
        if len(answers) != len(keys) or any(a < 0 for a in answers):
            raise StoreUnavailable(f"batch_is_exist of {len(keys)} keys failed ({answers[:4]}...)")
        return [a == 1 for a in answers]

    def put_many(self, keys: list[str], datas: list[bytes], timeout: float) -> None:
        client = self._connected()
        rc = self._call(lambda: client.put_batch(keys, datas, self._replicate), timeout)
        if rc != 0:
            raise StoreUnavailable(f"put_batch of {len(keys)} objects failed (code {rc})")

    def remove(self, key: str, timeout: float) -> None:
        client = self._connected()
        rc = self._call(lambda: client.remove(key, True), timeout)  # force: a reader's lease does not keep it
        if rc not in (0, OBJECT_NOT_FOUND):
            raise StoreUnavailable(f"remove({key!r}) failed (code {rc})")

    def remove_prefix(self, prefix: str, timeout: float) -> None:
        client = self._connected()
        pattern = "^" + "".join("\\" + c if not c.isalnum() else c for c in prefix)
        rc = self._call(lambda: client.remove_by_regex(pattern, True), timeout)
        if rc < 0 and rc != OBJECT_NOT_FOUND:
            raise StoreUnavailable(f"removing {prefix!r}* failed (code {rc})")

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                self._call(client.close, 2.0)
            except StoreUnavailable as e:
                log.warning("closing the Mooncake client: %s", e)
        self._calls.shutdown(wait=False, cancel_futures=True)

    def _connected(self) -> Any:
        if self._client is None:
            raise StoreUnavailable("not connected to the Mooncake store")
        return self._client

    def _call(self, fn: Callable[[], T], timeout: float) -> T:
        """fn() on a call thread, waited for at most `timeout` seconds."""
        with self._lock:
            if self._stuck >= MAX_STUCK:
                raise StoreUnavailable(f"{self._stuck} calls to the store are still stuck past their deadline")
        try:
            future = self._calls.submit(fn)
        except RuntimeError as e:  # shut down
            raise StoreUnavailable(str(e)) from e
        try:
            return future.result(timeout)
        except FutureTimeout:
            with self._lock:
                self._stuck += 1
            future.add_done_callback(self._unstuck)
            raise StoreUnavailable(f"the store did not answer within {timeout:.3g} s") from None
        except Exception as e:  # the client raised: as good as no answer
            raise StoreUnavailable(f"{type(e).__name__}: {e}") from e

    def _unstuck(self, _: object) -> None:
        with self._lock:
            self._stuck -= 1
