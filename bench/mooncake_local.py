"""A Mooncake Store on loopback for the benchmarks: one `mooncake_master` (with its HTTP metadata server) and one
store service holding the memory, on free ports, stopped by `stop()` / `with`. The processes are started as
`radixcache cluster --kv-remote-start` starts them (radixcache.cluster.store_processes). Needs the `store` extra and
Debian's libibverbs1 (what `make setup` installs)."""

from __future__ import annotations

from radixcache.cluster.store_processes import LocalStore, free_port


class LocalMooncake(LocalStore):
    """LocalStore on loopback: LocalMooncake(segment_bytes), worker_args(), start(), stop(), capacity_bytes()."""

    def __init__(self, segment_bytes: int = 1 << 30) -> None:
        super().__init__(segment_bytes)


__all__ = ["LocalMooncake", "free_port"]
