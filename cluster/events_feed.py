"""EventPump: a replica's cache events, drained off the engine thread and published to the cluster's EventHub.

The engine thread only appends records to an EventLog (radixcache.event_log); a pump thread drains them every
`interval_s`, turns them into the hub's neutral tuples (see hub.Event) and publishes them in order. When the log
loses records (it is bounded), the pump asks for a fresh snapshot, which reaches the hub as "reset" + "stored".
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from radixcache.event_log import LOST, EventLog, Snapshot
from radixcache.events import NamespaceCleared, PagesRemoved, PagesStored

log = logging.getLogger("radixcache.cluster")


def hub_events(items: list[Any]) -> list[tuple[Any, ...]]:
    """EventLog.drain() output -> hub events (LOST becomes nothing here: the pump asks for a snapshot)."""
    out: list[tuple[Any, ...]] = []
    for item in items:
        if isinstance(item, Snapshot):
            out.append(("reset",))
            out.extend(("stored", e.namespace, e.page_hashes) for e in item.events)
        elif isinstance(item, PagesStored):
            out.append(("stored", item.namespace, item.page_hashes))
        elif isinstance(item, PagesRemoved):
            out.append(("removed", item.namespace, item.page_hashes))
        elif isinstance(item, NamespaceCleared):
            out.append(("cleared", item.namespace))
    return out


class EventPump:
    def __init__(self, engine: Any, replica_id: str, hub_name: str, hub_namespace: str, interval_s: float = 0.02):
        self.engine = engine
        self.replica_id = replica_id
        self.hub_name, self.hub_namespace = hub_name, hub_namespace
        self.interval_s = interval_s
        self.log = EventLog(engine.page_size, max_pending=200_000)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cache-event-pump", daemon=True)

    def start(self) -> None:
        import ray

        from radixcache.cluster.hub import get_or_create_hub

        self.hub = get_or_create_hub(self.hub_name, self.hub_namespace)
        ray.get(self.hub.register.remote(self.replica_id))
        self._snapshot()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _snapshot(self) -> None:
        def on_engine_thread() -> None:
            self.engine.cache.set_event_sink(self.log)
            self.log.snapshot(self.engine.cache.tree)

        self.engine.call(on_engine_thread)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            items = self.log.drain()
            if not items:
                continue
            if LOST in items:
                log.warning("replica %s: cache-event log overflowed; publishing a fresh snapshot", self.replica_id)
                self._snapshot()
            events = hub_events(items)
            if events:
                self.hub.publish.remote(self.replica_id, events)
