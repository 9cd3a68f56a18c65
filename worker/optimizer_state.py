"""Optimizer state as a description the broadcast root sends and the other ranks adopt.

``broadcast_optimizer_state`` (``byteps_espresso.torch``) sends :func:`describe`'s output as
JSON (hyper-parameters of every group; per parameter, each state entry's dtype and shape when
it is a tensor, else its value), each other rank calls :func:`apply_description` to create,
reshape or drop entries until its state has the root's structure, and then every tensor of
:func:`state_tensors` is broadcast in the same order on every rank.

Example:
    >>> opt = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))])
    >>> describe(opt)["state"]
    [{}]
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["apply_description", "describe", "state_tensors"]


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def describe(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The structure and scalar contents of ``optimizer``'s state (JSON-encodable values
    as far as the state holds them; :mod:`byteps_espresso.worker.objects` checks)."""
    state: list[dict[str, Any]] = []
    for p in _params(optimizer):
        entries: dict[str, Any] = {}
        for key, value in optimizer.state.get(p, {}).items():
            if not isinstance(key, str):
                raise TypeError(f"state key {key!r} is not a string")
            if isinstance(value, torch.Tensor):
                entries[key] = {"tensor": [str(value.dtype).removeprefix("torch."),
                                           list(value.shape), value.device == p.device]}
            else:
                entries[key] = {"value": value}
        state.append(entries)
    return {
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "sizes": [len(g["params"]) for g in optimizer.param_groups],
        "shapes": [list(p.shape) for p in _params(optimizer)],
        "state": state,
    }


def apply_description(optimizer: torch.optim.Optimizer, description: dict[str, Any]) -> str | None:
    """Give ``optimizer`` the described hyper-parameters and state structure (tensor values
    are left for the broadcast). Returns what prevents it, or None."""
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    shapes = [list(p.shape) for p in _params(optimizer)]
    if sizes != description["sizes"] or shapes != description["shapes"]:
        return (f"this optimizer has parameter groups of sizes {sizes} and shapes {shapes}; "
                f"the root's are {description['sizes']} and {description['shapes']}: create "
                "the same optimizer over the same model on every rank")
    for group, hyper in zip(optimizer.param_groups, description["groups"], strict=True):
        group.update(hyper)
    for p, entries in zip(_params(optimizer), description["state"], strict=True):
        if not entries:
            optimizer.state.pop(p, None)
            continue
        state = optimizer.state[p]
        for key in [k for k in state if k not in entries]:
            del state[key]
        for key, entry in entries.items():
            if "value" in entry:
                state[key] = entry["value"]
                continue
            dtype_name, shape, on_param = entry["tensor"]
            dtype = getattr(torch, dtype_name)
            device = p.device if on_param else torch.device("cpu")
            have = state.get(key)
            if not (isinstance(have, torch.Tensor) and have.dtype == dtype
                    and list(have.shape) == shape and have.device == device):
                state[key] = torch.empty(shape, dtype=dtype, device=device)
    return None


def state_tensors(optimizer: torch.optim.Optimizer,
                  description: dict[str, Any]) -> list[torch.Tensor]:
    """The state tensors to broadcast, in the description's order (the same on every rank)."""
    out = []
    for p, entries in zip(_params(optimizer), description["state"], strict=True):
        for key, entry in entries.items():
            if "tensor" in entry:
                out.append(optimizer.state[p][key])
    return out
