"""The engine's tiers below the KV pool: building them from EngineConfig, opening the disk store and the fleet's
store (`--kv-remote`, radixcache.remote_tier) in the background,
saving what memory holds at shutdown (the warm restart), and closing them.

Start: the host-memory tier (kv_host_bytes) works from the first step. The disk store (kv_disk_dir) needs the
fingerprint (worker/engine/fingerprint.py), whose weights digest reads the weight files: `open_below` does that on a thread
of its own after the engine started, so "listening on" is not delayed by it, then hands the open store to the
engine thread (`submit`: through its inbox), which adds it below the host tier and restores the pins the last
shutdown saved, before any other load. The store's scan of what earlier runs left goes on in the background; its
pages are found by one stat each meanwhile. `ready` says when all of that is done. The fleet's store (kv_remote)
is keyed by the same fingerprint and handed over with the disk, below it; it joins the store on its own writer
thread, so `ready` does not wait for the network (its stats' store_ready says when it answers); admission does
(`joining_store`, bounded by WARM_START_WAIT_S), so a replica started after others is warm from its first request.

Serve (engine thread): the scheduler reaches the tiers through this object only (`pump`, `start_load`, `cancel`,
`has_arrivals`, `active`), never through the cache's link; `wait` is for a caller driving `Engine.step` itself.

Stop (`close`, after the engine thread has ended): the pages memory holds and the disk lacks are queued (pinned first,
then the most recently used, then the host tier's), the pins manifest is written, and the store writes its queue,
all within the deadline; what does not make it is lost, never torn.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from radixcache.host_tier import HostTier
from radixcache.page_data import PageData
from radixcache.pool import KVPool
from radixcache.store import Codec, DiskStore
from radixcache.tier import PageTier, TierChain
from radixcache.tiering import STEP_WRITE_BUDGET_S, LoadJob, TierLink
from radixcache.worker.engine.config import EngineConfig
from radixcache.worker.model.loader import LoadedModel

if TYPE_CHECKING:
    from radixcache.remote_tier import RemoteTier

log = logging.getLogger("radixcache.engine")

PAGE_CODEC = Codec(encode=lambda page: page.to_bytes(), decode=PageData.from_bytes)
# The longest admission waits, after the engine started, for the fleet's store to be joined (the fingerprint read, the
# client's setup: ~2.4 s on loopback); past it the worker serves from its own tiers and the store joins later.
WARM_START_WAIT_S = 30.0
MIN_SAVE_S = 1.0  # a shutdown that drained up to its deadline still gets this long to save


def build_tier_link(pool: KVPool, config: EngineConfig, notify: Callable[[], None]) -> TierLink | None:
    """The cache's TierLink for `config`, with its host tier (if any); None when no tier is configured."""
    if config.kv_disk_dir is None and config.kv_host_bytes is None and config.kv_remote is None:
        return None
    tiers: list[PageTier] = []
    if config.kv_host_bytes is not None:
        tiers.append(HostTier(config.kv_host_bytes, pin=pool.device.type == "cuda"))
    through = config.kv_disk_dir is not None and config.kv_disk_write == "through"
    return TierLink(pool, config.page_size, tiers=TierChain(tiers), notify=notify, write_through=through)


def open_remote(config: EngineConfig, fingerprint: str, kv_dtype: str) -> RemoteTier:
    """The fleet's store tier for `config.kv_remote`, started (it joins the store in the background). Imports the
    Mooncake client module here, and the package only when it connects: never without --kv-remote."""
    from radixcache.mooncake_store import MooncakeObjectStore
    from radixcache.object_store import parse_store_url
    from radixcache.remote_tier import RemoteTier

    assert config.kv_remote is not None, "the store tier is opened only where one is configured"
    master = parse_store_url(config.kv_remote)
    client = MooncakeObjectStore(
        master,
        config.kv_remote_metadata or f"http://{master.host}:8080/metadata",
        local_host=config.kv_remote_host,
        segment_bytes=config.kv_remote_segment_bytes,
        buffer_bytes=config.kv_remote_buffer_bytes,
        replicas=config.kv_remote_replicas,
    )
    return RemoteTier(
        client, fingerprint, codec=PAGE_CODEC, kv_dtype=kv_dtype, timeout_s=config.kv_remote_timeout_s
    ).start()


class EngineTiers:
    """One engine's tiers. `submit(fn)` runs fn on the engine thread; `pin(tokens, ns, ttl)` pins as the engine
    does (within the budget, leaving what running requests were promised)."""

    def __init__(
        self,
        link: TierLink,
        config: EngineConfig,
        submit: Callable[[Callable[[], None]], None],
        pin: Callable[[list[int], str, float | None], int],
    ) -> None:
        self.link = link
        self.config = config
        self._submit = submit
        self._pin = pin
        self._opened = threading.Event()  # the disk store is part of the link (or there is none to open)
        self._thread: threading.Thread | None = None
        self._open_started: float | None = None
        self._closed = False
        self.error: str | None = None
        if config.kv_disk_dir is None and config.kv_remote is None:
            self._opened.set()

    @property
    def ready(self) -> bool:
        """Every configured tier is open, the disk's index is rebuilt and the saved pins are restored."""
        disk = self.link.disk
        return self._opened.is_set() and (disk is None or disk.wait_ready(0)) and not self.link.restoring

    # --- what the scheduler reads and asks, each step (engine thread) ----------------------------------------------
    @property
    def joining_store(self) -> bool:
        """The fleet's store is configured and still being opened or joined (at most WARM_START_WAIT_S after
        open_below): admission waits for it, so a worker that starts after others wrote the fleet's prefixes serves
        them from the store from its first request. False once joined, failed, or past the bound."""
        started = self._open_started
        if self.config.kv_remote is None or started is None or self.error is not None:
            return False
        if time.monotonic() - started > WARM_START_WAIT_S:
            return False
        if not self._opened.is_set():
            return True
        remote = self.link.remote
        return remote is not None and remote.joining

    @property
    def active(self) -> bool:
        """Some tier is open below memory (the disk may still be opening): worth looking a prompt up there."""
        return self.link.active

    def pump(self, budget_s: float = STEP_WRITE_BUDGET_S, room_coming: bool = False) -> None:
        """Put the loads that arrived into the tree (those that do not fit yet wait while `room_coming`: requests
        are running), write through for up to `budget_s`, report the tiers' events."""
        self.link.pump(budget_s, room_coming)

    def loads_holding(self, besides: LoadJob | None = None) -> bool:
        """A load other than `besides` locks pages it will let go when it finishes (TierLink.loads_holding)."""
        return self.link.loads_holding(besides)

    def has_arrivals(self) -> bool:
        """A load has arrived that `pump` has not put into the tree yet."""
        return self.link.has_completions()

    def start_load(self, owner: str, tokens: list[int], namespace: str, max_tokens: int) -> LoadJob | None:
        """Load the pages of tokens[:max_tokens] that continue past memory into a tier (radixcache.tiering's
        TierLink.start_load): the job, or None when no tier holds the next page."""
        return self.link.start_load(owner, tokens, namespace, max_tokens)

    def cancel(self, job: LoadJob) -> None:
        """The request that waited for `job` ended (the last waiter lets its lease go)."""
        self.link.cancel(job)

    def wait(self, timeout: float) -> bool:
        """Block until a load has arrived (True) or `timeout` seconds passed: for callers that drive the engine."""
        return self.link.wait(timeout)

    # --- start and stop ----------------------------------------------------------------------------------------
    def open_below(self, loaded: LoadedModel, pool: KVPool, *, device: torch.device, backend: str) -> None:
        """Compute the fingerprint and open the disk store and the fleet's store on a background thread (once)."""
        if (self.config.kv_disk_dir is None and self.config.kv_remote is None) or self._thread is not None:
            return
        self._open_started = time.monotonic()
        self._thread = threading.Thread(
            target=self._open, args=(loaded, pool, device, backend), name="radixcache-tier-open", daemon=True
        )
        self._thread.start()

    def _open(self, loaded: LoadedModel, pool: KVPool, device: torch.device, backend: str) -> None:
        from radixcache.worker.engine.fingerprint import fingerprint, fingerprint_parts, store_folder, weights_digest

        c = self.config
        try:
            started = time.monotonic()
            parts = fingerprint_parts(loaded, pool=pool, page_size=c.page_size, device=str(device), backend=backend)
            digest = weights_digest(loaded, remember_in=c.kv_disk_dir)
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            log.exception("the model's fingerprint could not be computed; serving without the disk and store tiers")
            return
        remote = None
        if c.kv_remote is not None:
            try:
                remote = open_remote(c, fingerprint(parts, digest), pool.kv_dtype)
            except Exception as e:
                self.error = f"{type(e).__name__}: {e}"
                log.exception("the store tier %s could not be opened; serving without it", c.kv_remote)
        store = None
        if c.kv_disk_dir is not None:
            try:
                folder = store_folder(c.kv_disk_dir, parts, digest)
                store = DiskStore(
                    folder, c.kv_disk_bytes, codec=PAGE_CODEC, queue_pages=c.kv_disk_queue_pages, kv_dtype=pool.kv_dtype
                ).start()
            except Exception as e:
                self.error = f"{type(e).__name__}: {e}"
                log.exception("the disk tier under %s could not be opened; serving without it", c.kv_disk_dir)
            else:
                log.info(
                    "disk tier %s open after %.2f s (index rebuilt in the background)",
                    folder,
                    time.monotonic() - started,
                )

        def attach() -> None:  # engine thread: below the host tier, then the pins before any other load
            if self._closed:
                for tier in (store, remote):
                    if tier is not None:
                        tier.close(0)
                return
            if remote is not None:
                self.link.add_remote(remote)
            if store is not None:
                self.link.add_disk(store)
                restored = self.link.restore_pins(self._pin)
                if restored:
                    log.info("restoring %d pinned prefixes from %s", restored, store.folder)
            self._opened.set()

        self._submit(attach)

    def close(self, deadline: float | None) -> None:
        """Save what memory holds to the disk (see the module docstring) and close every tier. Call once the engine
        thread has stopped; `deadline` is time.monotonic()-based (None: take as long as it needs). Idempotent."""
        if self._closed:
            return
        self._closed = True
        link = self.link
        end = max(deadline, time.monotonic() + MIN_SAVE_S) if deadline is not None else time.monotonic() + 3600.0
        try:
            link.pump(0.0)
            if link.disk is not None:
                saved = link.save(end)
                log.info("saved %d pages of the KV cache to %s", saved, link.disk.folder)
        except Exception:
            log.exception("saving the KV cache to the disk tier failed")
        link.close(max(0.0, end - time.monotonic()))
