"""deploy/ checked without Kubernetes or Docker (neither runs here): the RayService against KubeRay's schema for it,
its Serve config against Serve's own schema and our app builder, how its parts fit together, and the Dockerfiles.

The schema is derived from KubeRay v1.7.0's RayService CRD by scripts/derive_rayservice_schema.py (the file names
its source): the CRD's types, bounds and required fields for every field the manifest sets, and no field it does
not know.

The fleet's store (deploy/mooncake.yaml): its master and store services run the flags and environment that
cluster/store_processes.py builds for `radixcache cluster --kv-remote-start` (the same functions), at the ports the
RayService's --kv-remote flags name, sized to their memory, unprivileged, reachable only from the engine pods; its
pod templates against Kubernetes' PodTemplateSpec as the same CRD embeds it (deploy/schema/podtemplate-v1.schema.json,
derived by the same script).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
sys.path.insert(0, str(REPO / "scripts"))
from derive_rayservice_schema import pod_templates, rayservice  # noqa: E402

from radixcache.cluster.app import SERVICER_FUNCTION, ClusterOptions, app_builder, options_from_args  # noqa: E402
from radixcache.cluster.store_processes import (  # noqa: E402
    LocalStore,
    master_flags,
    metadata_url,
    store_service_argv,
    store_service_env,
    store_url,
)


def manifest_docs() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "rayservice.yaml").read_text()) if d}


def serve_config() -> dict:
    return yaml.safe_load(rayservice()["spec"]["serveConfigV2"])


def app_args() -> dict:
    (app,) = serve_config()["applications"]
    return app["args"]


def pinned_ray() -> str:
    (pin,) = set(re.findall(r'"ray\[serve\]==([0-9.]+)"', (REPO / "pyproject.toml").read_text()))
    return pin


def validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(json.loads((DEPLOY / "schema" / "rayservice-v1.schema.json").read_text()))


def test_the_rayservice_fits_kuberays_schema():
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator().iter_errors(rayservice())]
    assert not errors, f"{errors} (a field new to the manifest: rerun scripts/derive_rayservice_schema.py)"
    # The schema can fail: a misspelled field, a wrong type, a missing required field.
    for path, value in (("minReplica", 1), ("maxReplicas", "eight")):
        broken = rayservice()
        broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0][path] = value
        assert list(validator().iter_errors(broken)), path
    broken = rayservice()
    del broken["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    assert list(validator().iter_errors(broken))


def test_the_serve_config_passes_serves_schema_and_our_app_builder(tmp_path):
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(serve_config())  # what `serve deploy` and KubeRay's agent check
    assert config.proxy_location.value == "EveryNode"  # a proxy on every node: no single pod carries every stream
    (app,) = config.applications
    module, name = app.import_path.split(":")
    assert (module, name) == ("radixcache.cluster.app", "app_builder") and app_builder is not None
    args = dict(app.args)
    secret = manifest_docs()["Secret"]["stringData"]["tokens.txt"]  # the example tokens file must load
    (tmp_path / "tokens.txt").write_text(secret)
    args["auth_tokens_file"] = str(tmp_path / "tokens.txt")
    options = options_from_args(args)
    assert options.autoscaling == {"min_replicas": 2, "max_replicas": 8, "target_ongoing_requests": 16}
    assert options.auth_tokens and set(options.auth_tokens.values()) == {"team-a", "team-b", "ops"}
    from radixcache.worker.cli import parser

    parser().parse_args(options.replica_argv)  # every replica parses its flags as `radixcache serve` does


def test_app_builder_takes_a_gpu_count_and_refuses_what_it_does_not_know():
    gpu = options_from_args({"replica_gpus": 1, "serve_argv": ["--page-size", "16"]})
    assert gpu.replica_gpus == 1 and gpu.replica_argv == ["--page-size", "16", "--device", "cuda"]
    own = options_from_args({"replica_gpus": 1, "serve_argv": ["--device", "cuda:1"]})
    assert own.replica_argv == ["--device", "cuda:1"]  # a device given is kept
    assert options_from_args({}).replica_argv == []  # CPU replicas: the flags as given
    with pytest.raises(ValueError, match="unknown application args.*gpus"):
        options_from_args({"gpus": 1})
    with pytest.raises(ValueError, match="min_replicas <= max_replicas"):
        options_from_args({"autoscaling": {"min_replicas": 4, "max_replicas": 2}})
    with pytest.raises(ValueError, match="unknown keys"):
        options_from_args({"autoscaling": {"max_replica": 2}})
    with pytest.raises(ValueError, match="replica_gpus"):
        ClusterOptions(replica_gpus=-1)


def containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def test_the_parts_fit_together():
    service = rayservice()
    cluster = service["spec"]["rayClusterConfig"]
    config, args = serve_config(), app_args()
    head, workers = cluster["headGroupSpec"], {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    # Ports: Serve's proxies listen where the pods and the Service say, under the names KubeRay looks for.
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000}
    assert config["grpc_options"]["port"] == 9000
    assert config["grpc_options"]["grpc_servicer_functions"] == [SERVICER_FUNCTION]
    ports = {p["name"]: p["port"] for p in service["spec"]["serveService"]["spec"]["ports"]}
    assert ports == {"serve": 8000, "serve-grpc": 9000}
    for group in [head, *workers.values()]:
        (ray_container,) = containers(group)
        named = {p["name"]: p["containerPort"] for p in ray_container["ports"]}
        assert named["serve"] == 8000 and named["serve-grpc"] == 9000  # KubeRay's readiness probe asks "serve"
    # Versions: KubeRay's rayVersion is the one Ray the package pins, and the one installed here.
    import ray

    assert cluster["rayVersion"] == pinned_ray() == ray.__version__
    # Resources: a replica fits its pod with room for Ray's own processes; the head runs no engine.
    assert head["rayStartParams"]["num-cpus"] == "0"
    cpu, gpu = workers["cpu-engines"], workers["gpu-engines"]
    for group in (cpu, gpu):
        requests = containers(group)[0]["resources"]["requests"]
        assert args["replica_cpus"] <= float(group["rayStartParams"]["num-cpus"]) < float(requests["cpu"])
        assert containers(group)[0]["resources"]["limits"] == requests
    gpu_resources = containers(gpu)[0]["resources"]
    assert gpu_resources["limits"]["nvidia.com/gpu"] == gpu["rayStartParams"]["num-gpus"] == "1"
    assert "nvidia.com/gpu" not in containers(cpu)[0]["resources"]["limits"]
    assert "cuda" in containers(gpu)[0]["image"] and "cpu" in containers(cpu)[0]["image"]
    # Autoscaling: Serve's bounds within what the pods can hold (one replica per pod).
    assert cluster["enableInTreeAutoscaling"] is True
    scaling = args["autoscaling"]
    assert 1 <= cpu["minReplicas"] <= scaling["min_replicas"] <= scaling["max_replicas"] <= cpu["maxReplicas"]
    assert gpu["minReplicas"] == 0 < gpu["maxReplicas"]  # GPUs only when the replicas ask for them
    # The tokens file comes from the Secret, mounted wherever an ingress or a replica may run.
    tokens_dir = str(Path(args["auth_tokens_file"]).parent)
    assert manifest_docs()["Secret"]["metadata"]["name"] == "radixcache-tokens"
    for group in [head, *workers.values()]:
        spec = group["template"]["spec"]
        secret_volumes = {v["name"] for v in spec["volumes"] if v.get("secret", {}).get("secretName") == "radixcache-tokens"}  # fmt: skip
        mounts = {m["name"]: m for m in containers(group)[0]["volumeMounts"]}
        assert any(mounts.get(v, {}).get("mountPath") == tokens_dir for v in secret_volumes), group.get("groupName")
    # The model: serve_argv's path is a volume every engine pod mounts, filled by its init container.
    model = args["serve_argv"][args["serve_argv"].index("--model") + 1]
    for group in (cpu, gpu):
        spec = group["template"]["spec"]
        mounts = {m["mountPath"]: m["name"] for m in containers(group)[0]["volumeMounts"]}
        (fetch,) = spec["initContainers"]
        assert mounts[model] == fetch["volumeMounts"][0]["name"] and fetch["volumeMounts"][0]["mountPath"] == model


@pytest.mark.parametrize("name, extra", [("Dockerfile.cpu", "cluster"), ("Dockerfile.cuda", "cuda")])
def test_the_dockerfiles_install_the_package_from_the_build_context(name, extra):
    text = (DEPLOY / name).read_text()
    assert f'"ray[serve]=={pinned_ray()}"' in text  # exactly the pin, checked again when the image is built
    for package_dir in ("radixcache", "worker", "client", "cluster"):
        assert f"COPY {package_dir} {package_dir}" in text
    (install,) = re.findall(r'pip install --no-cache-dir "\.\[([a-z,]+)\]"', text)  # this context, not an index
    assert extra in install.split(",") and "cluster" in install.split(",")
    # The fleet's store: the store extra (its client and binaries, deploy/mooncake.yaml runs them from this image),
    # and the libibverbs1 its binaries link even for TCP, installed as the image installs its other packages.
    assert "store" in install.split(",") and "mooncake-transfer-engine-non-cuda" in store_extra()
    (apt,) = [line for line in re.split(r"(?<!\\)\n", text) if "apt-get install" in line]
    packages = re.search(r"apt-get install -y --no-install-recommends ([^&]+)", apt)
    assert packages and {"wget", "libibverbs1"} <= set(packages.group(1).replace("\\", " ").split())  # probes: wget
    assert "apt-get update" in apt and "rm -rf /var/lib/apt/lists/*" in apt
    assert 'python -c "import mooncake.store"' in text  # the build fails if the client cannot load
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ignored[ignored.index("*") :] and all(f"!{d}/" in ignored for d in ("radixcache", "worker", "client"))


# The fleet's store: deploy/mooncake.yaml.

STORE_OBJECTS = {  # what deploy/README.md lists, kind and name
    ("Deployment", "radixcache-store-master"),
    ("Service", "radixcache-store-master"),
    ("DaemonSet", "radixcache-store"),
    ("NetworkPolicy", "radixcache-store-master"),
    ("NetworkPolicy", "radixcache-store"),
}
QUANTITY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "m": 1e-3, "": 1}


def quantity(value: str | int | float) -> float:
    """A Kubernetes quantity (5Gi, 250m, "7") as a number: bytes or CPUs."""
    parsed = re.fullmatch(r"([0-9.]+)(Ki|Mi|Gi|Ti|m|)", str(value))
    assert parsed, value
    return float(parsed.group(1)) * QUANTITY[parsed.group(2)]


def store_extra() -> str:
    (extra,) = re.findall(r"^store = \[(.*)\]$", (REPO / "pyproject.toml").read_text(), re.M)
    return extra


def store_docs() -> dict[tuple[str, str], dict]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "mooncake.yaml").read_text()) if d]
    named = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(named) == len(docs), "two objects of one kind and name"
    return named


def store_master() -> tuple[dict, dict]:
    """The master's container, and its Service."""
    docs = store_docs()
    (master,) = docs["Deployment", "radixcache-store-master"]["spec"]["template"]["spec"]["containers"]
    return master, docs["Service", "radixcache-store-master"]


def store_service() -> dict:
    (container,) = store_docs()["DaemonSet", "radixcache-store"]["spec"]["template"]["spec"]["containers"]
    return container


def named_ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def plain_env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def serve_flag(name: str) -> str:
    argv = app_args()["serve_argv"]
    return argv[argv.index(name) + 1]


def assert_pod_ip(container: dict) -> None:
    """POD_IP comes from the downward API (the pod's own IP), defined before the values that use it."""
    names = [e["name"] for e in container["env"]]
    (pod_ip,) = [e for e in container["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    for i, e in enumerate(container["env"]):
        if "$(POD_IP)" in e.get("value", ""):
            assert names.index("POD_IP") < i, e["name"]  # Kubernetes expands only variables defined earlier


def test_the_store_manifest_holds_what_the_readme_lists():
    docs = store_docs()
    assert set(docs) == STORE_OBJECTS
    readme = (DEPLOY / "README.md").read_text()
    assert "deploy/mooncake.yaml" in readme or "`mooncake.yaml`" in readme
    for kind, name in STORE_OBJECTS:
        assert any(kind in line and f"`{name}`" in line for line in readme.splitlines()), (kind, name)
    expected_api = {"Deployment": "apps/v1", "DaemonSet": "apps/v1", "Service": "v1", "NetworkPolicy": "networking.k8s.io/v1"}  # fmt: skip
    for (kind, name), doc in docs.items():
        assert doc["apiVersion"] == expected_api[kind], name
    master = docs["Deployment", "radixcache-store-master"]["spec"]
    assert master["replicas"] == 1 and master["strategy"]["type"] == "Recreate"  # never two masters
    for kind, name in (("Deployment", "radixcache-store-master"), ("DaemonSet", "radixcache-store")):
        spec = docs[kind, name]["spec"]
        assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items(), name
    service = docs["Service", "radixcache-store-master"]["spec"]
    assert service["selector"].items() <= master["template"]["metadata"]["labels"].items()


def test_the_store_pods_fit_kubernetes_pod_template_schema():
    """The Deployment's and the DaemonSet's pod templates against Kubernetes' PodTemplateSpec (as KubeRay v1.7.0's
    CRD embeds it, cut down by scripts/derive_rayservice_schema.py like the RayService's)."""
    schema = json.loads((DEPLOY / "schema" / "podtemplate-v1.schema.json").read_text())
    check = jsonschema.Draft7Validator(schema)
    for template in pod_templates():
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in check.iter_errors(template)]
        assert not errors, f"{errors} (a field new to the manifest: rerun scripts/derive_rayservice_schema.py)"
    # It can fail: a misplaced probe field, a label that is not a string, a malformed quantity.
    for path, value in (
        (("spec", "containers", 0, "readinessProbe", "tcpSocket", "portt"), 8090),
        (("metadata", "labels", "app.kubernetes.io/name"), True),
        (("spec", "containers", 0, "resources", "limits", "memory"), "5 GiB"),
    ):
        broken = pod_templates()[1]
        node = broken
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        assert list(check.iter_errors(broken)), path


def test_the_master_runs_localstores_flags_where_the_rayservice_looks_for_it():
    master, service = store_master()
    ports = named_ports(master)
    assert master["command"] == ["mooncake_master"]
    assert master["args"] == master_flags("$(POD_IP)", ports["rpc"], ports["metadata"], ports["metrics"])
    assert_pod_ip(master)
    # The Service: the RPC and metadata ports, by the container's names, at the ports the replicas are given.
    svc_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(svc_ports) == {"rpc", "metadata"}  # metrics (and its admin API) stay off the Service
    for name, port in svc_ports.items():
        assert port["targetPort"] in (name, ports[name]), name
    host = service["metadata"]["name"]
    assert serve_flag("--kv-remote") == store_url(host, svc_ports["rpc"]["port"])
    assert serve_flag("--kv-remote-metadata") == metadata_url(host, svc_ports["metadata"]["port"])
    from radixcache.object_store import parse_store_url

    assert parse_store_url(serve_flag("--kv-remote")).host == host
    # Probes ask the master itself: /health on its metrics port, and its RPC port.
    assert master["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert master["livenessProbe"]["tcpSocket"]["port"] in ports


def test_the_store_service_runs_localstores_command_and_environment():
    container = store_service()
    master, service = store_master()
    ports, svc_ports = named_ports(container), {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert container["command"] == store_service_argv("python", ports["api"])
    env = plain_env(container)
    segment = int(env["MOONCAKE_GLOBAL_SEGMENT_SIZE"])
    host = service["metadata"]["name"]
    expected = store_service_env(f"{host}:{svc_ports['rpc']}", metadata_url(host, svc_ports["metadata"]), "$(POD_IP)", segment)  # fmt: skip
    assert {k: v for k, v in env.items() if k in expected} == expected
    assert_pod_ip(container)
    # The same master and metadata server as the replicas (through the same Service).
    assert "mooncake://" + env["MOONCAKE_MASTER"] == serve_flag("--kv-remote")
    assert env["MOONCAKE_TE_META_DATA_SERVER"] == serve_flag("--kv-remote-metadata")
    # Probes: the HTTP API, which opens only once the service has joined the master with its memory.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["tcpSocket"]["port"] in ("api", ports["api"]), probe
    # Memory: the segment and the process around it (~100 MiB measured), held whole (requests = limits).
    resources = container["resources"]
    assert quantity(resources["limits"]["memory"]) >= segment + (512 << 20)
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    assert segment > 0


def test_localstore_runs_what_the_manifests_run(monkeypatch):
    """The manifests are checked against master_flags / store_service_*: LocalStore must start exactly those."""
    spawned: list[tuple[list[str], dict[str, str]]] = []
    store = LocalStore(64 << 20, master_port=50051, metadata_port=8080)
    monkeypatch.setattr(store, "_spawn", lambda argv, env: spawned.append((argv, env)))
    monkeypatch.setattr(store, "capacity_bytes", lambda: 1.0)
    store.start()
    (master_argv, _), (service_argv, service_env) = spawned
    assert Path(master_argv[0]).name == "mooncake_master"
    assert master_argv[1:] == master_flags(store.bind, 50051, 8080, store.metrics)
    assert service_argv == store_service_argv(sys.executable, store.service_port)
    expected = store_service_env(f"{store.bind}:50051", store.metadata, store.bind, 64 << 20)
    assert {k: service_env[k] for k in expected} == expected
    assert store.url == store_url(store.bind, 50051) and store.metadata == metadata_url(store.bind, 8080)


def test_the_store_pods_are_unprivileged_and_use_the_workers_image():
    cpu_image = containers(rayservice_group("cpu-engines"))[0]["image"]
    for kind, name in (("Deployment", "radixcache-store-master"), ("DaemonSet", "radixcache-store")):
        spec = store_docs()[kind, name]["spec"]["template"]["spec"]
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), name
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context.get("privileged", False) is False and context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"] and "add" not in context["capabilities"]
            assert container["image"] == cpu_image, name  # the image that installs the store extra
        assert not any("hostPath" in v for v in spec.get("volumes", [])), name
    # Every node that may run an engine runs a store service: the GPU nodes' taint is tolerated.
    daemon = store_docs()["DaemonSet", "radixcache-store"]["spec"]["template"]["spec"]
    gpu_tolerations = rayservice_group("gpu-engines")["template"]["spec"]["tolerations"]
    assert all(t in daemon["tolerations"] for t in gpu_tolerations)


def rayservice_group(name: str) -> dict:
    (group,) = [g for g in rayservice()["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == name]
    return group


def test_only_the_engine_pods_reach_the_store():
    docs = store_docs()
    clients = [rayservice_group(g)["template"]["metadata"]["labels"] for g in ("cpu-engines", "gpu-engines")]
    master_labels = docs["Deployment", "radixcache-store-master"]["spec"]["template"]["metadata"]["labels"]
    store_labels = docs["DaemonSet", "radixcache-store"]["spec"]["template"]["metadata"]["labels"]
    head = rayservice()["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    for name, selected, allowed in (
        ("radixcache-store-master", master_labels, [*clients, store_labels]),
        ("radixcache-store", store_labels, clients),
    ):
        spec = docs["NetworkPolicy", name]["spec"]
        assert spec["policyTypes"] == ["Ingress"] and spec["podSelector"]["matchLabels"].items() <= selected.items()
        (rule,) = spec["ingress"]
        sources = [peer["podSelector"]["matchLabels"] for peer in rule["from"]]
        assert all(set(peer) == {"podSelector"} for peer in rule["from"]), name  # no namespace-wide or IP rules
        for labels in allowed:  # each allowed pod is matched by some source...
            assert any(source.items() <= labels.items() for source in sources), (name, labels)
        for source in sources:  # ...and no source matches the head (it runs no replica) or every pod
            assert source and not source.items() <= head.get("metadata", {}).get("labels", {}).items(), name
    # The master's rule opens its RPC and metadata ports only (not metrics, whose admin API can empty the store).
    (rule,) = docs["NetworkPolicy", "radixcache-store-master"]["spec"]["ingress"]
    master, _ = store_master()
    assert {p["port"] for p in rule["ports"]} == {"rpc", "metadata"} and {"rpc", "metadata"} <= set(named_ports(master))  # fmt: skip


def test_an_engine_pod_and_its_nodes_store_service_fit_the_node():
    """deploy/README.md: pods are sized for 8-vCPU / 32-GiB nodes, of which 7.25 CPUs and 28 GiB are left for them."""
    store = store_service()["resources"]["requests"]
    for group in ("cpu-engines", "gpu-engines"):
        engine = containers(rayservice_group(group))[0]["resources"]["requests"]
        assert quantity(engine["cpu"]) + quantity(store["cpu"]) <= 7.25, group
        assert quantity(engine["memory"]) + quantity(store["memory"]) <= 28 * (1 << 30), group
