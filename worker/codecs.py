"""One compressor per device for one job: torch backend on the training device, numba on the host.

``Comp(gpu)``/``Decomp(gpu)`` run on the tensor's own device: the torch backend on an
accelerator; where the training device is the CPU, by default the numba backend on zero-copy
views of the tensors for every compressor but the casts (``ESPRESSO_DEVICE_KERNELS``: both
backends produce bit-identical payloads, and on host memory numba's kernels are up to 31x
faster than the same torch ops, BENCHMARKS.md "Kernels on the training device").
``Comp(cpu)``/``Decomp(cpu)`` run the numba backend on host arrays in the host pool, copying
dense values device -> host before and host -> device after. Payloads cross backends with
:func:`~byteps_espresso.kernels.base.to_numpy` / ``to_torch``.

Empty extents (a shard of a tensor with fewer elements than group members) are never handed
to a compressor: their payload is the empty tuple and they decode to an empty tensor.

Error feedback, when asked for, wraps each backend's compressor (``kernels.ErrorFeedback``);
residuals are kept per compression name (:func:`~byteps_espresso.worker.layout.codec_name`),
so each worker holds one residual per tensor range and step of its Option.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from byteps_espresso.kernels import base as kbase
from byteps_espresso.worker.layout import Extent, Piece

from byteps_espresso.config import DEVICE_KERNELS
from byteps_espresso.strategy.options import Device

__all__ = ["EMPTY", "CodecPair", "device_backend", "payload_spec"]

Pieces = Sequence[Piece]

EMPTY: tuple = ()

# Compressors whose torch kernels are as fast as numba's on host memory or faster: the casts
# (at 2^17-2^18 elements fp16 compresses 2-2.7x faster with torch, bf16 0.8-1.1x; BENCHMARKS.md
# "Kernels on the training device"). On the other compressors measured there numba is
# 1.2-31x faster.
_TORCH_ON_HOST = frozenset({"fp16", "bf16"})
# Elements of the tensor that :meth:`CodecPair.load_kernels` compresses: any size runs every
# kernel of a step, and a small one keeps the call to the loading itself.
_LOAD_NUMEL = 4096


def device_backend(device: torch.device, kernels: str = "auto", compressor: str = "") -> str:
    """The backend that runs ``Comp(gpu)``/``Decomp(gpu)`` of ``compressor`` on training
    ``device``.

    Args:
        device: the training device.
        kernels: ``torch``; ``numba`` (host memory only); ``auto``: torch on accelerators,
            and on the CPU the faster of the two for ``compressor`` (numba, but for the casts).
        compressor: the compressor's registered name.

    Raises:
        ValueError: an unknown choice, or numba for an accelerator's memory.
    """
    if kernels not in DEVICE_KERNELS:
        raise ValueError(f"unknown device kernels {kernels!r}; use one of "
                         f"{', '.join(DEVICE_KERNELS)} (ESPRESSO_DEVICE_KERNELS)")
    if kernels == "auto":
        return "numba" if device.type == "cpu" and compressor not in _TORCH_ON_HOST else "torch"
    if kernels == "numba" and device.type != "cpu":
        raise ValueError(f"ESPRESSO_DEVICE_KERNELS=numba needs host memory, but the training "
                         f"device is {device}; use torch or auto")
    return kernels


def payload_spec(compressor: kbase.Compressor, numel: int,
                 step: int | None = None) -> tuple[tuple[np.dtype, int], ...]:
    """(dtype, element count) of each payload array for ``numel`` elements at iteration
    ``step`` (None: the steady state); () when empty."""
    if numel == 0:
        return ()
    lengths = compressor.payload_lengths(numel, step)
    return tuple((np.dtype(d), int(n)) for d, n in zip(compressor.payload_dtypes, lengths,
                                                       strict=True))


def _cpu_copy(array: Any) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array.detach().to("cpu", copy=True)
    return torch.from_numpy(np.array(array, copy=True))


class CodecPair:
    """The job's compressor on both devices, with optional error feedback.

    Args:
        name: registered compressor name (``byteps_espresso.kernels.names()``).
        params: its JSON-scalar parameters (ratio, seed, ...).
        error_feedback: wrap both backends in ``kernels.ErrorFeedback``.
        device: the training device (where ``gpu`` steps run and results land).
        device_kernels: the backend of ``gpu`` steps, as :func:`device_backend` reads it.

    Raises:
        ValueError: unknown compressor or bad parameters (the kernels' message), or device
            kernels the device cannot run.
    """

    def __init__(self, name: str, params: Mapping[str, Any] | None = None, *,
                 error_feedback: bool = False, device: torch.device | str = "cpu",
                 device_kernels: str = "auto") -> None:
        from byteps_espresso import kernels

        self.name = name
        self.params = dict(params or {})
        self.error_feedback = error_feedback
        self.device = torch.device(device)
        self.device_kernels = device_kernels
        self._backend = {Device.GPU: device_backend(self.device, device_kernels, name),
                         Device.CPU: "numba"}
        self._by_device: dict[Device, kbase.Compressor] = {}
        for dev, backend in self._backend.items():
            comp = kernels.create(name, backend=backend, **self.params)
            if error_feedback:
                comp = kernels.ErrorFeedback(comp)
            self._by_device[dev] = comp
        # While True, every compress() also decodes its payload and records the compression
        # error (the optimizer sets it for one iteration in ESPRESSO_COMPRESSION_ERROR_EVERY).
        self.measuring = False
        self._errors: dict[str, tuple[float, float]] = {}

    def correct_momentum(self, momentum: float, clip_norm: float | None, workers: int) -> None:
        """Run DGC's recipe around the compressor on both devices (Lin et al., ICLR 2018;
        ``kernels.momentum.MomentumCorrection``): momentum correction with local
        accumulation, local gradient clipping at ``clip_norm / sqrt(workers)`` (None: no
        clipping) and momentum factor masking. It replaces error feedback, which it contains.
        """
        from byteps_espresso.kernels.momentum import MomentumCorrection

        from byteps_espresso import kernels

        for dev, backend in self._backend.items():
            self._by_device[dev] = MomentumCorrection(
                kernels.create(self.name, backend=backend, **self.params), momentum=momentum,
                masking=True, clip_norm=clip_norm, workers=workers)
        self.error_feedback = False

    def take_errors(self) -> dict[str, tuple[float, float]]:
        """{compression name: (squared norm of what was sent minus the input, squared norm
        of the input)} for every compression since the last call. With error feedback what
        was sent carries the residual of earlier iterations, and counts against the input."""
        errors, self._errors = self._errors, {}
        return errors

    def bare(self) -> CodecPair:
        """The same compressor on the same kernels, without error feedback or state (what
        probes time: they must not touch the job's residuals)."""
        return CodecPair(self.name, self.params, device=self.device,
                         device_kernels=self.device_kernels)

    def load_kernels(self, devices: Iterable[Device] = (Device.GPU, Device.CPU)) -> None:
        """Run one compression, one decoding and one sum of decoded payloads on each of
        ``devices`` now, on a small tensor through :meth:`bare` (no state is touched), so that
        the kernels load here and not in the lanes.

        The first compression of a process loads numba's kernels from its cache (about 0.2 s
        alone). In a lane that happened during the job's first backward pass, while the other
        ranks waited in its first collective: with a strategy file (nothing profiled), the
        first iteration of the LSTM of examples/train.py took 660-740 ms against a steady 40,
        its first ``Comp(gpu)`` 372 ms."""
        bare = self.bare()
        x = torch.ones(_LOAD_NUMEL, device=self.device)
        step = bare.steady_step
        for dev in devices:
            payload = bare.compress(dev, x, "espresso.load", step)
            bare.decompress(dev, payload, _LOAD_NUMEL, "espresso.load", step)
            # a Decomp of gathered payloads decodes and sums them in one kernel
            bare.aggregate(dev, [payload, payload], _LOAD_NUMEL, "espresso.load", step)

    def partner(self, name: str) -> CodecPair:
        """Compressor ``name`` on the same device and kernels, without error feedback: the
        partner that mixed Options use inside the machine (``Comp(gpu,fp16)``)."""
        return CodecPair(name, device=self.device, device_kernels=self.device_kernels)

    def compressor(self, device: Device) -> kbase.Compressor:
        return self._by_device[device]

    def on_host(self, device: Device) -> bool:
        """Whether ``device``'s steps run the numba backend (host arrays)."""
        return self._backend[device] == "numba"

    def spec(self, numel: int, step: int | None = None) -> tuple[tuple[np.dtype, int], ...]:
        """Payload layout for ``numel`` elements at ``step`` (None: the steady state;
        identical on both backends)."""
        return payload_spec(self._by_device[Device.CPU], numel, step)

    def stage(self, step: int) -> int | None:
        """The compressor's schedule stage at ``step`` (None: steady); payload layouts are
        the same for every step of a stage (dgc's sparsity warm-up)."""
        return self._by_device[Device.CPU].stage(step)

    @property
    def steady_step(self) -> int:
        """The first iteration after any schedule: what start-up probes time."""
        return self._by_device[Device.CPU].steady_step

    # ---- state between iterations (checkpoints) ---------------------------------------------
    def state_dict(self) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
        """Every compressor's state (error-feedback residuals, momenta) per device, as CPU
        tensors copied from it: ``{"gpu"|"cpu": {compression name: {slot: tensor}}}``."""
        return {dev.value: {name: {slot: _cpu_copy(a) for slot, a in slots.items()}
                            for name, slots in comp.export_state().items()}
                for dev, comp in self._by_device.items()}

    def load_state_dict(self, state: Mapping[str, Mapping[str, Mapping[str, torch.Tensor]]]
                        ) -> None:
        """Replace every compressor's state with ``state`` (from :meth:`state_dict`), each
        array moved to where its backend keeps it (the training device, or host numpy).

        Raises:
            ValueError: a device or state slot this codec does not have.
        """
        unknown = sorted(set(state) - {d.value for d in self._by_device})
        if unknown:
            raise ValueError(f"codec state for unknown device(s) {unknown}")
        for dev, comp in self._by_device.items():
            saved = state.get(dev.value, {})
            if self.on_host(dev):
                comp.import_state({n: {s: t.detach().cpu().numpy().copy() for s, t in sl.items()}
                                   for n, sl in saved.items()})
            else:
                comp.import_state({n: {s: t.detach().to(self.device, copy=True)
                                       for s, t in sl.items()} for n, sl in saved.items()})

    # ---- Comp / Decomp -----------------------------------------------------------------------
    def compress(self, device: Device, dense: torch.Tensor, cname: str, step: int) -> tuple:
        """Compress a 1-D float32 tensor on ``device``; returns the payload (arrays)."""
        if dense.numel() == 0:
            return EMPTY
        comp = self._by_device[device]
        if self.on_host(device):  # zero-copy where the training device is the CPU
            host = np.ascontiguousarray(dense.detach().cpu().numpy())
            payload, _ = comp.compress(host, name=cname, step=step)
        else:
            payload, _ = comp.compress(dense.detach().contiguous(), name=cname, step=step)
        payload = tuple(payload)
        if self.measuring:
            sent = self.decompress(device, payload, dense.numel(), cname, step)
            x = dense.detach().reshape(-1).to(sent.device, torch.float32)
            # dict assignment is atomic: lanes and the host pool compress concurrently
            self._errors[cname] = (float(torch.sum((sent - x) ** 2)), float(torch.sum(x * x)))
        return payload

    def _ctx(self, device: Device, numel: int, cname: str, step: int) -> kbase.Ctx:
        return self._by_device[device].context((numel,), "float32", name=cname, step=step)

    def _as_backend(self, device: Device, payload: tuple) -> tuple:
        if self.on_host(device):
            return kbase.to_numpy(payload)
        return kbase.to_torch(payload, self.device)

    def _to_train(self, value: Any) -> torch.Tensor:
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        return value.reshape(-1).to(self.device)

    def decompress(self, device: Device, payload: tuple, numel: int, cname: str,
                   step: int) -> torch.Tensor:
        """Decode one payload of ``numel`` elements on ``device``; result on the training device."""
        if numel == 0:
            return torch.zeros(0, dtype=torch.float32, device=self.device)
        comp = self._by_device[device]
        ctx = self._ctx(device, numel, cname, step)
        return self._to_train(comp.decompress(self._as_backend(device, payload), ctx))

    def aggregate(self, device: Device, payloads: Sequence[tuple], numel: int, cname: str,
                  step: int) -> torch.Tensor:
        """Decode every payload of ``numel`` elements and sum them in list order."""
        if numel == 0:
            return torch.zeros(0, dtype=torch.float32, device=self.device)
        comp = self._by_device[device]
        ctx = self._ctx(device, numel, cname, step)
        converted = [self._as_backend(device, p) for p in payloads]
        return self._to_train(comp.aggregate(converted, ctx))

    # ---- payloads made of pieces (see layout.pieces) ---------------------------------------
    def compress_pieces(self, device: Device, dense: torch.Tensor, extent: Extent,
                        parts: Pieces) -> list[tuple]:
        """Compress ``dense`` (the values of ``extent``) piece by piece."""
        base = extent.offset
        return [self.compress(device, dense[p.extent.offset - base:p.extent.end - base], p.name,
                              p.step) for p in parts]

    def decompress_into(self, device: Device, payload: tuple, piece: Piece,
                        out: torch.Tensor) -> None:
        """Decode one piece's payload on ``device`` into ``out`` (a flat float32 tensor of the
        piece's extent on the training device, a slice of a larger one)."""
        numel = piece.extent.numel
        if numel == 0:
            return
        comp = self._by_device[device]
        ctx = self._ctx(device, numel, piece.name, piece.step)
        comp.decompress_into(self._as_backend(device, payload), ctx, out)

    def decode_pieces(self, device: Device, payloads: Sequence[tuple],
                      parts: Pieces) -> torch.Tensor:
        """Decode every piece and concatenate them (the dense values of their extent). A
        single piece is its own decoded tensor, not a copy of it: every decoder returns a
        new tensor."""
        if len(parts) == 1:
            p = parts[0]
            return self.decompress(device, payloads[0], p.extent.numel, p.name, p.step)
        return self.decode_concat(device, [payloads], [parts])

    def decode_concat(self, device: Device, members: Sequence[Sequence[tuple]],
                      parts: Sequence[Pieces]) -> torch.Tensor:
        """Every member's pieces decoded one after another into one tensor (what decoding
        each and concatenating gives; a cast's decode writes straight into its place)."""
        total = sum(p.extent.numel for pieces in parts for p in pieces)
        out = torch.empty(total, dtype=torch.float32, device=self.device)
        at = 0
        for payloads, pieces in zip(members, parts, strict=True):
            for pl, p in zip(payloads, pieces, strict=True):
                n = p.extent.numel
                self.decompress_into(device, pl, p, out[at:at + n])
                at += n
        return out

    def aggregate_pieces(self, device: Device, members: Sequence[Sequence[tuple]],
                         parts: Pieces) -> torch.Tensor:
        """Sum the members' payloads of the same pieces (in list order), piece by piece. A
        single piece's sum is returned as it is, not copied by a concatenation: every
        aggregation returns a new tensor."""
        out = [self.aggregate(device, [m[j] for m in members], p.extent.numel, p.name, p.step)
               for j, p in enumerate(parts)]
        if len(out) == 1:
            return out[0]
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.float32, device=self.device)

    def flat_spec(self, parts: Pieces) -> tuple[tuple[np.dtype, int], ...]:
        """The array layout of a payload of ``parts``, all pieces' arrays in order."""
        return tuple(a for p in parts for a in self.spec(p.extent.numel))

    @staticmethod
    def flatten(payloads: Sequence[tuple]) -> tuple:
        """The arrays of every piece, in order (what a payload collective moves)."""
        return tuple(a for pl in payloads for a in pl)

    def unflatten(self, arrays: Sequence[Any], parts: Pieces) -> list[tuple]:
        """Split a flat array tuple back into one payload per piece."""
        out, i = [], 0
        for p in parts:
            n = len(self.spec(p.extent.numel))
            out.append(tuple(arrays[i:i + n]))
            i += n
        return out
