"""A store service on every other node of the Ray cluster (`radixcache cluster --kv-remote-start`).

The node running `radixcache cluster` runs the master and its own store service (cluster/store_processes.LocalStore).
Every other alive Ray node gets one more store service, run by a Ray actor pinned to that node (hard node
affinity, no CPU reserved): it contributes the same segment to the same master, serves its memory on the node's
own address, and is stopped with the cluster. So the store's memory is spread over the nodes the replicas run on,
and a node that dies takes only its share of the store with it (those pages are misses, recomputed). `NodeServices`
keeps that true while the cluster runs: every WATCH_PERIOD_S it reads the node table again, and a node that joined
(an autoscaler's, or one that came back) gets its service.

`node_services` is pure (the plan from Ray's node table); `start_node_services` / `stop_node_services` need Ray;
`NodeServices` takes both as arguments (tests pass their own).
A master bound to loopback cannot serve other nodes: with more than one node, --kv-remote-bind must name an
address on the cluster network (refused before anything starts otherwise).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixcache.cluster.store_processes import (
    LOOPBACK,
    LocalStore,
    free_port,
    spawn_quiet,
    stop_process,
    store_service_argv,
    store_service_env,
)

SERVICE_START_S = 60.0  # a service's memory counted by the master within this, or the start fails
WATCH_PERIOD_S = 10.0  # how often the node table is read again for nodes that joined

log = logging.getLogger("radixcache.cluster")


@dataclass(frozen=True)
class NodeService:
    """One store service to run on Ray node `node_id`, serving its memory on `host` (that node's address)."""

    node_id: str
    host: str
    env: dict[str, str]


def node_services(nodes: list[dict[str, Any]], here: str, store: LocalStore) -> list[NodeService]:
    """A NodeService for each alive node of `nodes` (ray.nodes()'s table) but the one at address `here`, which runs
    `store`'s own service. ValueError naming --kv-remote-bind when other nodes exist and the store is on loopback."""
    others = [n for n in nodes if n.get("Alive") and n["NodeManagerAddress"] != here]
    if others and store.bind in (LOOPBACK, "0.0.0.0", "::"):
        raise ValueError(
            f"--kv-remote-bind: the Ray cluster has {len(others)} more node(s), and the store's address "
            f"{store.bind} is not one they can reach; name this node's address on the cluster network"
        )
    master = f"{store.bind}:{store.rpc}"
    return [
        NodeService(n["NodeID"], n["NodeManagerAddress"], store_service_env(master, store.metadata,
                    n["NodeManagerAddress"], store.segment_bytes))
        for n in others
    ]  # fmt: skip


class StoreServiceActor:
    """Runs one store service on the node it is placed on (made a Ray actor by start_node_services)."""

    def __init__(self, env: dict[str, str]) -> None:
        port = free_port(env["MOONCAKE_LOCAL_HOSTNAME"])
        self.proc = spawn_quiet(store_service_argv(sys.executable, port), env)

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        stop_process(self.proc)


def start_node_services(store: LocalStore, services: list[NodeService], timeout: float = SERVICE_START_S) -> list:
    """Start `services` (Ray actors, one per node) and return their handles once the master counts every one's
    memory; RuntimeError (those started, stopped) if that takes over `timeout` or a service exits."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(num_cpus=0)(StoreServiceActor)
    handles = [
        actor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(s.node_id, soft=False)).remote(s.env)
        for s in services
    ]
    want = store.capacity_bytes() + len(services) * store.segment_bytes
    deadline = time.monotonic() + timeout
    try:
        while store.capacity_bytes() < want:
            if not all(ray.get([h.running.remote() for h in handles], timeout=timeout)):
                raise RuntimeError("a store service on another node exited")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the other nodes' store services were not counted after {timeout:.0f} s")
            time.sleep(0.2)
    except BaseException:
        stop_node_services(handles)
        raise
    return handles


def stop_node_services(handles: list) -> None:
    """Stop the services and their actors; what cannot be reached any more is gone already."""
    import ray

    for handle in handles:
        try:
            ray.get(handle.stop.remote(), timeout=30)
        except Exception:  # noqa: BLE001 (a node or actor already gone: its service went with it)
            pass
        ray.kill(handle)


class NodeServices:
    """The store services of the Ray cluster's other nodes, for as long as the cluster runs (see the module
    docstring). `nodes()` is ray.nodes(); `start(store, services)` and `stop(handles)` are start_node_services and
    stop_node_services. `update()` starts a service on each alive node that has none (ValueError / RuntimeError as
    node_services / start_node_services raise them: the first call's are the cluster's start failing); `watch()`
    calls it every `period_s` on a thread, logging what fails (tried again the next period), until `close()`,
    which stops every service. A node that died is forgotten (its service went with it), so it gets a new one if
    it comes back."""

    def __init__(
        self,
        store: LocalStore,
        here: str,
        nodes: Callable[[], list[dict[str, Any]]],
        start: Callable[[LocalStore, list[NodeService]], list] = start_node_services,
        stop: Callable[[list], None] = stop_node_services,
        period_s: float = WATCH_PERIOD_S,
    ) -> None:
        self.store, self.here, self._nodes, self._start, self._stop = store, here, nodes, start, stop
        self.period_s = period_s
        self.handles: dict[str, Any] = {}  # node id -> the actor running its service
        self._closed = threading.Event()
        self._lock = threading.Lock()  # update() from the watcher and close() from the main thread
        self._thread: threading.Thread | None = None

    def update(self) -> int:
        """Start what the node table now asks for; the number of services started."""
        with self._lock:
            if self._closed.is_set():
                return 0
            table = self._nodes()
            alive = {n["NodeID"] for n in table if n.get("Alive")}
            for gone in [node for node in self.handles if node not in alive]:
                log.warning("store: node %s is gone, and its store service with it", gone)
                del self.handles[gone]
            planned = [s for s in node_services(table, self.here, self.store) if s.node_id not in self.handles]
            if planned:
                started = self._start(self.store, planned)
                self.handles.update(zip((s.node_id for s in planned), started, strict=True))
            return len(planned)

    def watch(self) -> None:
        def loop() -> None:
            said = ""  # the last failure logged: said once, not every period
            while not self._closed.wait(self.period_s):
                try:
                    if n := self.update():
                        log.info("store: a store service on each of %d node(s) that joined", n)
                    said = ""
                except (ValueError, RuntimeError) as e:
                    if str(e) != said:
                        log.warning("store: a node joined, but it gets no store service: %s", e)
                    said = str(e)

        self._thread = threading.Thread(target=loop, name="store-node-services", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._stop(list(self.handles.values()))
            self.handles.clear()
