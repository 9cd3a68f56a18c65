"""Kubernetes manifests: render every kustomization, validate offline, check the env contract."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from byteps_espresso.config import VARIABLES, Config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))
KUSTOMIZATIONS = [K8S / "base", *OVERLAYS]
KUBECTL = shutil.which("kubectl")
# Validate against the schema of the kubectl client installed here (kubectl 1.32).
K8S_VERSION = "1.32.0"
# Stand-ins for downward-API values when a container's environment is parsed.
FIELD_VALUES = {
    "status.podIP": "10.1.2.3",
    "metadata.annotations['batch.kubernetes.io/job-completion-index']": "0",
}
WORKLOADS = ("Deployment", "StatefulSet", "Job")

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed: cannot render kustomize"),
]


def _render(path: Path) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=KUSTOMIZATIONS, ids=lambda p: p.relative_to(K8S).as_posix())
def docs(request):
    return _render(request.param)


def _one(docs, kind, name_part=""):
    found = [d for d in docs if d["kind"] == kind and name_part in d["metadata"]["name"]]
    assert len(found) == 1, f"expected one {kind} {name_part!r}, found {len(found)}"
    return found[0]


def _container_env(docs, workload) -> dict[str, str]:
    """The environment a workload's container sees: ConfigMaps from envFrom, then env."""
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source["configMapRef"]["name"]
        env.update(next(d for d in docs if d["kind"] == "ConfigMap"
                        and d["metadata"]["name"] == ref)["data"])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            env[item["name"]] = FIELD_VALUES[item["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def _can_unshare_net() -> bool:
    """Whether a command can run without any network (root with unshare(1))."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "--net", "true"], capture_output=True,
                          timeout=30).returncode == 0


def test_every_kustomization_is_found():
    assert len(KUSTOMIZATIONS) >= 2, KUSTOMIZATIONS


def test_rendered_objects_validate_offline_against_the_schemas(docs, tmp_path):
    """kubernetes-validate ships its schemas; under root the check runs with no network."""
    manifest = tmp_path / "rendered.json"
    manifest.write_text(json.dumps(docs))
    code = ("import json, sys, kubernetes_validate as kv\n"
            "for d in json.load(open(sys.argv[1])):\n"
            f"    kv.validate(d, {K8S_VERSION!r}, strict=True)\n"
            "print(len(json.load(open(sys.argv[1]))))\n")
    isolate = ["unshare", "--net"] if _can_unshare_net() else []
    out = subprocess.run([*isolate, sys.executable, "-c", code, str(manifest)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout) == len(docs)


def test_the_validator_rejects_a_broken_object(docs):
    import kubernetes_validate

    job = json.loads(json.dumps(_one(docs, "Job")))
    job["spec"]["template"]["spec"]["containers"][0]["gpus"] = 8
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def test_every_env_var_is_declared_and_each_role_parses(docs):
    declared = {v.name for v in VARIABLES}
    roles = set()
    for workload in (d for d in docs if d["kind"] in WORKLOADS):
        env = _container_env(docs, workload)
        unknown = set(env) - declared
        assert not unknown, f"{workload['metadata']['name']} sets undeclared {unknown}"
        cfg = Config.from_env(env)  # required variables present, every value valid
        assert cfg.node_host == FIELD_VALUES["status.podIP"]
        roles.add(cfg.role.value)
    assert roles == {"scheduler", "server", "worker"}
    for cm in (d for d in docs if d["kind"] == "ConfigMap"):
        assert set(cm["data"]) <= declared, set(cm["data"]) - declared


def test_cluster_shape_is_consistent(docs):
    job, servers = _one(docs, "Job"), _one(docs, "StatefulSet")
    scheduler = _one(docs, "Deployment")
    cfg = Config.from_env(_container_env(docs, job))
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == cfg.num_machines
    assert servers["spec"]["replicas"] == cfg.num_servers
    assert scheduler["spec"]["replicas"] == 1
    limits = job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == cfg.local_size
    service = next(d for d in docs if d["kind"] == "Service"
                   and d["metadata"]["name"] == cfg.root_uri)
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert ports == {"scheduler": cfg.root_port, "store": cfg.store_port}
    assert service["spec"]["selector"].items() <= scheduler["spec"]["template"]["metadata"][
        "labels"].items()
    assert servers["spec"]["serviceName"] in {d["metadata"]["name"] for d in docs
                                             if d["kind"] == "Service"
                                             and d["spec"].get("clusterIP") == "None"}


def test_network_policy_admits_only_the_jobs_own_pods(docs):
    policy = _one(docs, "NetworkPolicy")
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector, "an empty selector would cover every pod of the namespace"
    for workload in (d for d in docs if d["kind"] in WORKLOADS):
        pod_labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= pod_labels.items(), workload["metadata"]["name"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": selector}}]


def test_compressor_knob_names_a_registered_compressor(docs):
    kernels = pytest.importorskip("byteps_espresso.kernels")
    cm = _one(docs, "ConfigMap")
    name = cm["data"].get("ESPRESSO_COMPRESSOR")
    if name is not None:
        assert name in kernels.names(), f"unknown compressor {name}; known: {kernels.names()}"


def test_worker_command_exists_and_takes_its_options(docs):
    job = _one(docs, "Job")
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    script = next(a for a in args if a.endswith(".py"))
    relative = re.sub(r"^/opt/byteps-espresso/", "", script)
    assert (ROOT / relative).is_file(), f"{script} is not in the repository"
    flags = [a for a in args if a.startswith("--")]
    if flags:
        usage = subprocess.run([sys.executable, str(ROOT / relative), "--help"],
                               capture_output=True, text=True, timeout=90)
        assert usage.returncode == 0, usage.stderr
        assert all(f in usage.stdout for f in flags), (flags, usage.stdout)
    compressor = _one(docs, "ConfigMap")["data"].get("ESPRESSO_COMPRESSOR")
    if "--compressor" in args and compressor is not None:
        assert args[args.index("--compressor") + 1] == compressor, "knob and flag disagree"
