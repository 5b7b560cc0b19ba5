"""The Ray Serve application: EngineReplica x N behind the CacheAwareRouter, and the Ingress (gRPC and OpenAI HTTP)
in front."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixcache.cluster.policy import LoadWeights, RoutingThresholds

SERVICER_FUNCTION = "radixcache.v1.radixcache_pb2_grpc.add_RadixCacheServicer_to_server"
ROUTER_CLASS = "radixcache.cluster.router:CacheAwareRouter"
DRAIN_MARGIN_S = 5.0
AUTOSCALING_KEYS = {"min_replicas", "max_replicas", "initial_replicas", "target_ongoing_requests"}


@dataclass
class ClusterOptions:
    serve_argv: list[str] = field(default_factory=list)  # `radixcache serve` model/cache flags, for every replica
    replicas: int = 2
    replica_cpus: float = 1.0  # Ray CPUs per replica; also its torch threads (at least 1)
    replica_gpus: float = 0.0  # Ray GPUs per replica; > 0 runs the engine on CUDA (--device cuda unless given)
    # Serve autoscaling of the engine replicas (min_replicas, max_replicas, initial_replicas,
    # target_ongoing_requests); None: a fixed `replicas`.
    autoscaling: dict[str, Any] | None = None
    thresholds: RoutingThresholds = field(default_factory=RoutingThresholds)
    weights: LoadWeights = field(default_factory=LoadWeights)
    inflight_ttl_s: float = 30.0  # how long a routed prompt counts as cached there without a stored event
    auth_tokens: dict[str, str] | None = None
    admin_tokens: frozenset[str] = frozenset()  # tokens (among auth_tokens) that may read every replica's cache events
    router_class: str = ROUTER_CLASS  # the benchmark swaps in Ray Serve's own routers
    max_ongoing_requests: int = 64  # per replica; beyond it Serve queues at the router
    ingress_replicas: int = 1  # more spread the streams (each ingress relays its own; Abort reaches across them)
    grace_period_s: float = 30.0  # a replica being stopped lets its streams run this long, then hands them back
    app_name: str = "radixcache"
    hub_namespace: str = "radixcache"

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.replica_cpus <= 0:
            raise ValueError(f"replica_cpus must be > 0, got {self.replica_cpus}")
        if self.replica_gpus < 0:
            raise ValueError(f"replica_gpus must be >= 0, got {self.replica_gpus}")
        if self.ingress_replicas < 1:
            raise ValueError(f"ingress_replicas must be >= 1, got {self.ingress_replicas}")
        if self.grace_period_s < 0:
            raise ValueError(f"grace_period_s must be >= 0, got {self.grace_period_s}")
        if self.autoscaling is not None:
            unknown = set(self.autoscaling) - AUTOSCALING_KEYS
            if unknown:
                raise ValueError(f"autoscaling: unknown keys {sorted(unknown)}; known: {sorted(AUTOSCALING_KEYS)}")
            low, high = self.autoscaling.get("min_replicas", 1), self.autoscaling.get("max_replicas", 1)
            if not 1 <= low <= high:
                raise ValueError(f"autoscaling: need 1 <= min_replicas <= max_replicas, got {low} and {high}")

    @property
    def hub_name(self) -> str:
        return f"{self.app_name}-cache-events"

    @property
    def replica_argv(self) -> list[str]:
        """serve_argv as each replica parses it: on a GPU replica the engine runs on CUDA unless told otherwise."""
        if self.replica_gpus > 0 and not any(a == "--device" or a.startswith("--device=") for a in self.serve_argv):
            return [*self.serve_argv, "--device", "cuda"]
        return list(self.serve_argv)


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
        t, w = options.thresholds, options.weights
        router_kwargs = dict(
            page_size=page_size_of(options.serve_argv),
            kv_dtype=kv_dtype_of(options.serve_argv),
            hub_name=options.hub_name,
            hub_namespace=options.hub_namespace,
            balance_abs=t.balance_abs,
            balance_rel=t.balance_rel,
            min_match_pages=t.min_match_pages,
            tie_share=t.tie_share,
            inflight_ttl_s=options.inflight_ttl_s,
            queued_weight=w.queued,
            requests_weight=w.requests,
            kv_weight=w.kv,
            evict_weight=w.evict,
            tier_weight=w.tier,
            hint_weight=w.hint,
            store_weight=w.store,
        )
    scaling: dict[str, Any] = (
        {"autoscaling_config": dict(options.autoscaling)} if options.autoscaling else {"num_replicas": options.replicas}
    )
    actor_options: dict[str, Any] = {"num_cpus": options.replica_cpus}
    if options.replica_gpus:
        actor_options["num_gpus"] = options.replica_gpus
    replica = serve.deployment(EngineReplica).options(
        name="EngineReplica",
        max_ongoing_requests=options.max_ongoing_requests,
        ray_actor_options=actor_options,
        request_router_config=RequestRouterConfig(
            request_router_class=options.router_class, request_router_kwargs=router_kwargs
        ),
        # Serve waits for a stopping replica's requests this long before killing it: the grace period, plus the
        # time it takes to learn it is stopping (a report period) and to send the streams' last messages.
        graceful_shutdown_timeout_s=options.grace_period_s + DRAIN_MARGIN_S,
        graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=10.0,
        health_check_timeout_s=30.0,
        **scaling,
    )
    ingress = serve.deployment(serve.ingress()(Ingress)).options(
        name="Ingress",
        num_replicas=options.ingress_replicas,
        max_ongoing_requests=4096,
        ray_actor_options={"num_cpus": 0},
    )
    threads = max(1, int(options.replica_cpus))
    replica_app = replica.bind(
        options.replica_argv, options.hub_name, options.hub_namespace, threads, options.grace_period_s
    )
    return ingress.bind(replica_app, options.auth_tokens, frozenset(options.admin_tokens))


def grpc_options(port: int) -> Any:
    from ray.serve.config import gRPCOptions

    return gRPCOptions(port=port, grpc_servicer_functions=[SERVICER_FUNCTION])


APP_ARGS = {
    "replicas": "engine replicas (a fixed number; or give autoscaling)",
    "autoscaling": "Serve autoscaling of the engine replicas: min_replicas, max_replicas, target_ongoing_requests",
    "replica_cpus": "Ray CPUs per replica, and its torch threads",
    "replica_gpus": "Ray GPUs per replica (0: CPU engines); > 0 adds --device cuda unless serve_argv gives a device",
    "serve_argv": "a list of `radixcache serve` model and cache flags, for every replica",
    "auth_tokens_file": "a tokens file, as for `radixcache serve --auth-tokens` (mount it from a Secret)",
    "ingress_replicas": "gRPC/HTTP ingress replicas (each relays its own streams; default 1)",
    "grace_period_s": "a replica being stopped lets its streams run this long, then ends them with UNAVAILABLE",
    "balance_abs": "routing: request-count gap beyond which load wins over cache",
    "balance_rel": "routing: ...and busiest/idlest ratio beyond which load wins",
    "min_match_pages": "routing: cached pages below which a match is ignored",
    "queued_weight": "routing: cost of one queued prefill token, in uncached prompt tokens",
    "requests_weight": "routing: cost of one running request, in tokens",
    "kv_weight": "routing: weight of the busy share of a KV pool",
    "evict_weight": "routing: cost of one cached token pushed out",
    "tier_weight": "routing: cost of one token loaded from a replica's host-memory or disk tier, in uncached tokens",
    "hint_weight": "routing: worth of a prompt token last sent to a replica when no events show the prompt",
    "tie_share": "routing: with equal hits everywhere, load differences below this share of the tokens are noise",
    "store_weight": "routing: cost of one token loaded from the fleet's store (serve --kv-remote), in uncached tokens",
}


def options_from_args(args: dict[str, Any]) -> ClusterOptions:
    """ClusterOptions from a Serve config's `args` (APP_ARGS names them, each optional); ValueError names a bad or
    unknown one. Reads the tokens file."""
    from radixcache.worker.front.auth import load_token_file

    unknown = set(args) - set(APP_ARGS)
    if unknown:
        raise ValueError(f"unknown application args {sorted(unknown)}; known: {sorted(APP_ARGS)}")
    t, w = RoutingThresholds(), LoadWeights()
    tokens_file = args.get("auth_tokens_file")
    tokens, admins = load_token_file(tokens_file) if tokens_file else (None, set())
    serve_argv = args.get("serve_argv", [])
    if not isinstance(serve_argv, list):
        raise ValueError(f"serve_argv must be a list of flags, got {type(serve_argv).__name__}")
    autoscaling = args.get("autoscaling")
    if autoscaling is not None and not isinstance(autoscaling, dict):
        raise ValueError(f"autoscaling must be a mapping, got {type(autoscaling).__name__}")
    return ClusterOptions(
        serve_argv=[str(a) for a in serve_argv],
        replicas=int(args.get("replicas", 2)),
        replica_cpus=float(args.get("replica_cpus", 1.0)),
        replica_gpus=float(args.get("replica_gpus", 0.0)),
        autoscaling=dict(autoscaling) if autoscaling else None,
        thresholds=RoutingThresholds(
            int(args.get("balance_abs", t.balance_abs)),
            float(args.get("balance_rel", t.balance_rel)),
            int(args.get("min_match_pages", t.min_match_pages)),
            float(args.get("tie_share", t.tie_share)),
        ),
        weights=LoadWeights(
            float(args.get("queued_weight", w.queued)),
            float(args.get("requests_weight", w.requests)),
            float(args.get("kv_weight", w.kv)),
            float(args.get("evict_weight", w.evict)),
            float(args.get("tier_weight", w.tier)),
            float(args.get("hint_weight", w.hint)),
            float(args.get("store_weight", w.store)),
        ),
        auth_tokens=tokens,
        admin_tokens=frozenset(admins),
        grace_period_s=float(args.get("grace_period_s", 30.0)),
        ingress_replicas=int(args.get("ingress_replicas", 1)),
    )


def app_builder(args: dict[str, Any]) -> Any:
    """Serve's application builder (`import_path: radixcache.cluster.app:app_builder`, as in deploy/rayservice.yaml);
    `args` as `options_from_args` reads them."""
    return build_app(options_from_args(args))
