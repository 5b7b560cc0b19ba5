"""The Ray Serve application: EngineReplica x N behind the CacheAwareRouter, and the Ingress (gRPC and OpenAI HTTP)
in front."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixcache.cluster.policy import RoutingThresholds

SERVICER_FUNCTION = "radixcache.v1.radixcache_pb2_grpc.add_RadixCacheServicer_to_server"
ROUTER_CLASS = "radixcache.cluster.router:CacheAwareRouter"


@dataclass
class ClusterOptions:
    serve_argv: list[str] = field(default_factory=list)  # `radixcache serve` model/cache flags, for every replica
    replicas: int = 2
    replica_cpus: float = 1.0  # Ray CPUs per replica; also its torch threads (at least 1)
    thresholds: RoutingThresholds = field(default_factory=RoutingThresholds)
    auth_tokens: dict[str, str] | None = None
    router_class: str = ROUTER_CLASS  # the benchmark swaps in Ray Serve's own routers
    max_ongoing_requests: int = 64  # per replica; beyond it Serve queues at the router
    app_name: str = "radixcache"
    hub_namespace: str = "radixcache"

    @property
    def hub_name(self) -> str:
        return f"{self.app_name}-cache-events"


def page_size_of(serve_argv: list[str]) -> int:
    from radixcache.worker.cli import parser

    return parser().parse_args(serve_argv).page_size


def kv_dtype_of(serve_argv: list[str]) -> str | None:
    """The replicas' --kv-dtype as page hashes need it: None for auto (the model's dtype, full precision: page hashes
    are the same for every full precision)."""
    from radixcache.worker.cli import parser

    kv_dtype = parser().parse_args(serve_argv).kv_dtype
    return None if kv_dtype == "auto" else kv_dtype


def build_app(options: ClusterOptions) -> Any:
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from radixcache.cluster.ingress import Ingress
    from radixcache.cluster.replica import EngineReplica

    router_kwargs: dict[str, Any] = {}
    if options.router_class == ROUTER_CLASS:
        t = options.thresholds
        router_kwargs = dict(
            page_size=page_size_of(options.serve_argv),
            kv_dtype=kv_dtype_of(options.serve_argv),
            hub_name=options.hub_name,
            hub_namespace=options.hub_namespace,
            balance_abs=t.balance_abs,
            balance_rel=t.balance_rel,
            min_match_pages=t.min_match_pages,
        )
    replica = serve.deployment(EngineReplica).options(
        name="EngineReplica",
        num_replicas=options.replicas,
        max_ongoing_requests=options.max_ongoing_requests,
        ray_actor_options={"num_cpus": options.replica_cpus},
        request_router_config=RequestRouterConfig(
            request_router_class=options.router_class, request_router_kwargs=router_kwargs
        ),
    )
    ingress = serve.deployment(serve.ingress()(Ingress)).options(
        name="Ingress", num_replicas=1, max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0}
    )
    threads = max(1, int(options.replica_cpus))
    replica_app = replica.bind(options.serve_argv, options.hub_name, options.hub_namespace, threads)
    return ingress.bind(replica_app, options.auth_tokens)


def grpc_options(port: int) -> Any:
    from ray.serve.config import gRPCOptions

    return gRPCOptions(port=port, grpc_servicer_functions=[SERVICER_FUNCTION])


def app_builder(args: dict[str, Any]) -> Any:
    """Serve's application builder (`import_path: radixcache.cluster.app:app_builder`, as in deploy/rayservice.yaml):
    `args` holds replicas, replica_cpus, serve_argv (a list of `radixcache serve` flags), auth_tokens_file,
    balance_abs, balance_rel and min_match_pages, each optional."""
    from radixcache.worker.auth import load_tokens

    known = {
        "replicas",
        "replica_cpus",
        "serve_argv",
        "auth_tokens_file",
        "balance_abs",
        "balance_rel",
        "min_match_pages",
    }
    unknown = set(args) - known
    if unknown:
        raise ValueError(f"unknown application args {sorted(unknown)}; known: {sorted(known)}")
    defaults = RoutingThresholds()
    tokens_file = args.get("auth_tokens_file")
    options = ClusterOptions(
        serve_argv=[str(a) for a in args.get("serve_argv", [])],
        replicas=int(args.get("replicas", 2)),
        replica_cpus=float(args.get("replica_cpus", 1.0)),
        thresholds=RoutingThresholds(
            int(args.get("balance_abs", defaults.balance_abs)),
            float(args.get("balance_rel", defaults.balance_rel)),
            int(args.get("min_match_pages", defaults.min_match_pages)),
        ),
        auth_tokens=load_tokens(tokens_file) if tokens_file else None,
    )
    return build_app(options)
