"""Offline validation of the cluster manifests in infra/ (docs/deploy.md): no cloud, no
Kubernetes, no network.

- KubeRay: every RayCluster and RayJob in infra/k8s/ validates against the ``openAPIV3Schema`` of
  version ``v1`` of the CRDs vendored in infra/k8s/crds/ (converted to JSON Schema with the
  checks the API server makes), and broken copies of them fail.
- Ray cluster launcher: infra/cluster/*.yaml validate against the ``ray-schema.json`` of the
  installed ``ray`` and pass the config preparation ``ray up`` runs before calling the cloud.
- The settings that must hold on a multi-node cluster: token auth everywhere, one Ray version
  (the installed one) in every image, no loopback address, secrets only from Secrets.
- The helper scripts of infra/cluster/ (node-env.sh, bundle.py, request_resources.py).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import ray
import yaml

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "infra" / "cluster"
K8S = ROOT / "infra" / "k8s"
CRDS = K8S / "crds"
DOCS = ROOT / "docs" / "deploy.md"
FIG3A = "experiments/paper/fig3a.yaml"
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are 2 MB of YAML
LIST_MAP_KEYS = "listMapKeys"  # our keyword for x-kubernetes-list-type: map


# ---------------------------------------------------------------------------------------------
# Loading


def _load_all(path: Path) -> list[dict]:
    return [d for d in yaml.load_all(path.read_text(), Loader=LOADER) if d]


def k8s_files() -> list[Path]:
    return sorted(K8S.glob("*.yaml"))


def k8s_docs() -> list[tuple[str, dict]]:
    return [(f"{p.name}:{d['kind']}", d) for p in k8s_files() for d in _load_all(p)]


def ray_docs() -> list[tuple[str, dict]]:
    return [(n, d) for n, d in k8s_docs() if d["apiVersion"].startswith("ray.io/")]


def doc_of(kind: str) -> dict:
    found = [d for _, d in k8s_docs() if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in infra/k8s, found {len(found)}"
    return found[0]


def launcher_files() -> list[Path]:
    return sorted(CLUSTER.glob("*.yaml"))


def load_launcher(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=LOADER)


def cluster_spec(doc: dict) -> dict:
    """The RayClusterSpec of a RayCluster or a RayJob."""
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


def pod_templates(doc: dict) -> list[dict]:
    """Every pod template of a manifest (head and worker groups; a Deployment's template)."""
    if doc["kind"] in ("RayCluster", "RayJob"):
        spec = cluster_spec(doc)
        return [spec["headGroupSpec"]["template"]] + [
            g["template"] for g in spec.get("workerGroupSpecs", [])]
    if doc["kind"] == "Deployment":
        return [doc["spec"]["template"]]
    return []


def containers(doc: dict) -> list[dict]:
    return [c for t in pod_templates(doc) for c in t["spec"]["containers"]]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def from_secret(entry: dict) -> bool:
    return "secretKeyRef" in entry.get("valueFrom", {})


def refs(text: str) -> list[str]:
    """The ``$(VAR)`` references that Kubernetes expands in ``text`` (``$$(`` escapes)."""
    return re.findall(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)", text)


def load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# CRD openAPIV3Schema -> JSON Schema

SCHEMA_MAPS = ("properties", "patternProperties")
SCHEMA_LISTS = ("anyOf", "allOf", "oneOf")
SCHEMA_ONE = ("items", "additionalProperties", "not")


def to_json_schema(node: dict) -> dict:
    """A CRD's structural OpenAPI v3 schema as JSON Schema (draft 4), keeping every ``type``,
    ``required``, ``enum``, ``pattern``, ``format`` and bound, with the Kubernetes extensions
    turned into the checks the API server makes:

    - ``x-kubernetes-int-or-string``: integer or string (``anyOf``, added where missing);
    - ``x-kubernetes-list-type: set``: ``uniqueItems``; ``map``: no two items with the same
      ``x-kubernetes-list-map-keys`` (defaults of the key fields applied), keyword ``listMapKeys``;
    - ``nullable``: null allowed;
    - an object with ``properties`` and neither ``additionalProperties`` nor
      ``x-kubernetes-preserve-unknown-fields`` rejects unknown fields, as ``kubectl apply`` does
      with its default ``--validate=strict``;
    - ``x-kubernetes-validations`` (CEL) cannot be evaluated here:
      ``test_manifests_set_no_field_guarded_by_cel_rules`` keeps the manifests off those fields;
    - other ``x-kubernetes-*`` keys (``map-type``, ``list-map-keys`` once used) are dropped.
    """
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key in SCHEMA_MAPS:
            out[key] = {k: to_json_schema(v) for k, v in value.items()}
        elif key in SCHEMA_LISTS:
            out[key] = [to_json_schema(v) for v in value]
        elif key in SCHEMA_ONE and isinstance(value, dict):
            out[key] = to_json_schema(value)
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    list_type = node.get("x-kubernetes-list-type")
    if list_type == "set":
        out["uniqueItems"] = True
    elif list_type == "map":
        keys = node["x-kubernetes-list-map-keys"]
        item_props = node.get("items", {}).get("properties", {})
        out[LIST_MAP_KEYS] = {"keys": keys, "defaults": {
            k: item_props[k]["default"] for k in keys if "default" in item_props.get(k, {})}}
    if (out.get("type") == "object" and "properties" in out and "additionalProperties" not in out
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def _list_map_keys(validator, spec, instance, schema):
    if not validator.is_type(instance, "array"):
        return
    seen: dict[tuple, int] = {}
    for i, item in enumerate(instance):
        if not isinstance(item, dict):
            continue
        key = tuple(item.get(k, spec["defaults"].get(k)) for k in spec["keys"])
        if key in seen:
            yield jsonschema.ValidationError(
                f"items {seen[key]} and {i} have the same {spec['keys']} {key} "
                "(x-kubernetes-list-type: map)")
        seen.setdefault(key, i)


K8sValidator = jsonschema.validators.extend(jsonschema.Draft4Validator,
                                            {LIST_MAP_KEYS: _list_map_keys})
FORMATS = jsonschema.FormatChecker(formats=())


@FORMATS.checks("int32")
def _int32(value) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@FORMATS.checks("int64")
def _int64(value) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


@functools.cache
def crd(kind: str) -> dict:
    for path in sorted(CRDS.glob("*.yaml")):
        doc = yaml.load(path.read_text(), Loader=LOADER)
        if doc["spec"]["names"]["kind"] == kind:
            return doc
    raise LookupError(f"no vendored CRD for {kind}")


def crd_version(kind: str, version: str = "v1") -> dict:
    versions = {v["name"]: v for v in crd(kind)["spec"]["versions"]}
    return versions[version]


@functools.cache
def _schema_json(kind: str) -> str:
    schema = to_json_schema(crd_version(kind)["schema"]["openAPIV3Schema"])
    # The top-level metadata is the ObjectMeta, which the CRD leaves open: ask for a name.
    schema["properties"]["metadata"] = {
        "type": "object", "required": ["name"],
        "properties": {"name": {"type": "string", "minLength": 1},
                       "namespace": {"type": "string"},
                       "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                       "annotations": {"type": "object",
                                       "additionalProperties": {"type": "string"}}}}
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "spec"})
    return json.dumps(schema)


def json_schema(kind: str) -> dict:
    return json.loads(_schema_json(kind))


def crd_errors(doc: dict, schema: dict | None = None) -> list[jsonschema.ValidationError]:
    schema = schema or json_schema(doc["kind"])
    return sorted(K8sValidator(schema, format_checker=FORMATS).iter_errors(doc),
                  key=lambda e: list(map(str, e.absolute_path)))


def describe(errors: list[jsonschema.ValidationError]) -> str:
    return "\n".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


# ---------------------------------------------------------------------------------------------
# The vendored CRDs and the conversion


def test_crds_are_vendored_with_their_source():
    source = (CRDS / "SOURCE.md").read_text()
    assert "https://github.com/ray-project/kuberay" in source
    assert re.search(r"`[0-9a-f]{40}`", source), "SOURCE.md names no full commit hash"
    assert re.search(r"\b20\d\d-\d\d-\d\d\b", source), "SOURCE.md names no date"
    for name in ("ray.io_rayjobs.yaml", "ray.io_rayclusters.yaml"):
        path = CRDS / name
        assert f"ray-operator/config/crd/bases/{name}" in source
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert re.search(rf"sha256 `{re.escape(name)}` \| `{digest}`", source), (
            f"{name} differs from the checksum in SOURCE.md: re-vendor it, do not edit it")
    for kind in ("RayJob", "RayCluster"):
        version = crd_version(kind)
        assert crd(kind)["spec"]["group"] == "ray.io"
        assert version["served"] and "openAPIV3Schema" in version["schema"]


def test_converted_schema_keeps_the_crd_constraints():
    """Spot checks that the conversion kept required fields, types and enums, and turned every
    x-kubernetes-* key into a check."""
    schema = json_schema("RayCluster")
    jsonschema.Draft4Validator.check_schema(schema)
    assert "x-kubernetes-" not in json.dumps(schema)
    spec = schema["properties"]["spec"]
    assert "headGroupSpec" in spec["required"]
    group = spec["properties"]["workerGroupSpecs"]["items"]
    assert {"groupName", "minReplicas", "maxReplicas", "template"} <= set(group["required"])
    assert group["properties"]["replicas"]["type"] == "integer"
    assert group["properties"]["rayStartParams"]["additionalProperties"] == {"type": "string"}
    assert spec["properties"]["authOptions"]["properties"]["mode"]["enum"] == ["disabled", "token"]
    assert spec["additionalProperties"] is False
    container_list = group["properties"]["template"]["properties"]["spec"]["properties"][
        "containers"]
    assert container_list[LIST_MAP_KEYS] == {"keys": ["name"], "defaults": {}}
    limits = container_list["items"]["properties"]["resources"]["properties"]["limits"]
    assert limits["additionalProperties"]["anyOf"] == [{"type": "integer"}, {"type": "string"}]
    job = json_schema("RayJob")["properties"]["spec"]["properties"]
    assert job["shutdownAfterJobFinishes"]["type"] == "boolean"
    assert job["entrypoint"]["type"] == "string"


# ---------------------------------------------------------------------------------------------
# KubeRay manifests


def test_infra_k8s_has_a_raycluster_and_a_rayjob():
    kinds = sorted(d["kind"] for _, d in ray_docs())
    assert kinds == ["RayCluster", "RayJob"]


@pytest.mark.parametrize("name,doc", ray_docs(), ids=[n for n, _ in ray_docs()])
def test_kuberay_manifest_validates_against_crd_v1(name, doc):
    assert doc["apiVersion"] == "ray.io/v1"
    assert crd(doc["kind"])["spec"]["names"]["kind"] == doc["kind"]
    errors = crd_errors(doc)
    assert not errors, f"{name}:\n{describe(errors)}"


def _cs(doc):
    return cluster_spec(doc)


BROKEN = [
    ("worker group without groupName",
     lambda d: _cs(d)["workerGroupSpecs"][0].pop("groupName"), "groupName"),
    ("replicas: 'two'",
     lambda d: _cs(d)["workerGroupSpecs"][0].update(replicas="two"), "replicas"),
    ("authOptions.mode not in the enum",
     lambda d: _cs(d)["authOptions"].update(mode="tokens"), "mode"),
    ("rayStartParams value not a string",
     lambda d: _cs(d)["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}), "num-cpus"),
    ("unknown field (typo authOption)",
     lambda d: _cs(d).update(authOption={"mode": "token"}), "authOption"),
    ("two containers with one name",
     lambda d: _cs(d)["workerGroupSpecs"][0]["template"]["spec"]["containers"].append(
         copy.deepcopy(_cs(d)["workerGroupSpecs"][0]["template"]["spec"]["containers"][0])),
     "containers"),
    ("no headGroupSpec",
     lambda d: _cs(d).pop("headGroupSpec"), "headGroupSpec"),
    ("GPU limit not a quantity",
     lambda d: _cs(d)["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"][
         "limits"].update({"nvidia.com/gpu": [8]}), "nvidia.com/gpu"),
]
BROKEN_JOB = [
    ("shutdownAfterJobFinishes: 'true'",
     lambda d: d["spec"].update(shutdownAfterJobFinishes="true"), "shutdownAfterJobFinishes"),
    ("entrypoint as a list",
     lambda d: d["spec"].update(entrypoint=["python", "-m", "orchestrator"]), "entrypoint"),
]
CASES = ([(kind, *case) for kind in ("RayCluster", "RayJob") for case in BROKEN]
         + [("RayJob", *case) for case in BROKEN_JOB])


@pytest.mark.parametrize("kind,what,mutate,field", CASES,
                         ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_broken_kuberay_manifest_fails_validation(kind, what, mutate, field):
    doc = copy.deepcopy(doc_of(kind))
    assert not crd_errors(doc)
    mutate(doc)
    errors = crd_errors(doc)
    assert errors, f"{kind} with {what} passed validation"
    assert any(field in ".".join(map(str, e.absolute_path)) or field in e.message
               for e in errors), f"errors do not point at {field}:\n{describe(errors)}"


def _paths_with_cel_rules(node: dict, path: tuple = ()) -> list[tuple]:
    found = [path] if node.get("x-kubernetes-validations") else []
    for key, child in node.get("properties", {}).items():
        found += _paths_with_cel_rules(child, path + (key,))
    if isinstance(node.get("items"), dict):
        found += _paths_with_cel_rules(node["items"], path + ("[]",))
    return found


def _present(value: Any, path: tuple) -> bool:
    if not path:
        return True
    head, rest = path[0], path[1:]
    if head == "[]":
        return isinstance(value, list) and any(_present(v, rest) for v in value)
    return isinstance(value, dict) and head in value and _present(value[head], rest)


@pytest.mark.parametrize("name,doc", ray_docs(), ids=[n for n, _ in ray_docs()])
def test_manifests_set_no_field_guarded_by_cel_rules(name, doc):
    """CEL rules (x-kubernetes-validations) are not evaluated offline: the manifests stay off
    the fields that carry them, so that the schema check above is the whole check."""
    paths = _paths_with_cel_rules(crd_version(doc["kind"])["schema"]["openAPIV3Schema"])
    assert ("spec", "managedBy") in paths  # the rules are found at all
    used = [".".join(p) for p in paths if _present(doc, p)]
    assert not used, f"{name} sets fields with CEL rules that this test cannot check: {used}"


def test_rayjob_runs_fig3a_on_four_nodes_of_eight_gpus():
    from orchestrator.planning.spec import load_spec

    job = doc_of("RayJob")
    spec = job["spec"]
    assert spec["entrypoint"] == f"cemlab run {FIG3A}"
    assert spec["shutdownAfterJobFinishes"] is True
    assert (ROOT / FIG3A).is_file()
    # The driver's working directory is the project as the image installs it.
    workdir = re.findall(r"^WORKDIR\s+(\S+)", (K8S / "Dockerfile").read_text(), re.M)[-1]
    assert yaml.safe_load(spec["runtimeEnvYAML"]) == {"working_dir": workdir}

    cs = cluster_spec(job)
    assert cs["enableInTreeAutoscaling"] is False
    assert cs["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    (group,) = cs["workerGroupSpecs"]
    (worker,) = group["template"]["spec"]["containers"]
    limits, requests = worker["resources"]["limits"], worker["resources"]["requests"]
    assert limits["nvidia.com/gpu"] == requests["nvidia.com/gpu"] == 8
    nodes = group["replicas"]
    assert nodes == group["maxReplicas"] == 4
    resources = load_spec(str(ROOT / FIG3A)).resources
    cpus = int(limits["cpu"])
    # One trial per node, all four at once: what the orchestrator will see and schedule.
    assert resources.num_workers <= 8 and resources.num_workers * resources.cpus_per_worker <= cpus
    assert resources.trials_that_fit(nodes * cpus, nodes * 8) == nodes


def test_raycluster_and_rayjob_describe_the_same_pods():
    """The standing cluster and the RayJob's own cluster differ only in scaling."""
    standing, job = cluster_spec(doc_of("RayCluster")), cluster_spec(doc_of("RayJob"))
    for key in ("rayVersion", "authOptions"):
        assert standing[key] == job[key]
    assert standing["headGroupSpec"] == job["headGroupSpec"]
    assert [g["template"] for g in standing["workerGroupSpecs"]] == [
        g["template"] for g in job["workerGroupSpecs"]]
    assert standing["enableInTreeAutoscaling"] is True
    assert all(g["minReplicas"] == 0 for g in standing["workerGroupSpecs"])


@pytest.mark.parametrize("name,doc", ray_docs(), ids=[n for n, _ in ray_docs()])
def test_token_auth_on_every_ray_pod(name, doc):
    auth = cluster_spec(doc)["authOptions"]
    assert auth["mode"] == "token" and auth.get("secretName")
    assert "enableK8sTokenAuth" not in auth  # not supported for RayJob (CRD docs)
    for c in containers(doc):
        env = env_of(c)
        # The operator only adds RAY_AUTH_MODE / RAY_AUTH_TOKEN where a container lacks them.
        assert env.get("RAY_AUTH_MODE", {"value": "token"}).get("value") == "token", c["name"]
        assert "RAY_AUTH_TOKEN" not in env or from_secret(env["RAY_AUTH_TOKEN"]), c["name"]


@pytest.mark.parametrize("name,doc", k8s_docs(), ids=[n for n, _ in k8s_docs()])
def test_env_references_resolve(name, doc):
    """Kubernetes expands $(VAR) only for variables defined earlier in the container's env
    (in command and args: anywhere in it); any other reference stays a literal string."""
    for c in containers(doc):
        defined: list[str] = []
        for entry in c.get("env", []):
            for ref in refs(entry.get("value", "")):
                assert ref in defined, f"{c['name']}: {entry['name']} uses $({ref}) before it"
            defined.append(entry["name"])
        for arg in c.get("command", []) + c.get("args", []):
            for ref in refs(arg):
                assert ref in defined, f"{c['name']}: {arg!r} uses undefined $({ref})"


SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "CEMLAB_LEDGER_URL",
              "MLFLOW_BACKEND_STORE_URI", "RAY_AUTH_TOKEN")


@pytest.mark.parametrize("name,doc", k8s_docs(), ids=[n for n, _ in k8s_docs()])
def test_credentials_only_from_secrets(name, doc):
    for c in containers(doc):
        for var, entry in env_of(c).items():
            if var in SECRET_ENV:
                assert from_secret(entry), f"{c['name']}: {var} is not from a secretKeyRef"
    text = json.dumps(doc)
    assert not re.search(r"postgres(ql)?(\+\w+)?://", text), f"{name}: a database URL inline"


def test_every_secret_the_manifests_read_is_created_in_the_docs():
    # KubeRay reads the token from the key auth_token of authOptions.secretName.
    wanted = {(cluster_spec(d)["authOptions"]["secretName"], "auth_token") for _, d in ray_docs()}
    for _, doc in k8s_docs():
        for c in containers(doc):
            for entry in c.get("env", []):
                if from_secret(entry) and not entry["valueFrom"]["secretKeyRef"].get("optional"):
                    ref = entry["valueFrom"]["secretKeyRef"]
                    wanted.add((ref["name"], ref["key"]))
    assert len(wanted) >= 6
    docs = DOCS.read_text()
    for secret, key in sorted(wanted):
        assert re.search(rf"create secret generic {re.escape(secret)}\b[^`]*?"
                         rf"--from-literal={re.escape(key)}=", docs), (
            f"docs/deploy.md does not create Secret {secret} with key {key}")


# ---------------------------------------------------------------------------------------------
# MLflow


def _flag(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    assert len(values) == 1, f"expected one {name}=VALUE in {args}"
    return values[0]


def test_mlflow_server_reads_postgres_and_s3_from_secrets():
    deployment = doc_of("Deployment")
    (c,) = containers(deployment)
    assert c["command"] == ["mlflow", "server"]
    args, env = c["args"], env_of(c)
    backend = _flag(args, "--backend-store-uri")
    artifacts = _flag(args, "--artifacts-destination")
    assert artifacts.startswith("s3://")
    assert "--serve-artifacts" in args and "--no-serve-artifacts" not in args
    for value in (backend, artifacts):
        for ref in refs(value):
            assert from_secret(env[ref]), f"$({ref}) in {value} is not from a Secret"
    assert refs(backend) and backend == f"$({refs(backend)[0]})"
    backend_ref = env[refs(backend)[0]]["valueFrom"]["secretKeyRef"]
    assert backend_ref["name"] == "cemlab-postgres"
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert from_secret(env[var])


def test_mlflow_allowed_hosts_admit_the_tracking_uri_of_every_ray_pod():
    from mlflow.server.security_utils import is_allowed_host_header

    deployment, service = doc_of("Deployment"), doc_of("Service")
    (c,) = containers(deployment)
    allowed = _flag(c["args"], "--allowed-hosts").split(",")
    assert "*" not in allowed
    namespace, port = service["metadata"]["namespace"], service["spec"]["ports"][0]["port"]
    uris = {env_of(x)["MLFLOW_TRACKING_URI"]["value"] for _, d in ray_docs()
            for x in containers(d)}
    assert uris, "no Ray pod sets MLFLOW_TRACKING_URI"
    for uri in uris:
        parts = urlsplit(uri)
        assert parts.hostname == f"{service['metadata']['name']}.{namespace}.svc.cluster.local"
        assert parts.port == port
        assert is_allowed_host_header(allowed, parts.netloc), f"MLflow would refuse {uri}"
    assert not is_allowed_host_header(allowed, "evil.example.com:5000")


def test_mlflow_service_selects_the_deployment_and_its_port():
    deployment, service = doc_of("Deployment"), doc_of("Service")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    (c,) = containers(deployment)
    ports = {p.get("name"): p["containerPort"] for p in c["ports"]}
    for p in service["spec"]["ports"]:
        target = p["targetPort"]
        assert target in ports or target in ports.values()
    assert _flag(c["args"], "--port") == str(ports[service["spec"]["ports"][0]["targetPort"]])


def test_mlflow_pod_template_validates_against_the_core_v1_schema():
    """The RayCluster CRD embeds Kubernetes' PodTemplateSpec schema: the Deployment's pod
    template is checked against it (containers, env, probes, resources)."""
    head = json_schema("RayCluster")["properties"]["spec"]["properties"]["headGroupSpec"]
    template_schema = head["properties"]["template"]
    template = doc_of("Deployment")["spec"]["template"]
    assert not crd_errors(template, template_schema), describe(crd_errors(template,
                                                                          template_schema))
    broken = copy.deepcopy(template)
    broken["spec"]["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"].pop("key")
    assert crd_errors(broken, template_schema)


# ---------------------------------------------------------------------------------------------
# Images and forbidden strings


def image_refs() -> list[tuple[str, str]]:
    found = [(name, c["image"]) for name, d in k8s_docs() for c in containers(d)]
    for path in launcher_files():
        config = load_launcher(path)
        dockers = [config.get("docker", {})] + [
            t.get("docker", {}) for t in config["available_node_types"].values()]
        found += [(path.name, d[k]) for d in dockers
                  for k in ("image", "head_image", "worker_image") if k in d]
    found += [("Dockerfile", m) for m in re.findall(r"^FROM\s+(\S+)",
                                                     (K8S / "Dockerfile").read_text(), re.M)]
    return found


def test_every_image_is_pinned_to_the_installed_ray():
    images = image_refs()
    assert len(images) >= 8
    tags = {image.rsplit(":", 1)[1] for _, image in images if ":" in image}
    assert all(":" in image for _, image in images), images
    assert len(tags) == 1, f"images with different tags: {images}"
    (tag,) = tags
    assert re.fullmatch(r"(\d+\.\d+\.\d+)-py3\d+-gpu", tag), tag
    assert tag.split("-")[0] == ray.__version__, (
        f"images are tagged {tag}, the installed Ray is {ray.__version__}: bump the manifests")
    dockerfile = (K8S / "Dockerfile").read_text()
    assert re.findall(r"^FROM\s+(\S+)", dockerfile, re.M) == [f"rayproject/ray:{tag}"]
    assert re.findall(r"ray\.__version__ == '([^']+)'", dockerfile) == [ray.__version__]
    for _, doc in ray_docs():
        assert cluster_spec(doc)["rayVersion"] == ray.__version__
    launchers = {p.name for p in launcher_files()}
    assert {i for n, i in images if n in launchers} == {f"rayproject/ray:{tag}"}
    k8s = {p.name for p in k8s_files()}
    project_images = {i for n, i in images if n.split(":")[0] in k8s}
    assert len(project_images) == 1  # one image, one `sed` in docs/deploy.md


def test_dockerfile_copies_what_exists_and_installs_the_project():
    text = (K8S / "Dockerfile").read_text()
    sources = [s for line in re.findall(r"^COPY\s+(?:--\S+\s+)*(.+)$", text, re.M)
               for s in line.split()[:-1]]
    assert {"pyproject.toml", "orchestrator/", "workloads/", "experiments/"} <= set(sources)
    for source in sources:
        assert (ROOT / source).exists(), f"the Dockerfile copies {source}, which is missing"
    assert re.search(r"pip install [^\n]*-e \.", text)
    ignore = (K8S / "Dockerfile.dockerignore").read_text().split()
    for source in sources:  # the build context must keep what the Dockerfile copies
        assert f"!{source.rstrip('/')}" in ignore


def manifest_files() -> list[Path]:
    """What configures a node or a pod: YAML, the Dockerfile, the settings template."""
    files = [p for p in [*CLUSTER.iterdir(), *K8S.iterdir()] if p.is_file()]
    return sorted(p for p in files if p.suffix in {".yaml", ".example", ".dockerignore"}
                  or p.name == "Dockerfile")


def test_no_loopback_or_local_only_setting_in_any_manifest():
    files = manifest_files()
    assert {"aws-a100.yaml", "gcp-a100.yaml", "rayjob-fig3a.yaml", "mlflow.yaml",
            "Dockerfile", "cemlab.env.example"} <= {p.name for p in files}
    scripts = [p for p in CLUSTER.iterdir() if p.suffix in {".sh", ".py"}]
    for path in files + scripts:
        text = path.read_text()
        for needle in ("127.0.0.1", "localhost"):
            assert needle not in text, f"{path.relative_to(ROOT)} contains {needle}"
    for path in files:
        assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in path.read_text(), path


# ---------------------------------------------------------------------------------------------
# Ray cluster launcher


@functools.cache
def ray_schema() -> dict:
    return json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())


def launcher_errors(config: dict) -> list[jsonschema.ValidationError]:
    schema = ray_schema()
    return list(jsonschema.validators.validator_for(schema)(schema).iter_errors(config))


LAUNCHERS = [p.name for p in launcher_files()]


def test_both_launcher_configs_exist():
    assert LAUNCHERS == ["aws-a100.yaml", "gcp-a100.yaml"]


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_config_validates_against_rays_schema(name):
    config = load_launcher(CLUSTER / name)
    errors = launcher_errors(config)
    assert not errors, "\n".join(e.message for e in errors)
    # What `ray up` does with it before calling the cloud: merge the provider's defaults,
    # validate again, check head type and worker counts.
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    assert prepared["docker"]["image"] == config["docker"]["image"]
    assert prepared["head_setup_commands"][:len(config["setup_commands"])] == config[
        "setup_commands"]


LAUNCHER_BROKEN = [
    ("max_workers as a string", lambda c: c.update(max_workers="4")),
    ("a node type without resources",
     lambda c: next(iter(c["available_node_types"].values())).pop("resources")),
    ("unknown top-level key", lambda c: c.update(idle_timeout_minute=5)),
    ("docker image not a string", lambda c: c["docker"].update(image=2.6)),
]


@pytest.mark.parametrize("name", LAUNCHERS)
@pytest.mark.parametrize("what,mutate", LAUNCHER_BROKEN, ids=[b[0] for b in LAUNCHER_BROKEN])
def test_broken_launcher_config_fails_validation(name, what, mutate):
    config = load_launcher(CLUSTER / name)
    mutate(config)
    assert launcher_errors(config), f"{name} with {what} passed validation"


INSTANCE = {"aws-a100.yaml": ("InstanceType", "p4d.24xlarge"),
            "gcp-a100.yaml": ("machineType", "a2-highgpu-8g")}


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_has_a_cpu_head_and_gpu_workers_from_zero(name):
    from orchestrator.planning.spec import load_spec

    config = load_launcher(CLUSTER / name)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    gpu = [t for t in types.values() if t["resources"].get("GPU", 0) > 0]
    assert len(gpu) == 1
    (worker,) = gpu
    key, instance = INSTANCE[name]
    assert worker["node_config"][key] == instance
    assert worker["min_workers"] == 0 and worker["resources"]["GPU"] == 8
    nodes, cpus = worker["max_workers"], worker["resources"]["CPU"]
    assert config["max_workers"] >= nodes
    resources = load_spec(str(ROOT / FIG3A)).resources
    assert resources.num_workers * resources.cpus_per_worker <= cpus
    assert resources.trials_that_fit(nodes * cpus, nodes * 8) == nodes == 4


NODE_ENV = ". /home/ray/cemlab/infra/cluster/node-env.sh"


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_sets_up_token_auth_and_environment_on_every_node(name):
    config = load_launcher(CLUSTER / name)
    run_options = " ".join(config["docker"]["run_options"])
    mounts = config["file_mounts"]
    token_path = re.search(r"--env RAY_AUTH_TOKEN_PATH=(\S+)", run_options).group(1)
    assert "--env RAY_AUTH_MODE=token" in run_options
    assert any(token_path.startswith(remote.rstrip("/") + "/") for remote in mounts)
    assert mounts == {"/home/ray/.cemlab-cluster": "~/.cemlab-cluster"}
    # The project: copied out of the mount, installed; node-env.sh before every `ray start`.
    setup = config["setup_commands"]
    assert any("cp -r /home/ray/.cemlab-cluster/cemlab /home/ray/cemlab" in c for c in setup)
    assert "pip install --no-cache-dir -e /home/ray/cemlab" in setup
    assert (ROOT / NODE_ENV.split("/home/ray/cemlab/")[1]).is_file()
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in config[key] if "ray start" in c]
        assert starts, key
        for command in starts:
            assert command.startswith(NODE_ENV + " &&"), command
            assert "--node-ip-address" not in command
    for node_type in config["available_node_types"].values():  # no type drops the options
        assert "run_options" not in node_type.get("docker", {})


def test_gcp_gpu_workers_get_a_driver_before_docker_starts():
    config = load_launcher(CLUSTER / "gcp-a100.yaml")
    (worker,) = [t for t in config["available_node_types"].values()
                 if t["resources"].get("GPU", 0)]
    node = worker["node_config"]
    assert node["scheduling"]["onHostMaintenance"] == "TERMINATE"  # GPU VMs cannot migrate
    assert {"key": "install-nvidia-driver", "value": "True"} in node["metadata"]["items"]
    assert any("nvidia-smi" in c for c in worker["initialization_commands"])


# ---------------------------------------------------------------------------------------------
# Helper scripts

ROUTES = ("Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
          "ens5\t0000FEA9\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n"
          "ens5\t00000000\t0100000A\t0003\t0\t0\t100\t00000000\t0\t0\t0\n")
GOOD_ENV = {"CEMLAB_STORAGE": "s3://bucket/cemlab",
            "MLFLOW_TRACKING_URI": "http://10.0.0.5:5000",
            "CEMLAB_LEDGER_URL": "postgresql+psycopg2://cemlab:pw@10.0.0.6:5432/cemlab"}


def source_node_env(tmp_path: Path, settings: dict[str, str], token: str = "t" * 64):
    directory = tmp_path / "cluster"
    directory.mkdir(exist_ok=True)
    if token:
        (directory / "auth_token").write_text(token + "\n")
    (directory / "cemlab.env").write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
    (tmp_path / "route").write_text(ROUTES)
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "CEMLAB_CLUSTER_DIR": str(directory), "CEMLAB_ROUTE_TABLE": str(tmp_path / "route"),
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
    script = CLUSTER / "node-env.sh"
    proc = subprocess.run(["bash", "-c", f'. "{script}" && echo STARTED && env'], env=env,
                          capture_output=True, text=True, timeout=60)
    values = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    return proc, values


def test_node_env_exports_token_auth_settings_and_interfaces(tmp_path):
    proc, env = source_node_env(tmp_path, {**GOOD_ENV, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"})
    assert proc.returncode == 0 and "STARTED" in proc.stdout, proc.stderr
    assert env["RAY_AUTH_MODE"] == "token"
    assert env["RAY_AUTH_TOKEN_PATH"] == str(tmp_path / "cluster" / "auth_token")
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "ens5"
    for key, value in GOOD_ENV.items():
        assert env[key] == value
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in env


@pytest.mark.parametrize("problem,settings,token", [
    ("tracking server on loopback", {**GOOD_ENV, "MLFLOW_TRACKING_URI": "http://localhost:5000"},
     "t"),
    ("ledger on loopback",
     {**GOOD_ENV, "CEMLAB_LEDGER_URL": "postgresql+psycopg2://u@127.0.0.1:5432/db"}, "t"),
    ("no storage root", {k: v for k, v in GOOD_ENV.items() if k != "CEMLAB_STORAGE"}, "t"),
    ("no token", GOOD_ENV, ""),
])
def test_node_env_refuses_to_start_ray(tmp_path, problem, settings, token):
    proc, _ = source_node_env(tmp_path, settings, token)
    assert proc.returncode != 0 and "STARTED" not in proc.stdout, problem
    assert "node-env:" in proc.stderr


def test_bundle_prepares_token_settings_and_checkout(tmp_path):
    bundle = load_module("cemlab_bundle", CLUSTER / "bundle.py")
    directory = tmp_path / "bundle"
    assert bundle.main(["--dir", str(directory)]) == 1  # settings template to fill in
    token = (directory / "auth_token").read_text()
    assert re.fullmatch(r"[0-9a-f]{64}\n", token)
    assert (directory / "auth_token").stat().st_mode & 0o777 == 0o600
    assert (directory / "cemlab.env").read_text() == (CLUSTER / "cemlab.env.example").read_text()
    assert bundle.main(["--dir", str(directory)]) == 1  # placeholders left
    (directory / "cemlab.env").write_text(
        "".join(f"{k}={v}\n" for k, v in {**GOOD_ENV,
                                          "MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"}.items()))
    assert bundle.main(["--dir", str(directory)]) == 1  # loopback
    (directory / "cemlab.env").write_text("".join(f"{k}={v}\n" for k, v in GOOD_ENV.items()))
    assert bundle.main(["--dir", str(directory)]) == 0
    assert (directory / "auth_token").read_text() == token  # kept across runs
    checkout = directory / "cemlab"
    for name in ("pyproject.toml", FIG3A, "infra/cluster/node-env.sh", "orchestrator/cli.py"):
        assert (checkout / name).is_file(), name
    assert not (checkout / ".venv").exists() and not (checkout / ".cemlab").exists()
    assert not (checkout / ".git").exists()


def test_request_resources_asks_one_bundle_per_trial():
    module = load_module("cemlab_request_resources", CLUSTER / "request_resources.py")
    assert module.bundles(ROOT / FIG3A, 4) == [{"CPU": 32.0, "GPU": 8.0}] * 4
    cpu_only = module.bundles(ROOT / "experiments/paper/fig3a-cpu.yaml", 2)
    assert cpu_only == [{"CPU": 1.0}] * 2
