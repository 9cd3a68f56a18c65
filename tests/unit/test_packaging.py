"""The installed tree exposes byteps_espresso.* only, never a bare kernels/worker/server."""

import subprocess
import sys

import pytest


def test_subpackages_import_under_byteps_espresso():
    import byteps_espresso.kernels
    import byteps_espresso.server
    import byteps_espresso.worker

    import byteps_espresso.strategy

    assert byteps_espresso.kernels.__name__ == "byteps_espresso.kernels"
    assert byteps_espresso.server.__name__ == "byteps_espresso.server"
    assert byteps_espresso.worker.__name__ == "byteps_espresso.worker"
    assert byteps_espresso.strategy.__name__ == "byteps_espresso.strategy"


@pytest.mark.parametrize("bare", ["kernels", "worker", "server", "deploy"])
def test_no_bare_top_level_module(bare, tmp_path):
    # Run from an unrelated folder so the repository root is not on sys.path.
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({bare!r}) is not None)"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, timeout=60)
    assert result.returncode == 0, f"a bare `{bare}` module is importable after install"


def test_console_script_runs(tmp_path):
    result = subprocess.run([sys.executable, "-m", "byteps_espresso.cli", "config", "--markdown"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "DMLC_ROLE" in result.stdout
