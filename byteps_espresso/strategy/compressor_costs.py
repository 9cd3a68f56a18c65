"""Compression cost profiles: compress and decompress(-and-sum) time versus element count.

Each (compressor, device) has two linear models fitted to measurements, in microseconds:

    compress_us(n)              = a_c + b_c * n
    decompress_sum_us(n, q)     = q * (a_d + b_d * n)    # q payloads of n elements each

``gpu`` is the training device (torch backend), ``cpu`` one host thread (numba backend); the
cost model divides CPU work among the threads a machine's workers share. An optional
``server`` entry prices the PS servers' aggregation (numba kernels in the server processes);
without it they are priced like ``cpu``. The JSON file::

    {"note": "measured on ... with ...", "dense_sum": {"a_us": .., "b_us": ..},
     "compressors": {"randomk": {"params": {"ratio": 0.01},
                                 "gpu": {"compress": {"a_us": .., "b_us": ..},
                                         "decompress": {"a_us": .., "b_us": ..}},
                                 "cpu": {...}}}}

``dense_sum`` is one host thread adding float32 vectors (the PS servers' dense aggregation).
The shipped defaults (``byteps_espresso/data/compressor_costs.json``) are written by
``benchmarks/profile_compressors.py``; their note says where and how they were measured.

Example:
    >>> costs = CompressorCosts.default()
    >>> costs.compress_us("fp16", "cpu", 1 << 20)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import numpy as np

from byteps_espresso.strategy.workload import atomic_write_text, read_json

__all__ = ["DEVICES", "OPS", "CompressorCosts", "CostsError", "Linear"]

# "server": the PS servers' aggregation kernels, timed on their own; optional, "cpu" when
# absent (a worker's "cpu" profile may be measured under the training's contention).
DEVICES = ("gpu", "cpu", "server")
OPS = ("compress", "decompress")


class CostsError(ValueError):
    """A cost profile is malformed or lacks a compressor; the message says what to add."""


@dataclass(frozen=True)
class Linear:
    """t(n) = a_us + b_us * n, microseconds."""

    a_us: float
    b_us: float

    def __call__(self, n: Any) -> Any:
        return self.a_us + self.b_us * np.asarray(n, dtype=np.float64)

    @classmethod
    def fit(cls, numels: Iterable[float], us: Iterable[float]) -> Linear:
        """Least-squares fit with non-negative coefficients (weighted by 1/t so small and
        large tensors count alike).

        Raises:
            CostsError: fewer than two distinct sizes.
        """
        x = np.asarray(list(numels), dtype=np.float64)
        y = np.asarray(list(us), dtype=np.float64)
        if x.size != y.size or np.unique(x).size < 2:
            raise CostsError("fitting needs timings of at least two distinct sizes")
        w = 1.0 / np.maximum(y, 1e-3)
        design = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
        (a, b), *_ = np.linalg.lstsq(design, y * w, rcond=None)
        if a < 0:  # refit through the origin
            a, b = 0.0, float(np.sum(w * w * x * y) / np.sum(w * w * x * x))
        if b < 0:
            a, b = float(np.median(y)), 0.0
        return cls(float(a), float(b))

    def to_dict(self) -> dict[str, float]:
        return {"a_us": self.a_us, "b_us": self.b_us}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Linear:
        if not isinstance(data, dict):
            raise CostsError(f"{where}: expected an object with 'a_us' and 'b_us'")
        for key in ("a_us", "b_us"):
            value = data.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise CostsError(f"{where}.{key}: must be a number >= 0, got {value!r}")
        return cls(float(data["a_us"]), float(data["b_us"]))


@dataclass(frozen=True)
class CompressorCosts:
    """Per compressor and device: the compress and decompress-and-sum models.

    Attributes:
        models: {compressor: {device: {op: Linear}}}.
        dense_sum: one host thread summing float32 vectors, per element.
        note: where and how the numbers were measured.
        params: the compressor parameters each profile was measured with.
    """

    models: Mapping[str, Mapping[str, Mapping[str, Linear]]]
    dense_sum: Linear = Linear(0.0, 0.0005)
    note: str = ""
    params: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def _model(self, compressor: str, device: str, op: str) -> Linear:
        try:
            return self.models[compressor][device][op]
        except KeyError:
            if compressor not in self.models:
                raise CostsError(
                    f"no cost profile for compressor {compressor!r} (known: "
                    f"{', '.join(sorted(self.models)) or 'none'}); measure one with "
                    "benchmarks/profile_compressors.py or pass CompressorCosts.fit(...)"
                ) from None
            raise CostsError(f"cost profile of {compressor!r} lacks {device}/{op}") from None

    def model(self, compressor: str, device: str, op: str) -> Linear:
        """The ``op`` ("compress" or "decompress", per payload) model of ``compressor`` on
        ``device``.

        Raises:
            CostsError: the profile lacks it.
        """
        return self._model(compressor, device, op)

    def has(self, compressor: str, device: str | None = None) -> bool:
        """Whether ``compressor`` (on ``device``, when given: both ops) has a profile."""
        if device is None:
            return compressor in self.models
        ops = self.models.get(compressor, {}).get(device, {})
        return all(op in ops for op in OPS)

    def server_device(self, compressor: str) -> str:
        """The profile the PS aggregation is priced with: ``server`` if present, else ``cpu``."""
        return "server" if self.has(compressor, "server") else "cpu"

    def compress_us(self, compressor: str, device: str, numel: Any) -> Any:
        """Time to compress ``numel`` elements on ``device`` (one thread for ``cpu``)."""
        return self._model(compressor, device, "compress")(numel)

    def decompress_us(self, compressor: str, device: str, numel: Any, payloads: Any = 1) -> Any:
        """Time to decompress ``payloads`` payloads of ``numel`` elements each and sum them."""
        return np.asarray(payloads) * self._model(compressor, device, "decompress")(numel)

    def scaled(self, factors: Mapping[str, float]) -> CompressorCosts:
        """This profile with every compressor's lines on each device of ``factors`` (``gpu``,
        ``cpu``, ``server``) multiplied by its factor; the other devices and the dense sum
        as they are."""
        return dataclasses.replace(self, models={
            name: {device: ({op: Linear(m.a_us * factors[device], m.b_us * factors[device])
                             for op, m in lines.items()} if device in factors else lines)
                   for device, lines in per_device.items()}
            for name, per_device in self.models.items()})

    # ---- fitting and JSON --------------------------------------------------------------------
    @classmethod
    def fit(cls, samples: Iterable[Mapping[str, Any]], note: str = "",
            dense_sum: Linear | None = None,
            params: Mapping[str, Mapping[str, Any]] | None = None) -> CompressorCosts:
        """Fit from timings ``{"compressor", "device", "op", "numel", "us"}`` (op: compress or
        decompress; a decompress sample times one payload).

        Raises:
            CostsError: an unknown device/op, or a (compressor, device, op) with too few sizes.
        """
        groups: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
        for i, s in enumerate(samples):
            try:
                key = (str(s["compressor"]), str(s["device"]), str(s["op"]))
                point = (float(s["numel"]), float(s["us"]))
            except (KeyError, TypeError, ValueError):
                raise CostsError(f"sample {i}: needs compressor, device, op, numel, us") from None
            if key[1] not in DEVICES or key[2] not in OPS:
                raise CostsError(f"sample {i}: device must be one of {DEVICES} and op one of "
                                 f"{OPS}, got {key[1]!r}/{key[2]!r}")
            groups.setdefault(key, []).append(point)
        models: dict[str, dict[str, dict[str, Linear]]] = {}
        for (comp, dev, op), points in sorted(groups.items()):
            xs, ys = zip(*points, strict=True)
            models.setdefault(comp, {}).setdefault(dev, {})[op] = Linear.fit(xs, ys)
        return cls(models, dense_sum or cls.dense_sum, note, dict(params or {}))

    def to_dict(self) -> dict[str, Any]:
        comps: dict[str, Any] = {}
        for comp, devs in sorted(self.models.items()):
            entry: dict[str, Any] = {}
            if comp in self.params:
                entry["params"] = dict(self.params[comp])
            for dev, ops in devs.items():
                entry[dev] = {op: model.to_dict() for op, model in ops.items()}
            comps[comp] = entry
        return {"note": self.note, "dense_sum": self.dense_sum.to_dict(), "compressors": comps}

    @classmethod
    def from_dict(cls, data: Any, where: str = "costs") -> CompressorCosts:
        """Parse the JSON object; errors name ``where`` and the field.

        Raises:
            CostsError: a missing or malformed field.
        """
        if not isinstance(data, dict) or not isinstance(data.get("compressors"), dict):
            raise CostsError(f"{where}: field 'compressors' must be an object")
        models: dict[str, dict[str, dict[str, Linear]]] = {}
        params: dict[str, dict[str, Any]] = {}
        for comp, entry in data["compressors"].items():
            if not isinstance(entry, dict):
                raise CostsError(f"{where}: field 'compressors.{comp}' must be an object")
            if isinstance(entry.get("params"), dict):
                params[comp] = dict(entry["params"])
            devices = [d for d in DEVICES if d in entry]
            if not set(devices) & {"gpu", "cpu"}:
                raise CostsError(f"{where}: field 'compressors.{comp}' needs 'gpu' and/or 'cpu'")
            for dev in devices:
                for op in OPS:
                    field_name = f"compressors.{comp}.{dev}.{op}"
                    if not isinstance(entry[dev], dict) or op not in entry[dev]:
                        raise CostsError(f"{where}: field '{field_name}' is missing")
                    models.setdefault(comp, {}).setdefault(dev, {})[op] = Linear.from_dict(
                        entry[dev][op], f"{where}: field '{field_name}'")
        dense = Linear.from_dict(data.get("dense_sum", cls.dense_sum.to_dict()),
                                 f"{where}: field 'dense_sum'")
        return cls(models, dense, str(data.get("note", "")), params)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CompressorCosts:
        """Read a cost profile JSON file.

        Raises:
            CostsError: unreadable file, bad JSON or malformed field (names the file).
        """
        return cls.from_dict(read_json(path, CostsError, "cost profile"), str(path))

    def save(self, path: str | os.PathLike[str]) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def default(cls) -> CompressorCosts:
        """The shipped profile (see its ``note`` for machine, date and method), read once per
        process and shared: do not modify it."""
        return _shipped()


@functools.cache
def _shipped() -> CompressorCosts:
    ref = resources.files("byteps_espresso") / "data" / "compressor_costs.json"
    return CompressorCosts.from_dict(json.loads(ref.read_text()), "byteps_espresso/data/"
                                     "compressor_costs.json")
