"""`radixcache cluster`: N engine replicas on Ray Serve behind one gRPC endpoint, routed by cached prefix.

Every flag `radixcache serve` takes for the model and the cache (--model, --random-model, --page-size, --kv-pages,
--kv-memory, --max-step-tokens, --backend, --no-cache, --dtype, --device, ...) is passed to each replica as is.
With --kv-remote every replica joins an existing Mooncake Store; with --kv-remote-start the cluster starts one on
this node (a mooncake_master and one store service) and stops it when it stops.
Prints "serving on HOST:PORT" once the Serve application is running and answers, then runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from radixcache.cluster.policy import (
    DEFAULT_BALANCE_ABS,
    DEFAULT_BALANCE_REL,
    DEFAULT_MIN_MATCH_PAGES,
    DEFAULT_TIE_SHARE,
    LoadWeights,
)
from radixcache.cluster.store_flags import StorePlan, add_store_flags, replica_flags, store_plan

if TYPE_CHECKING:
    from radixcache.cluster.app import ClusterOptions
    from radixcache.cluster.store_processes import LocalStore


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="radixcache cluster",
        description="Run N radixcache replicas on Ray Serve behind one gRPC endpoint, routed by cached prefix. "
        "Unknown flags go to every replica's `radixcache serve` (model and cache options).",
        allow_abbrev=False,  # an abbreviation would swallow a serve flag (--kv-remote-segment is serve's, not ours)
    )
    p.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2)")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs (and torch threads) per replica")
    p.add_argument("--replica-gpus", type=float, default=0.0,
                   help="Ray GPUs per replica (default 0); > 0 runs each engine on CUDA unless --device is given")  # fmt: skip
    p.add_argument("--ray-address", help="join this Ray cluster (default: start a local instance)")
    p.add_argument("--host", default="127.0.0.1", help="address of Serve's proxies (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port of Serve's proxy (default 50051)")
    p.add_argument("--auth-tokens", type=Path, help="bearer tokens, as for `radixcache serve`")
    p.add_argument("--ingress-replicas", type=int, default=1,
                   help="ingress replicas relaying the streams (default 1); Abort reaches across them")  # fmt: skip
    p.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds a replica being stopped lets its streams run before ending them with UNAVAILABLE "
                   "(default 30)")  # fmt: skip
    add_store_flags(p)
    r = p.add_argument_group("routing")
    r.add_argument(
        "--balance-abs",
        type=int,
        default=DEFAULT_BALANCE_ABS,
        help=f"queue-length gap beyond which load wins over cache (default {DEFAULT_BALANCE_ABS})",
    )
    r.add_argument(
        "--balance-rel",
        type=float,
        default=DEFAULT_BALANCE_REL,
        help=f"...and busiest/idlest ratio beyond which load wins (default {DEFAULT_BALANCE_REL})",
    )
    r.add_argument("--min-match-pages", type=int, default=DEFAULT_MIN_MATCH_PAGES,
                   help=f"cached pages below which a match is ignored (default {DEFAULT_MIN_MATCH_PAGES})")  # fmt: skip
    r.add_argument("--tie-share", type=float, default=DEFAULT_TIE_SHARE,
                   help="with equal cache hits everywhere, load differences below this share of the tokens to "
                        f"compute are noise: tied replicas take turns (default {DEFAULT_TIE_SHARE})")  # fmt: skip
    w = LoadWeights()
    r.add_argument("--queued-weight", type=float, default=w.queued,
                   help=f"cost of a queued prefill token, in uncached prompt tokens (default {w.queued})")  # fmt: skip
    r.add_argument("--requests-weight", type=float, default=w.requests,
                   help=f"cost of a request running on a replica, in tokens (default {w.requests})")  # fmt: skip
    r.add_argument("--kv-weight", type=float, default=w.kv,
                   help=f"weight of the busy share of a replica's KV pool (default {w.kv})")  # fmt: skip
    r.add_argument("--evict-weight", type=float, default=w.evict,
                   help=f"cost of a cached token a request would push out (default {w.evict})")  # fmt: skip
    r.add_argument("--tier-weight", type=float, default=w.tier,
                   help=f"cost of a token a replica loads from its host-memory or disk tier, in uncached tokens "
                        f"(default {w.tier})")  # fmt: skip
    r.add_argument("--hint-weight", type=float, default=w.hint,
                   help="worth of a prompt token last sent to a replica, when no replica's events show the prompt "
                        f"(after a flush or a reset), in cached tokens (default {w.hint})")  # fmt: skip
    r.add_argument("--store-weight", type=float, default=w.store,
                   help="cost of a token a replica loads from the fleet's store (--kv-remote), in uncached tokens "
                        f"(default {w.store})")  # fmt: skip
    return p


def cluster_options(args: argparse.Namespace, serve_argv: list[str]) -> tuple[ClusterOptions, StorePlan]:
    """The application's options and the store to start from the parsed flags (no Ray, no process): each replica's
    serve flags are the unknown ones plus the store's. OSError / ValueError say what is wrong."""
    from radixcache.cluster.app import ClusterOptions
    from radixcache.cluster.policy import RoutingThresholds
    from radixcache.worker.front.auth import load_token_file

    tokens, admins = load_token_file(args.auth_tokens) if args.auth_tokens else (None, set())
    plan = store_plan(args, serve_argv)
    options = ClusterOptions(
        serve_argv=[*serve_argv, *replica_flags(plan)],
        replicas=args.replicas,
        replica_cpus=args.replica_cpus,
        replica_gpus=args.replica_gpus,
        thresholds=RoutingThresholds(args.balance_abs, args.balance_rel, args.min_match_pages, args.tie_share),
        weights=LoadWeights(
            args.queued_weight,
            args.requests_weight,
            args.kv_weight,
            args.evict_weight,
            args.tier_weight,
            args.hint_weight,
            args.store_weight,
        ),
        auth_tokens=tokens,
        admin_tokens=frozenset(admins),
        grace_period_s=args.grace_period,
        ingress_replicas=args.ingress_replicas,
    )
    return options, plan


def main(argv: list[str]) -> int:
    args, serve_argv = parser().parse_known_args(argv[1:])
    try:
        options, plan = cluster_options(args, serve_argv)
    except (OSError, ValueError) as e:
        print(f"radixcache cluster: {e}", file=sys.stderr)
        return 2
    if plan.start is not None:
        try:
            plan.start.start()
        except RuntimeError as e:
            print(f"radixcache cluster: --kv-remote-start: {e}", file=sys.stderr)
            return 1
        print(f"store: master {plan.start.url}, metadata {plan.start.metadata}", flush=True)
    try:
        return run(args, options, plan.start)
    finally:
        if plan.start is not None:
            plan.start.stop()


def run(args: argparse.Namespace, options: ClusterOptions, store: LocalStore | None = None) -> int:
    """Serves until SIGTERM/SIGINT. With `store` (started here), every other Ray node gets a store service too, and
    so does each node that joins while it serves (store_nodes.NodeServices)."""
    import ray

    from radixcache.cluster.store_nodes import NodeServices

    ray.init(address=args.ray_address, namespace=options.hub_namespace, include_dashboard=False)
    services = None
    if store is not None:
        services = NodeServices(store, ray.util.get_node_ip_address(), ray.nodes)
        try:
            started = services.update()
        except (ValueError, RuntimeError) as e:
            print(f"radixcache cluster: --kv-remote-start: {e}", file=sys.stderr)
            services.close()
            ray.shutdown()
            return 2
        if started:
            print(f"store: a store service on each of {started} more node(s)", flush=True)
        services.watch()  # and on each node that joins later
    try:
        return _serve(args, options)
    finally:
        if services is not None:
            services.close()
        ray.shutdown()


def _serve(args: argparse.Namespace, options: ClusterOptions) -> int:
    """Serve's proxies and the app, until SIGTERM/SIGINT."""
    from ray import serve
    from ray.serve.config import HTTPOptions

    from radixcache.cluster.app import build_app, grpc_options

    serve.start(  # a proxy on every node with a replica: streams spread instead of all crossing the head
        proxy_location="EveryNode",
        grpc_options=grpc_options(args.port),
        http_options=HTTPOptions(host=args.host, port=0),
    )
    serve.run(build_app(options), name=options.app_name)
    print(f"serving on {args.host}:{args.port}", flush=True)
    print(json.dumps({"replicas": args.replicas, "serve_argv": options.serve_argv}), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    return 0
