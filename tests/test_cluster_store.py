"""`radixcache cluster`'s store flags: what every replica's `radixcache serve` gets (no Ray: the options are built
by a pure function), what is refused, and (e2e) that --kv-remote-start's master and store service come up, hold
the memory asked for, and are gone once stopped."""

from __future__ import annotations

import socket
import time

import pytest

from radixcache.cluster.cli import cluster_options, parser
from radixcache.worker.cli import parser as serve_parser


def replica_serve_args(*argv: str):
    """The flags `radixcache cluster ARGV` gives each replica, parsed as `radixcache serve` parses them."""
    args, serve_argv = parser().parse_known_args(list(argv))
    options, plan = cluster_options(args, serve_argv)
    return serve_parser().parse_args(options.replica_argv), plan


def test_kv_remote_reaches_every_replica_with_its_metadata_and_host():
    serve, plan = replica_serve_args(
        "--kv-remote", "mooncake://10.0.0.5:50051", "--kv-remote-metadata", "http://10.0.0.5:8080/metadata",
        "--kv-remote-host", "10.0.0.9", "--page-size", "16",
    )  # fmt: skip
    assert plan.start is None  # an existing store: nothing started here
    assert serve.kv_remote == "mooncake://10.0.0.5:50051"
    assert serve.kv_remote_metadata == "http://10.0.0.5:8080/metadata"
    assert serve.kv_remote_host == "10.0.0.9" and serve.page_size == 16


def test_serves_own_store_flags_pass_through_unabbreviated():
    serve, _ = replica_serve_args(
        "--kv-remote", "mooncake://m:1", "--kv-remote-segment", "64MiB", "--kv-remote-replicas", "2"
    )
    # --kv-remote-segment is serve's flag: the cluster's --kv-remote-segment-bytes must not swallow it.
    assert serve.kv_remote_segment == 64 << 20 and serve.kv_remote_replicas == 2


def test_kv_remote_start_points_every_replica_at_the_store_it_will_start():
    serve, plan = replica_serve_args(
        "--kv-remote-start", "--kv-remote-segment-bytes", "256MiB", "--kv-remote-master-port", "50123"
    )
    store = plan.start
    assert store is not None and store.segment_bytes == 256 << 20 and store.rpc == 50123
    assert not store.procs  # planned, not started
    assert serve.kv_remote == "mooncake://127.0.0.1:50123"
    assert serve.kv_remote_metadata == store.metadata == f"http://127.0.0.1:{store.http}/metadata"
    assert serve.kv_remote_host == "127.0.0.1"  # loopback store: the replicas transfer over loopback too


def test_without_store_flags_replicas_get_no_store():
    serve, plan = replica_serve_args("--page-size", "16")
    assert serve.kv_remote is None and plan.start is None and not plan.join


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--kv-remote", "mooncake://m:1", "--kv-remote-start"], "exclude each other"),
        (["--kv-remote-segment-bytes", "1GiB"], "--kv-remote-segment-bytes"),
        (["--kv-remote", "mooncake://m:1", "--kv-remote-bind", "10.0.0.1"], "--kv-remote-bind"),
        (["--kv-remote-start", "--kv-remote-metadata", "http://m:8080/metadata"], "--kv-remote-metadata"),
        (["--kv-remote", "redis://m:1"], "--kv-remote"),
        (["--kv-remote-start", "--kv-remote-master-port", "70000"], "--kv-remote-master-port"),
        (["--kv-remote-start", "--no-cache"], "needs the cache"),
    ],
)
def test_contradicting_store_flags_are_refused_naming_the_flag(argv, field):
    args, serve_argv = parser().parse_known_args(argv)
    with pytest.raises(ValueError, match=field):
        cluster_options(args, serve_argv)


def test_a_bad_segment_size_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        parser().parse_known_args(["--kv-remote-start", "--kv-remote-segment-bytes", "lots"])
    assert "--kv-remote-segment-bytes" in capsys.readouterr().err


def mooncake_missing() -> str | None:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:  # not installed, or its libibverbs missing (make setup installs both)
        return f"mooncake-transfer-engine-non-cuda cannot import here: {e}"
    return None


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.e2e
def test_kv_remote_start_runs_a_store_a_worker_can_use_and_stops_it():
    if (why := mooncake_missing()) is not None:
        pytest.skip(why)
    from radixcache.object_store import parse_store_url

    args, serve_argv = parser().parse_known_args(["--kv-remote-start", "--kv-remote-segment-bytes", "32MiB"])
    _, plan = cluster_options(args, serve_argv)
    store = plan.start
    assert store is not None
    with store:
        assert store.running() and listening(store.rpc) and listening(store.http)
        assert store.capacity_bytes() == 32 << 20  # the service's segment is the store's memory
        # A client joins with exactly the flags the replicas get, and a page put is a page got.
        from radixcache.mooncake_store import MooncakeObjectStore

        client = MooncakeObjectStore(parse_store_url(store.url), store.metadata, local_host="127.0.0.1")
        try:
            client.connect(10.0)
            client.put("probe", b"x" * 4096, 5.0)
            assert client.get("probe", 5.0) == b"x" * 4096
        finally:
            client.close()
        procs = list(store.procs)
    assert all(p.poll() is not None for p in procs) and not store.procs
    assert not listening(store.rpc) and not listening(store.http)


# ---- a store service on every other node of the Ray cluster ----------------------------------------------------
def ray_nodes(*rows: tuple[str, str, bool]) -> list[dict]:
    """ray.nodes()'s table, as much of it as node_services reads."""
    return [{"NodeID": node, "NodeManagerAddress": address, "Alive": alive} for node, address, alive in rows]


def test_every_other_alive_node_gets_a_store_service_serving_on_its_own_address():
    from types import SimpleNamespace

    from radixcache.cluster.store_nodes import node_services

    store = SimpleNamespace(bind="10.0.0.1", rpc=50051, metadata="http://10.0.0.1:8080/metadata", segment_bytes=1 << 30)
    nodes = ray_nodes(
        ("head", "10.0.0.1", True), ("b", "10.0.0.2", True), ("dead", "10.0.0.3", False), ("c", "10.0.0.4", True)
    )
    services = node_services(nodes, "10.0.0.1", store)  # the head runs the store's own service
    assert [(s.node_id, s.host) for s in services] == [("b", "10.0.0.2"), ("c", "10.0.0.4")]
    for s in services:
        assert s.env["MOONCAKE_MASTER"] == "10.0.0.1:50051"
        assert s.env["MOONCAKE_TE_META_DATA_SERVER"] == store.metadata
        assert s.env["MOONCAKE_LOCAL_HOSTNAME"] == s.env["MC_TCP_BIND_ADDRESS"] == s.host
        assert s.env["MOONCAKE_GLOBAL_SEGMENT_SIZE"] == str(1 << 30)
    assert node_services(ray_nodes(("head", "10.0.0.1", True)), "10.0.0.1", store) == []  # one node: nothing more


@pytest.mark.parametrize("bind", ["127.0.0.1", "0.0.0.0"])
def test_a_store_other_nodes_cannot_reach_is_refused_naming_the_flag(bind):
    from types import SimpleNamespace

    from radixcache.cluster.store_nodes import node_services

    store = SimpleNamespace(bind=bind, rpc=1, metadata=f"http://{bind}:2/metadata", segment_bytes=1)
    with pytest.raises(ValueError, match="--kv-remote-bind"):
        node_services(ray_nodes(("head", "10.0.0.1", True), ("b", "10.0.0.2", True)), "10.0.0.1", store)
    assert node_services(ray_nodes(("head", "10.0.0.1", True)), "10.0.0.1", store) == []  # one node: fine


def test_nodes_that_join_the_running_cluster_get_a_store_service_and_the_dead_are_forgotten():
    from types import SimpleNamespace

    from radixcache.cluster.store_nodes import NodeServices

    store = SimpleNamespace(bind="10.0.0.1", rpc=50051, metadata="http://10.0.0.1:8080/metadata", segment_bytes=1)
    table = ray_nodes(("head", "10.0.0.1", True), ("b", "10.0.0.2", True))
    started, stopped = [], []

    def start(_, services):
        started.append([s.node_id for s in services])
        return [f"actor-{s.node_id}" for s in services]

    services = NodeServices(store, "10.0.0.1", lambda: table, start, stopped.extend, period_s=0.01)
    assert services.update() == 1 and started == [["b"]]
    assert services.update() == 0 and started == [["b"]]  # served already: nothing twice
    table.append({"NodeID": "c", "NodeManagerAddress": "10.0.0.3", "Alive": True})  # an autoscaler's node
    table[1]["Alive"] = False  # b died, its service with it
    assert services.update() == 1 and started[-1] == ["c"] and set(services.handles) == {"c"}
    table[1]["Alive"] = True  # b is back: a new service
    assert services.update() == 1 and started[-1] == ["b"]

    def cannot_start(*_):
        raise RuntimeError("a store service on another node exited")

    failing = NodeServices(store, "10.0.0.1", lambda: table, cannot_start)
    with pytest.raises(RuntimeError, match="exited"):
        failing.update()
    assert failing.handles == {}  # nothing counted as served: tried again next time
    services.watch()  # the thread finds the next node by itself
    table.append({"NodeID": "d", "NodeManagerAddress": "10.0.0.4", "Alive": True})
    deadline = time.monotonic() + 10
    while "d" not in services.handles:
        assert time.monotonic() < deadline, started
        time.sleep(0.01)
    services.close()
    assert sorted(stopped) == ["actor-b", "actor-c", "actor-d"] and services.handles == {}
    assert services.update() == 0  # closed: it starts nothing more


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_a_node_service_run_by_a_ray_actor_adds_its_memory_to_the_store_and_goes_with_it():
    """What start_node_services does on another node, on this one: the actor's service joins the same master (the
    store's memory doubles) and is gone once stopped."""
    if (why := mooncake_missing()) is not None:
        pytest.skip(why)
    import time

    import ray

    from radixcache.cluster.store_nodes import NodeService, start_node_services, stop_node_services
    from radixcache.cluster.store_processes import LocalStore, store_service_env

    segment = 32 << 20
    with LocalStore(segment) as store:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
        try:
            here = ray.get_runtime_context().get_node_id()
            env = store_service_env(f"{store.bind}:{store.rpc}", store.metadata, "127.0.0.1", segment)
            handles = start_node_services(store, [NodeService(here, "127.0.0.1", env)])
            assert store.capacity_bytes() == 2 * segment
            assert ray.get(handles[0].running.remote())
            stop_node_services(handles)
            deadline = time.monotonic() + 30
            while store.capacity_bytes() > segment:  # its segment leaves the store with it
                assert time.monotonic() < deadline, store.capacity_bytes()
                time.sleep(0.2)
        finally:
            ray.shutdown()
