"""deploy/ checked without Kubernetes or Docker (neither runs here): the RayService against KubeRay's schema for it,
its Serve config against Serve's own schema and our app builder, how its parts fit together, and the Dockerfiles.

The schema is derived from KubeRay v1.7.0's RayService CRD by scripts/derive_rayservice_schema.py (the file names
its source): the CRD's types, bounds and required fields for every field the manifest sets, and no field it does
not know.
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
from derive_rayservice_schema import rayservice  # noqa: E402

from radixcache.cluster.app import SERVICER_FUNCTION, ClusterOptions, app_builder, options_from_args  # noqa: E402


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
    assert "wget" in text  # KubeRay's probes need it
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ignored[ignored.index("*") :] and all(f"!{d}/" in ignored for d in ("radixcache", "worker", "client"))
