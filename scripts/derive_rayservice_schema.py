"""Derive deploy/schema/rayservice-v1.schema.json from KubeRay's RayService CRD, for tests/test_deploy.py; and from
the same CRD's pod template (Kubernetes' own PodTemplateSpec, as KubeRay's release embeds it)
deploy/schema/podtemplate-v1.schema.json, for the pod templates of deploy/mooncake.yaml's Deployment and DaemonSet.

    python scripts/derive_rayservice_schema.py CRD.yaml --source "ray-project/kuberay v1.7.0 (commit ...)"

CRD.yaml is KubeRay's ray-operator/config/crd/bases/ray.io_rayservices.yaml (from a checkout of the tag). The whole
CRD is ~1 MB, nearly all of it Kubernetes' own PodTemplateSpec; the derived schema keeps what deploy/rayservice.yaml
needs checked, walking the CRD's v1 openAPIV3Schema alongside the manifest:
- every field the manifest sets keeps the CRD's type, format, enum, pattern, bounds and `required` list, recursively;
- every field the manifest does not set is kept by name only (any value), and objects the CRD describes field by
  field get `additionalProperties: false`, so a misspelled or misplaced field fails the test (the API server would
  silently drop it: structural schemas prune unknown fields);
- CEL rules (x-kubernetes-validations) are dropped: jsonschema cannot run them.
Rerun it after either manifest sets a new field (the test says which).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
MANIFEST = REPO / "deploy" / "rayservice.yaml"
OUT = REPO / "deploy" / "schema" / "rayservice-v1.schema.json"
STORE_MANIFEST = REPO / "deploy" / "mooncake.yaml"
POD_OUT = REPO / "deploy" / "schema" / "podtemplate-v1.schema.json"
DROPPED = {"properties", "items", "additionalProperties", "x-kubernetes-validations", "description"}


def prune(schema: dict[str, Any], instances: list[Any]) -> dict[str, Any]:
    """`schema` cut down to what `instances` (every value the manifest puts at this place) use."""
    out = {k: v for k, v in schema.items() if k not in DROPPED}
    objects = [i for i in instances if isinstance(i, dict)]
    if "properties" in schema:
        out["properties"] = {
            name: prune(sub, [o[name] for o in objects if name in o]) if any(name in o for o in objects) else {}
            for name, sub in sorted(schema["properties"].items())
        }
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):  # a map (labels, resources.limits): every value the manifest gives
        out["additionalProperties"] = prune(extra, [v for o in objects for v in o.values()])
    elif extra is not None:
        out["additionalProperties"] = extra
    if "items" in schema:
        out["items"] = prune(schema["items"], [x for i in instances if isinstance(i, list) for x in i])
    return out


def derive(crd: dict[str, Any], manifest: dict[str, Any], source: str) -> dict[str, Any]:
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = prune(version["schema"]["openAPIV3Schema"], [manifest])
    return {
        "$comment": f"Derived by scripts/derive_rayservice_schema.py from {source}, "
        "ray-operator/config/crd/bases/ray.io_rayservices.yaml (spec.versions[v1].schema.openAPIV3Schema), "
        "cut down to the fields deploy/rayservice.yaml sets (see the script's docstring). Do not edit.",
        **schema,
    }


def derive_pod_template(crd: dict[str, Any], templates: list[dict[str, Any]], source: str) -> dict[str, Any]:
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    cluster = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["rayClusterConfig"]
    template = cluster["properties"]["headGroupSpec"]["properties"]["template"]
    return {
        "$comment": f"Derived by scripts/derive_rayservice_schema.py from {source}, "
        "ray-operator/config/crd/bases/ray.io_rayservices.yaml (the v1 schema's "
        "spec.rayClusterConfig.headGroupSpec.template: Kubernetes' PodTemplateSpec), cut down to the fields "
        "deploy/mooncake.yaml's pod templates set (see the script's docstring). Do not edit.",
        **prune(template, templates),
    }


def pod_templates(path: Path = STORE_MANIFEST) -> list[dict[str, Any]]:
    """The pod templates of deploy/mooncake.yaml's Deployment and DaemonSet."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return [d["spec"]["template"] for d in docs if d.get("kind") in ("Deployment", "DaemonSet")]


def rayservice(path: Path = MANIFEST) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "RayService"]
    return doc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("crd", type=Path, help="ray.io_rayservices.yaml of a KubeRay checkout")
    p.add_argument("--source", required=True, help='where it came from, e.g. "ray-project/kuberay v1.7.0 (commit X)"')
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--pod-out", type=Path, default=POD_OUT)
    a = p.parse_args()
    crd = yaml.safe_load(a.crd.read_text())
    for out, schema in (
        (a.out, derive(crd, rayservice(), a.source)),
        (a.pod_out, derive_pod_template(crd, pod_templates(), a.source)),
    ):
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(schema, indent=1, sort_keys=False) + "\n")
        print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
