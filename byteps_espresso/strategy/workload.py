"""Workload profiles: gradient tensors in backward order with the time each becomes ready.

The JSON format is the one of the profiles shipped in ``byteps_espresso/data/workloads``
(measured on V100 GPUs, see the README there) and written by the worker's profiler::

    {"model": "vgg16", "source": "...", "order": "backward order ...",
     "time_unit": "microseconds", "dtype": "float32", "forward_us": 30000,   # optional
     "tensors": [{"name": "fc.bias", "numel": 1000, "ready_gap_us": 0}, ...]}

``ready_gap_us`` of tensor ``i`` is the backward computation between gradient ``i - 1`` (or
the start of backward, for ``i = 0``) and gradient ``i``.
A tensor may also list ``"shapes"``: the shape of each gradient it holds (one, or a fused
bucket's members in buffer order), which compressors that need the matrix shape (PowerSGD)
plan with; the profiler writes them, the shipped profiles have none.

Example:
    >>> wl = Workload.builtin("vgg16")
    >>> len(wl.tensors), wl.backward_us
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["BUILTIN_WORKLOADS", "TensorProfile", "Workload", "WorkloadError",
           "atomic_write_text"]

# The paper's six evaluation models plus ResNet50 (profiles and their source:
# byteps_espresso/data/workloads/README.md).
BUILTIN_WORKLOADS = ("bert", "gpt2", "lstm", "resnet101", "resnet50", "ugatit", "vgg16")

# When a profile has no forward time we take half the backward time: the backward pass does
# about twice the forward's arithmetic (Kaplan et al. 2020, "Scaling Laws for Neural Language
# Models", sec. 2.1: forward ~2N, backward ~4N FLOPs per token).
FORWARD_OVER_BACKWARD = 0.5


class WorkloadError(ValueError):
    """A workload profile is malformed; the message names the file and the field."""


@dataclass(frozen=True)
class TensorProfile:
    """One gradient tensor.

    Attributes:
        name: parameter name (the key of the strategy).
        numel: element count (float32).
        ready_gap_us: backward time between the previous gradient and this one, microseconds.
        shapes: the shape of each gradient it holds (one; a fused bucket's members in buffer
            order), for compressors that need the matrix shape (PowerSGD); None: unknown.
    """

    name: str
    numel: int
    ready_gap_us: float
    shapes: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise WorkloadError("a tensor needs a non-empty name")
        if isinstance(self.numel, bool) or not isinstance(self.numel, int) or self.numel <= 0:
            raise WorkloadError(f"tensor {self.name!r}: numel must be a positive integer, "
                                f"got {self.numel!r}")
        if not isinstance(self.ready_gap_us, int | float) or isinstance(self.ready_gap_us, bool) \
                or not self.ready_gap_us >= 0:
            raise WorkloadError(f"tensor {self.name!r}: ready_gap_us must be a number >= 0, "
                                f"got {self.ready_gap_us!r}")
        if self.shapes is not None:
            object.__setattr__(self, "shapes", _shapes(self.name, self.shapes, self.numel))


@dataclass(frozen=True)
class Workload:
    """Tensors in backward order (index 0 is ready first, nearest the output layer).

    Attributes:
        tensors: the gradient tensors.
        forward_us: forward time; ``None`` means unknown (estimated, see ``forward_time_us``).
        model: a label.
        source: where the profile comes from.
    """

    tensors: tuple[TensorProfile, ...]
    forward_us: float | None = None
    model: str = "model"
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", tuple(self.tensors))
        if not self.tensors:
            raise WorkloadError("a workload needs at least one tensor")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise WorkloadError(f"tensor names must be unique; repeated: {', '.join(dup[:5])}")
        if self.forward_us is not None and not self.forward_us >= 0:
            raise WorkloadError(f"forward_us must be >= 0, got {self.forward_us!r}")

    @property
    def backward_us(self) -> float:
        return float(sum(t.ready_gap_us for t in self.tensors))

    @property
    def forward_time_us(self) -> float:
        """The forward time, or FORWARD_OVER_BACKWARD x backward when the profile lacks it."""
        if self.forward_us is not None:
            return float(self.forward_us)
        return FORWARD_OVER_BACKWARD * self.backward_us

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    # ---- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model,
            "source": self.source,
            "order": "backward order: index 0 is the first gradient ready (closest to the "
                     "output layer)",
            "time_unit": "microseconds",
            "dtype": "float32",
        }
        if self.forward_us is not None:
            out["forward_us"] = self.forward_us
        out["tensors"] = [{"name": t.name, "numel": t.numel, "ready_gap_us": t.ready_gap_us}
                          | ({"shapes": [list(s) for s in t.shapes]} if t.shapes else {})
                          for t in self.tensors]
        return out

    def without_shapes(self) -> bool:
        """Whether some tensor's shapes are unknown."""
        return any(t.shapes is None for t in self.tensors)

    @classmethod
    def from_dict(cls, data: Any, where: str = "workload") -> Workload:
        """Build from the JSON object; errors name ``where`` and the offending field.

        Raises:
            WorkloadError: a missing or malformed field.
        """
        if not isinstance(data, dict):
            raise WorkloadError(f"{where}: expected a JSON object with a 'tensors' list")
        unit = data.get("time_unit", "microseconds")
        if unit != "microseconds":
            raise WorkloadError(f"{where}: field 'time_unit' must be 'microseconds', got {unit!r}")
        dtype = data.get("dtype", "float32")
        if dtype != "float32":
            raise WorkloadError(f"{where}: field 'dtype' must be 'float32', got {dtype!r}")
        raw = data.get("tensors")
        if not isinstance(raw, list) or not raw:
            raise WorkloadError(f"{where}: field 'tensors' must be a non-empty list")
        tensors = []
        for i, item in enumerate(raw):
            field_name = f"tensors[{i}]"
            if not isinstance(item, dict):
                raise WorkloadError(f"{where}: field '{field_name}' must be an object")
            for key in ("name", "numel", "ready_gap_us"):
                if key not in item:
                    raise WorkloadError(f"{where}: field '{field_name}.{key}' is missing")
            try:
                tensors.append(TensorProfile(str(item["name"]), item["numel"],
                                             item["ready_gap_us"], item.get("shapes")))
            except WorkloadError as exc:
                raise WorkloadError(f"{where}: field '{field_name}': {exc}") from None
        forward = data.get("forward_us")
        if forward is not None and (isinstance(forward, bool)
                                    or not isinstance(forward, int | float) or forward < 0):
            raise WorkloadError(f"{where}: field 'forward_us' must be a number >= 0")
        try:
            return cls(tuple(tensors), forward, str(data.get("model", "model")),
                       str(data.get("source", "")))
        except WorkloadError as exc:
            raise WorkloadError(f"{where}: {exc}") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Workload:
        """Read a profile JSON file.

        Raises:
            WorkloadError: unreadable file, bad JSON, or a malformed field (names the file).
        """
        return cls.from_dict(read_json(path, WorkloadError, "workload file"), str(path))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the profile JSON (atomically: a temporary file renamed into place)."""
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def builtin(cls, model: str) -> Workload:
        """One of the shipped V100 profiles (``BUILTIN_WORKLOADS``).

        Raises:
            WorkloadError: unknown model name.
        """
        if model not in BUILTIN_WORKLOADS:
            raise WorkloadError(f"unknown built-in workload {model!r}; choose one of "
                                f"{', '.join(BUILTIN_WORKLOADS)}")
        ref = resources.files("byteps_espresso") / "data" / "workloads" / f"{model}.json"
        return cls.from_dict(json.loads(ref.read_text()), f"builtin:{model}")


def _shapes(name: str, shapes: Any, numel: int) -> tuple[tuple[int, ...], ...]:
    """``shapes`` as tuples of positive ints whose element counts add up to ``numel``.

    Raises:
        WorkloadError: not a list of lists of positive integers, or another element count.
    """
    ok = isinstance(shapes, list | tuple) and shapes and all(
        isinstance(s, list | tuple) and all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in s) for s in shapes)
    if not ok:
        raise WorkloadError(f"tensor {name!r}: shapes must be a non-empty list of shapes, each a "
                            f"list of positive integers (e.g. [[64, 128], [64]]), got {shapes!r}")
    out = tuple(tuple(int(d) for d in s) for s in shapes)
    total = sum(math.prod(s) for s in out)
    if total != numel:
        raise WorkloadError(f"tensor {name!r}: its shapes hold {total} elements, its numel says "
                            f"{numel}")
    return out


def read_json(path: str | os.PathLike[str], error: type[Exception], what: str) -> Any:
    """Parse the JSON file at ``path``; ``error`` (naming the file and ``what`` it should be)
    for an unreadable file or bad JSON. Shared by every loader of the strategy engine."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename,
    so a reader never sees a half-written file."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp",
                               dir=target.parent if str(target.parent) else ".")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
