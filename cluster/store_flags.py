"""`radixcache cluster`'s store flags: join every replica to an existing Mooncake Store (`--kv-remote`), or start one
on this node for them (`--kv-remote-start`), and the `radixcache serve` flags each replica then gets.

Pure argument handling (no process, no Ray): `store_plan` checks the flags and says what to start, `replica_flags`
the serve flags once it runs. The other store flags of `radixcache serve` (--kv-remote-replicas,
--kv-remote-timeout, --kv-remote-segment) pass through to every replica as before.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from radixcache.cluster.store_processes import LOOPBACK, LocalStore, store_serve_args
from radixcache.memory import parse_size

DEFAULT_SEGMENT = "1GiB"


def add_store_flags(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("the fleet's shared KV store (Mooncake Store; package extra `store`)")
    s.add_argument("--kv-remote", metavar="mooncake://HOST:PORT",
                   help="connect every replica to the store whose mooncake_master listens at HOST:PORT")  # fmt: skip
    s.add_argument("--kv-remote-metadata", metavar="URL",
                   help="with --kv-remote: the store's metadata server (default, as serve has it: the master's "
                        "HTTP metadata server on port 8080)")  # fmt: skip
    s.add_argument("--kv-remote-host", metavar="ADDR",
                   help="with --kv-remote: the replicas' address for the store's transfers (default: each "
                        "replica's address on the route to the master)")  # fmt: skip
    s.add_argument("--kv-remote-start", action="store_true",
                   help="start a mooncake_master and a store service on this node, and a store service on every "
                        "other Ray node, for the replicas; stopped with the cluster")  # fmt: skip
    s.add_argument("--kv-remote-segment-bytes", type=parse_size, metavar="SIZE",
                   help=f"with --kv-remote-start: the store service's memory, the whole store (default {DEFAULT_SEGMENT})")  # fmt: skip
    s.add_argument("--kv-remote-bind", metavar="ADDR",
                   help=f"with --kv-remote-start: the address the master and the service listen on (default "
                        f"{LOOPBACK}: replicas on this node only; an address on the cluster network for more "
                        "nodes, never a public one)")  # fmt: skip
    s.add_argument("--kv-remote-master-port", type=int, metavar="PORT",
                   help="with --kv-remote-start: the master's RPC port (default: a free one)")  # fmt: skip
    s.add_argument("--kv-remote-metadata-port", type=int, metavar="PORT",
                   help="with --kv-remote-start: its HTTP metadata server's port (default: a free one)")  # fmt: skip


@dataclass(frozen=True)
class StorePlan:
    """What the store flags ask for: `join` (serve flags for an existing store), or a LocalStore to start."""

    join: tuple[str, ...] = ()
    start: LocalStore | None = None


START_ONLY = ("kv_remote_segment_bytes", "kv_remote_bind", "kv_remote_master_port", "kv_remote_metadata_port")
JOIN_ONLY = ("kv_remote_metadata", "kv_remote_host")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def store_plan(args: argparse.Namespace, serve_argv: list[str]) -> StorePlan:
    """The store the flags ask for; ValueError naming the flag when they contradict each other or the replicas'
    own flags. Nothing is started or sized before every flag is checked."""
    if args.kv_remote and args.kv_remote_start:
        raise ValueError("--kv-remote (an existing store) and --kv-remote-start (a new one) exclude each other")
    if any(a == "--no-cache" for a in serve_argv) and (args.kv_remote or args.kv_remote_start):
        raise ValueError("--kv-remote keeps the replicas' pages in the fleet's store: it needs the cache (drop --no-cache)")  # fmt: skip
    for name in START_ONLY:
        if getattr(args, name) is not None and not args.kv_remote_start:
            raise ValueError(f"{flag(name)} sizes or places a store started here: it needs --kv-remote-start")
    for name in JOIN_ONLY:
        if getattr(args, name) is not None and not args.kv_remote:
            raise ValueError(f"{flag(name)} describes an existing store: it needs --kv-remote")
    if args.kv_remote:
        from radixcache.object_store import parse_store_url

        parse_store_url(args.kv_remote, "--kv-remote")
        join = ["--kv-remote", args.kv_remote]
        if args.kv_remote_metadata:
            join += ["--kv-remote-metadata", args.kv_remote_metadata]
        if args.kv_remote_host:
            join += ["--kv-remote-host", args.kv_remote_host]
        return StorePlan(join=tuple(join))
    if not args.kv_remote_start:
        return StorePlan()
    for name in ("kv_remote_master_port", "kv_remote_metadata_port"):
        port = getattr(args, name)
        if port is not None and not 1 <= port < 65536:
            raise ValueError(f"{flag(name)} must be in [1, 65535], got {port}")
    store = LocalStore(
        args.kv_remote_segment_bytes or parse_size(DEFAULT_SEGMENT),
        bind=args.kv_remote_bind or LOOPBACK,
        master_port=args.kv_remote_master_port or 0,
        metadata_port=args.kv_remote_metadata_port or 0,
    )
    return StorePlan(start=store)


def replica_flags(plan: StorePlan) -> list[str]:
    """The serve flags every replica gets for the planned store (empty: no store)."""
    if plan.start is not None:
        return list(plan.start.worker_args())
    return list(plan.join)


__all__ = ["StorePlan", "add_store_flags", "replica_flags", "store_plan", "store_serve_args"]
