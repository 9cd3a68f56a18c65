"""The decision tree: every valid Option for one tensor, and the rules that make one valid.

All validity rules of the project live here, as tables plus three small functions
(:func:`validate`, :func:`enumerate_options`, :class:`Constraints`).

Path grammar (scopes)
    flat:          SCHEME(flat)
    hierarchical:  OPEN(intra)  SCHEME(inter)  CLOSE(intra)        (needs >1 machine and >1 GPU)
  where SCHEME is one indivisible step (``allreduce`` family, ``ps`` family) or a divisible
  pair OPEN CLOSE of one family pair (``scatter``/``gather``, ``reduce``/``broadcast``), and the
  intra steps of a hierarchical path are always a divisible pair.

Families (dense kind, compressed kind) -- the form of the tensor picks the kind:
    allreduce  Allreduce / AllgatherC        ps         PushPull / PushPullC
               (and AllreduceC for a compressor whose payloads sum, :func:`sums_payloads`)
    scatter    ReduceScatter / AlltoallC     gather     Allgather / AllgatherC (closes scatter)
    reduce     Reduce / GatherC              broadcast  Broadcast / BroadcastC

Form rules (compression points; the forms are the program's, ``program.leaves``)
    - ``Comp`` may precede any communication step whose input is dense; ``Decomp`` may follow
      any communication step that produced payloads.
    - the payloads a gathering step leaves (``AllgatherC``, ``AlltoallC``, ``GatherC``: SUM)
      are decoded by the next step, or forwarded by it undecoded when it moves a list of
      payloads of one extent (a summing ``AllgatherC``, a ``GatherC``, a ``BroadcastC``); the
      ``Decomp`` at the end then decodes all of them. Not through a closing ``AllgatherC``
      (shards are concatenated one payload each), ``PushPullC`` (the servers sum one payload
      per pusher) or ``AlltoallC`` (it splits dense chunks); gathered shards (CONCAT) are
      decoded at once.
    - re-compressing (``Decomp`` then ``Comp``) is allowed only after a ``Decomp`` that
      summed or concatenated several payloads (the data changed; otherwise it would decode and
      re-encode the same values).
    - the option ends dense; every ``Comp``/``Decomp`` is on ``gpu`` or ``cpu``.

Mixed compressors (:attr:`Constraints.partner`): a ``Comp`` for an intra step may use the
partner (fp16) instead of the job's compressor, ``Comp(gpu,fp16)``; the partner's payloads move
on intra steps only, its ``Decomp`` names it, and an Option with a partner has a ``Comp`` of
the job's compressor too (the one between machines).

Low-rank compressors (PowerSGD, ``lowrank.is_lowrank``): the uncompressed Options, and each
wrapped as ``Comp(gpu) -> S -> Decomp(gpu)`` (their sums of ``P`` and ``Q`` run ``S``); pass
``compressor=`` to :func:`enumerate_options` and :func:`validate` (docs in ``lowrank.py``).

Payloads that sum (:func:`sums_payloads`: fp16, whose half-precision values add inside the
collective as DDP's fp16 hook all-reduces them): the ``allreduce`` family has a second
compressed kind, ``AllreduceC`` (one payload per member, summed; ``Decomp`` decodes one), beside
``AllgatherC``; pass ``compressor=`` as for low-rank ones. For any other compressor
:func:`validate` refuses ``AllreduceC``.

Count (no constraints, hierarchical cluster with servers): 7,576, of which 2,776 with the
job's compressor alone, see :func:`count_decomposition` and docs/strategy.md (2,641 of those
without the ``ps`` family ours adds; the paper counts 4,341 for its vocabulary and path
shapes).

Example:
    >>> opts = enumerate_options(Cluster.preset(8, 8), Constraints(max_compressions=1))
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from byteps_espresso.strategy import lowrank
from byteps_espresso.strategy.cluster import Cluster
from byteps_espresso.strategy.options import Device, Kind, Option, OptionError, Scope, Step
from byteps_espresso.strategy.program import RULES, Form, Pairing, closes, compile_option, leaves

__all__ = ["FAMILIES", "ConstraintError", "Constraints", "Placements", "canonical_options",
           "count_decomposition", "enumerate_options", "option_forms", "option_set", "path_of",
           "sums_payloads", "validate"]


class ConstraintError(ValueError):
    """A user constraint cannot be parsed or is contradictory."""


# family -> (dense kind, compressed kind)
FAMILIES: dict[str, tuple[Kind, Kind]] = {
    "allreduce": (Kind.ALLREDUCE, Kind.ALLGATHER_C),
    "ps": (Kind.PUSH_PULL, Kind.PUSH_PULL_C),
    "scatter": (Kind.REDUCE_SCATTER, Kind.ALLTOALL_C),
    "gather": (Kind.ALLGATHER, Kind.ALLGATHER_C),
    "reduce": (Kind.REDUCE, Kind.GATHER_C),
    "broadcast": (Kind.BROADCAST, Kind.BROADCAST_C),
}
# Divisible schemes: opening family -> closing family.
PAIRS: dict[str, str] = {"scatter": "gather", "reduce": "broadcast"}
INDIVISIBLE = ("allreduce", "ps")
# Which families may form a scheme in which scope.
SCHEME_SCOPES: dict[str, tuple[Scope, ...]] = {
    "allreduce": (Scope.FLAT, Scope.INTER),
    "ps": (Scope.FLAT, Scope.INTER),
    "scatter": (Scope.FLAT, Scope.INTRA, Scope.INTER),
    "reduce": (Scope.FLAT, Scope.INTRA, Scope.INTER),
}
_OPENING_KINDS = {FAMILIES[f][i]: f for f in PAIRS for i in (0, 1)}
# The intra-machine partner of mixed Options: fp16 halves the bytes on the machine's links at
# a rounding error (options.ROUNDING), the pairing of the Espresso authors' schemes 2-5 (fp16
# inside the machine, the chosen compressor between machines).
PARTNER = "fp16"
# How each opening family pairs with its closer (program.Pairing).
_PAIRING = {"scatter": Pairing.DIVISIBLE, "reduce": Pairing.ROOTED}
assert all(RULES[FAMILIES[f][i]].opens is _PAIRING[f] for f in PAIRS for i in (0, 1))
_INDIVISIBLE_KINDS = {FAMILIES[f][i]: f for f in INDIVISIBLE for i in (0, 1)}
_INDIVISIBLE_KINDS[Kind.ALLREDUCE_C] = "allreduce"


# ---- constraints --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Constraints:
    """User constraints that prune the tree.

    Attributes:
        allow_cpu: whether Comp/Decomp may run on the host CPUs.
        allow_gpu: whether Comp/Decomp may run on the training device.
        forbid: step kinds that may not appear (e.g. ``{Kind.ALLTOALL_C}``).
        max_compressions: at most this many ``Comp`` per option (0: no compression).
        max_lossy: at most this many lossy compressions per option
            (:attr:`Option.lossy_compressions`: each ``Comp`` and each re-compression of a sum
            by the servers); 1 keeps every gradient to one compression error per iteration.
        flat_only / hierarchical_only: restrict the path shape.
        partner: the compressor a ``Comp`` for an intra step may use instead of the job's
            (mixed compressors in one Option: ``Comp(gpu,fp16) -> AlltoallC(intra) ->
            Decomp(gpu,fp16) -> Comp(gpu) -> AllgatherC(inter) -> ...``); None: the job's
            compressor only (``no-mixed``).
    """

    allow_cpu: bool = True
    allow_gpu: bool = True
    forbid: frozenset[Kind] = field(default_factory=frozenset)
    max_compressions: int | None = None
    max_lossy: int | None = None
    flat_only: bool = False
    hierarchical_only: bool = False
    partner: str | None = PARTNER

    def __post_init__(self) -> None:
        object.__setattr__(self, "forbid", frozenset(self.forbid))
        if self.flat_only and self.hierarchical_only:
            raise ConstraintError("flat-only and hierarchical-only exclude each other")
        if self.max_compressions is not None and self.max_compressions < 0:
            raise ConstraintError("max-compressions must be >= 0")
        if self.max_lossy is not None and self.max_lossy < 0:
            raise ConstraintError("max-lossy must be >= 0")

    @property
    def devices(self) -> tuple[Device, ...]:
        return tuple(d for d, ok in ((Device.GPU, self.allow_gpu), (Device.CPU, self.allow_cpu))
                     if ok)

    def allows(self, option: Option) -> bool:
        """Whether ``option`` survives these constraints (it must also be :func:`validate`-d)."""
        if any(s.kind in self.forbid for s in option.steps):
            return False
        if not self.allow_cpu and option.uses_cpu:
            return False
        if not self.allow_gpu and Device.GPU in option.devices:
            return False
        over = ((self.max_compressions is not None
                 and option.compressions > self.max_compressions)
                or (self.max_lossy is not None and option.lossy_compressions > self.max_lossy))
        if over:
            return False
        if option.partners and option.partners != {self.partner}:
            return False
        return not ((option.is_hierarchical and self.flat_only)
                    or (not option.is_hierarchical and self.hierarchical_only))

    def without_partner(self) -> Constraints:
        """These constraints with the job's compressor only (for a job whose compressor is
        the partner itself, where mixed Options would repeat the others)."""
        return replace(self, partner=None)

    def to_strings(self) -> list[str]:
        """The constraint in the CLI's ``--constraint`` syntax (round-trips through parse)."""
        out = []
        if not self.allow_cpu:
            out.append("no-cpu")
        if not self.allow_gpu:
            out.append("no-gpu")
        if self.forbid:
            out.append("forbid=" + ",".join(sorted(k.value for k in self.forbid)))
        if self.max_compressions is not None:
            out.append(f"max-compressions={self.max_compressions}")
        if self.max_lossy is not None:
            out.append(f"max-lossy={self.max_lossy}")
        if self.flat_only:
            out.append("flat-only")
        if self.hierarchical_only:
            out.append("hierarchical-only")
        if self.partner is None:
            out.append("no-mixed")
        elif self.partner != PARTNER:
            out.append(f"partner={self.partner}")
        return out

    @classmethod
    def parse(cls, items: Iterable[str], where: str = "--constraint") -> Constraints:
        """Parse ``no-cpu``, ``no-gpu``, ``no-ps``, ``forbid=AlltoallC,GatherC``,
        ``max-compressions=N``, ``max-lossy=N``, ``flat-only``, ``hierarchical-only``,
        ``no-mixed``, ``partner=NAME``.

        Raises:
            ConstraintError: unknown constraint or bad value (names ``where``).
        """
        values: dict = {"forbid": set()}
        for raw in items:
            item = raw.strip()
            name, _, arg = item.partition("=")
            handler = _CONSTRAINT_PARSERS.get(name)
            if handler is None:
                raise ConstraintError(f"{where}: unknown constraint {item!r}; known: "
                                      f"{', '.join(sorted(_CONSTRAINT_PARSERS))}")
            try:
                handler(values, arg)
            except (ValueError, OptionError) as exc:
                raise ConstraintError(f"{where}: bad constraint {item!r}: {exc}") from None
        values["forbid"] = frozenset(values["forbid"])
        try:
            return cls(**values)
        except ConstraintError as exc:
            raise ConstraintError(f"{where}: {exc}") from None


def _flag(key: str, value: bool):  # type: ignore[no-untyped-def]
    def handler(values: dict, arg: str) -> None:
        if arg:
            raise ValueError("takes no value")
        values[key] = value
    return handler


def _forbid(values: dict, arg: str) -> None:
    if not arg:
        raise ValueError("name step kinds, e.g. forbid=AlltoallC,GatherC")
    for name in arg.split(","):
        try:
            values["forbid"].add(Kind(name.strip()))
        except ValueError:
            raise ValueError(f"unknown step {name.strip()!r}; known: "
                             f"{', '.join(k.value for k in Kind if not k.is_compute)}") from None


def _no_ps(values: dict, arg: str) -> None:
    if arg:
        raise ValueError("takes no value")
    values["forbid"].update({Kind.PUSH_PULL, Kind.PUSH_PULL_C})


def _count(field_name: str, flag: str):  # type: ignore[no-untyped-def]
    def parse(values: dict, arg: str) -> None:
        if not arg.isdigit():
            raise ValueError(f"needs a non-negative integer, e.g. {flag}=1")
        values[field_name] = int(arg)
    return parse


def _partner(values: dict, arg: str) -> None:
    from byteps_espresso.kernels import names

    if arg not in names():
        raise ValueError(f"unknown compressor {arg!r}; known: {', '.join(names())}")
    values["partner"] = arg


_CONSTRAINT_PARSERS = {
    "no-cpu": _flag("allow_cpu", False),
    "no-gpu": _flag("allow_gpu", False),
    "no-ps": _no_ps,
    "forbid": _forbid,
    "max-compressions": _count("max_compressions", "max-compressions"),
    "max-lossy": _count("max_lossy", "max-lossy"),
    "flat-only": _flag("flat_only", True),
    "hierarchical-only": _flag("hierarchical_only", True),
    "no-mixed": _flag("partner", None),
    "partner": _partner,
}


# ---- validation ---------------------------------------------------------------------------------
def _comm_families(option: Option) -> list[tuple[str, Step]]:
    """Each communication step's family. Which step closes which is the program's one rule
    (:func:`~byteps_espresso.strategy.program.closes`): AllgatherC closes an open scatter of
    its scope and is the compressed all-reduce otherwise."""
    out: list[tuple[str, Step]] = []
    open_stack: list[tuple[str, Scope]] = []
    for step in option.steps:
        if step.kind.is_compute:
            continue
        scope = step.scope
        assert scope is not None
        top_fam, top_scope = open_stack[-1] if open_stack else (None, None)
        if closes(step.kind, scope, _PAIRING.get(top_fam), top_scope):  # type: ignore[arg-type]
            fam = PAIRS[top_fam]  # type: ignore[index]
            open_stack.pop()
        elif step.kind in _OPENING_KINDS:
            fam = _OPENING_KINDS[step.kind]
            open_stack.append((fam, scope))
        else:
            fam = _INDIVISIBLE_KINDS[step.kind]
        out.append((fam, step))
    if open_stack:
        raise OptionError(f"divisible step {open_stack[-1][0]}({open_stack[-1][1].value}) is "
                          "never closed")
    return out


def path_of(option: Option) -> tuple[str, str]:
    """(path, scheme) of a valid option, e.g. ("hierarchical", "scatter/gather(inter)").

    Raises:
        OptionError: the communication steps do not follow the path grammar.
    """
    comm = _comm_families(option)
    scopes = [s.scope for _, s in comm]
    fams = [f for f, _ in comm]

    def scheme(parts: list[tuple[str, Step]], scope: Scope) -> str:
        if any(s.scope is not scope for _, s in parts):
            raise OptionError(f"every step of the {scope.value} scheme must be {scope.value}")
        names = [f for f, _ in parts]
        if len(names) == 1 and names[0] in INDIVISIBLE:
            fam = names[0]
        elif len(names) == 2 and PAIRS.get(names[0]) == names[1]:
            fam = names[0]
        else:
            raise OptionError(f"not a scheme: {' -> '.join(names)}")
        if scope not in SCHEME_SCOPES[fam]:
            raise OptionError(f"scheme {fam} is not available in scope {scope.value}")
        return "/".join(names) + f"({scope.value})"

    if scopes and all(s is Scope.FLAT for s in scopes):
        return "flat", scheme(comm, Scope.FLAT)
    if len(comm) >= 3 and scopes[0] is Scope.INTRA and scopes[-1] is Scope.INTRA \
            and PAIRS.get(fams[0]) == fams[-1]:
        return "hierarchical", scheme(comm[1:-1], Scope.INTER)
    raise OptionError("communication must be one flat scheme, or intra-open, one inter "
                      "scheme, intra-close; got " + " -> ".join(str(s) for _, s in comm))


@functools.cache
def _tree_kind(compressor: str | None) -> str | None:
    """How ``compressor``'s capabilities change the tree: ``lowrank`` (``lowrank.py``),
    ``summing`` (:func:`sums_payloads`) or None (the elementwise codecs' tree; unknown names
    too, which the kernels registry names elsewhere)."""
    caps = None if compressor is None else lowrank.capabilities_of(compressor)
    if caps is None or not caps.linear:
        return None
    return "summing" if caps.elementwise else "lowrank"


def sums_payloads(compressor: str | None) -> bool:
    """Whether ``compressor``'s payloads of any range sum element by element inside a
    collective (``AllreduceC``): a linear elementwise codec (fp16)."""
    return _tree_kind(compressor) == "summing"


def validate(option: Option, cluster: Cluster | None = None,
             compressor: str | None = None) -> None:
    """Check ``option`` against every rule (and the cluster's shape, when given), for the job's
    ``compressor`` where its capabilities change the rules (a low-rank one: ``lowrank.py``;
    ``AllreduceC`` only for one whose payloads sum, :func:`sums_payloads`).

    Raises:
        OptionError: the first broken rule, in words.
    """
    if not sums_payloads(compressor) and any(s.kind is Kind.ALLREDUCE_C for s in option.steps):
        raise OptionError("AllreduceC sums payloads inside the collective, which only a "
                          "compressor whose payloads sum can (fp16); use AllgatherC, or name "
                          "that compressor")
    if _tree_kind(compressor) == "lowrank":
        _validate_lowrank(option, cluster, compressor)  # type: ignore[arg-type]
    else:
        _validate_codec(option, cluster)


def _validate_codec(option: Option, cluster: Cluster | None) -> None:
    """The rules for an elementwise codec (the tree above)."""
    path, _ = path_of(option)
    if cluster is not None:
        if path == "hierarchical" and not cluster.hierarchical:
            raise OptionError("hierarchical options need more than one machine and GPU")
        if option.uses_servers and cluster.servers == 0:
            raise OptionError("PushPull needs PS servers (servers > 0)")
    compressed = False
    steps = option.steps
    for i, step in enumerate(steps):
        if step.kind.is_compute:
            compressed = _check_compute(steps, i, compressed)
        elif (Form.DENSE in RULES[step.kind].takes) == compressed:
            form = "a payload" if compressed else "dense values"
            raise OptionError(f"step {i} {step}: the tensor holds {form} here")
    if compressed:
        raise OptionError("the option must end with dense values (add Decomp)")
    # the forms each step finds (forwarding of gathered payloads included), and re-compression
    ops = compile_option(option).ops
    for op in ops:
        if op.codec is not None and op.scope not in (None, Scope.INTRA):
            raise OptionError(f"step {op.index} {op.step}: {op.codec}'s payloads move only "
                              "inside the machine (intra steps); compress with the job's "
                              "compressor between machines")
    if option.partners and not _pairs_job_compressor((s.kind, s.codec) for s in steps):
        raise OptionError(f"{', '.join(sorted(option.partners))} compresses inside the machine "
                          "where the job's compressor crosses machines: add a Comp of the job's "
                          "compressor, or make the partner the job's compressor")
    for op in ops[2:]:
        before = ops[op.index - 1]
        if op.kind is Kind.COMP and before.kind is Kind.DECOMP and before.takes is Form.PAYLOAD:
            raise OptionError(f"step {op.index} {op.step}: re-compression only after a Decomp "
                              "that summed or concatenated gathered payloads")


def _validate_lowrank(option: Option, cluster: Cluster | None, compressor: str) -> None:
    """A low-rank compressor's Option: uncompressed, or ``Comp(gpu) -> S -> Decomp(gpu)`` with
    ``S`` uncompressed (the reasons are in ``lowrank.py``)."""
    dense = lowrank.inner(option) if option.is_compressed else option
    if dense is None or option.partners:
        raise OptionError(f"{option}: {compressor} compresses the whole tensor with sums of "
                          "dense factors: write Comp(gpu) -> <uncompressed steps> -> Decomp(gpu), "
                          "or the uncompressed steps alone")
    if option.uses_cpu:
        raise OptionError(f"{option}: {compressor} runs on the training device only (no numba "
                          "backend); write Comp(gpu) and Decomp(gpu)")
    _validate_codec(dense, cluster)


def _check_compute(steps: tuple[Step, ...], i: int, compressed: bool) -> bool:
    """Rules of a Comp/Decomp at position i; returns whether the tensor is compressed after."""
    step = steps[i]
    prev = steps[i - 1] if i else None
    nxt = steps[i + 1] if i + 1 < len(steps) else None
    if step.kind is Kind.COMP:
        if compressed:
            raise OptionError(f"step {i} {step}: the tensor is already compressed")
        if nxt is None or nxt.kind.is_compute:
            raise OptionError(f"step {i} {step}: Comp must precede a communication step")
        return True
    if not compressed or prev is None or prev.kind.is_compute:
        raise OptionError(f"step {i} {step}: Decomp must follow a compressed communication step")
    return False


# ---- enumeration --------------------------------------------------------------------------------
@functools.cache
def _step(kind: Kind, *, scope: Scope | None = None, device: Device | None = None,
          codec: str | None = None) -> Step:
    """One shared instance per distinct step (steps are immutable): a tree builds 13,296
    steps from about 30 distinct ones, which was half of its enumeration time."""
    return Step(kind, device=device, scope=scope, codec=codec)


def _skeletons(hierarchical: bool, servers: bool) -> Iterator[list[tuple[str, Scope]]]:
    """Communication skeletons: lists of (family, scope) following the path grammar."""

    def schemes(scope: Scope) -> Iterator[list[tuple[str, Scope]]]:
        for fam in INDIVISIBLE:
            if scope in SCHEME_SCOPES[fam] and (fam != "ps" or servers):
                yield [(fam, scope)]
        for open_fam, close_fam in PAIRS.items():
            if scope in SCHEME_SCOPES[open_fam]:
                yield [(open_fam, scope), (close_fam, scope)]

    yield from schemes(Scope.FLAT)
    if hierarchical:
        for open_fam, close_fam in PAIRS.items():
            for inner in schemes(Scope.INTER):
                yield [(open_fam, Scope.INTRA), *inner, (close_fam, Scope.INTRA)]


_CLOSING_FAMILIES = frozenset(PAIRS.values())


def _forms(skeleton: list[tuple[str, Scope]], partner: str | None, summing: bool = False) \
        -> Iterator[list[Step | tuple[Kind, str | None]]]:
    """Every placement of Comp/Decomp along a skeleton; compute steps as (kind, compressor)
    markers (None: the job's compressor). The form after each step is the program's
    (:func:`program.leaves`). A ``partner`` compresses only for intra steps, and its
    payloads move only on intra steps: the job's compressor is the one between machines.
    ``summing``: the job's payloads may also be summed by an ``AllreduceC``."""

    def kinds(fam: str, held: Form, held_codec: str | None) -> tuple[Kind, ...]:
        if held is Form.DENSE:
            return (FAMILIES[fam][0],)
        if summing and fam == "allreduce" and held_codec is None:
            return (FAMILIES[fam][1], Kind.ALLREDUCE_C)
        return (FAMILIES[fam][1],)

    def walk(k: int, form: Form, codec: str | None, recomp_ok: bool, acc: list) \
            -> Iterator[list]:
        if k == len(skeleton):
            yield acc + ([(Kind.DECOMP, codec)] if form is not Form.DENSE else [])
            return
        fam, scope = skeleton[k]
        starts: list[tuple[Form, str | None, list]] = [(form, codec, [])]
        if form is Form.DENSE and recomp_ok:
            starts.append((Form.PAYLOAD, None, [(Kind.COMP, None)]))
            if partner is not None and scope is Scope.INTRA:
                starts.append((Form.PAYLOAD, partner, [(Kind.COMP, partner)]))
        for held, held_codec, pre in starts:
            if held_codec is not None and scope is not Scope.INTRA:
                continue  # a partner's payloads stay inside the machine
            for kind in kinds(fam, held, held_codec):
                # a Comp before AlltoallC compresses one chunk per destination
                found = Form.CHUNKS if pre and kind is Kind.ALLTOALL_C else held
                makes = leaves(kind, found, fam in _CLOSING_FAMILIES)
                if makes is None:
                    continue
                yield from after(k, makes, held_codec, [*acc, *pre, _step(kind, scope=scope)])

    def after(k: int, makes: Form, codec: str | None, acc: list) -> Iterator[list]:
        """The ways on after skeleton step ``k`` left ``makes``."""
        if makes is Form.DENSE:
            yield from walk(k + 1, Form.DENSE, None, True, acc)
            return
        if k + 1 == len(skeleton):  # the final Decomp
            yield from walk(k + 1, makes, codec, True, acc)
            return
        # decode now (re-compressing next only if the Decomp sums or concatenates) ...
        yield from walk(k + 1, Form.DENSE, None, makes is not Form.PAYLOAD,
                        [*acc, (Kind.DECOMP, codec)])
        # ... or keep the payload(s) for the next step, which may refuse them
        if makes is not Form.CONCAT:
            yield from walk(k + 1, makes, codec, True, acc)

    yield from walk(0, Form.DENSE, None, True, [])


def _pairs_job_compressor(markers: Iterable) -> bool:
    """Whether a partner, if any Comp uses it, is paired with a Comp of the job's compressor
    (the partner inside the machine, the job's compressor between machines)."""
    codecs = {codec for kind, codec in markers if kind is Kind.COMP}
    return not codecs or None in codecs


class Placements(NamedTuple):
    """The Options of one form (a path with its compression steps, devices left open): the
    same steps but the devices of the Comp/Decomp steps at ``markers``; ``devices[r, j]``
    is option r's device at marker j."""

    options: tuple[Option, ...]
    markers: tuple[int, ...]
    devices: tuple[tuple[Device, ...], ...]


@functools.lru_cache(maxsize=64)
def _enumerate_forms(hierarchical: bool, servers: bool, constraints: Constraints,
                     summing: bool = False) -> tuple[Placements, ...]:
    out: list[Placements] = []
    devices = constraints.devices
    for skeleton in _skeletons(hierarchical, servers):
        for form in _forms(skeleton, constraints.partner, summing):
            markers = [i for i, s in enumerate(form) if isinstance(s, tuple)]
            if (markers and not devices) or not _pairs_job_compressor(form[i] for i in markers):
                continue
            options: list[Option] = []
            placed: list[tuple[Device, ...]] = []
            for combo in itertools.product(devices, repeat=len(markers)):
                steps = list(form)
                for i, dev in zip(markers, combo, strict=True):
                    kind, codec = form[i]  # type: ignore[misc]
                    steps[i] = _step(kind, device=dev, codec=codec)
                option = Option(tuple(steps))  # type: ignore[arg-type]
                if constraints.allows(option):
                    options.append(option)
                    placed.append(combo)
            if options:
                out.append(Placements(tuple(options), tuple(markers), tuple(placed)))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _enumerate(hierarchical: bool, servers: bool, constraints: Constraints,
               summing: bool = False) -> tuple[Option, ...]:
    return tuple(o for group in _enumerate_forms(hierarchical, servers, constraints, summing)
                 for o in group.options)


@functools.lru_cache(maxsize=64)
def _enumerate_lowrank(hierarchical: bool, servers: bool, constraints: Constraints) \
        -> tuple[Option, ...]:
    """A low-rank compressor's tree: the uncompressed Options, then each wrapped in its
    ``Comp(gpu)``/``Decomp(gpu)`` where the constraints allow."""
    dense = _enumerate(hierarchical, servers, replace(constraints, max_compressions=0))
    return (*dense, *(w for w in map(lowrank.wrap, dense) if constraints.allows(w)))


def _key(cluster: Cluster, constraints: Constraints | None, compressor: str | None) \
        -> tuple[bool, bool, Constraints, str | None]:
    """What a tree depends on: its path shapes, the constraints and how the compressor's
    capabilities change it (:func:`_tree_kind`)."""
    return (cluster.hierarchical, cluster.servers > 0, constraints or Constraints(),
            _tree_kind(compressor))


def _options(hierarchical: bool, servers: bool, constraints: Constraints,
             kind: str | None) -> tuple[Option, ...]:
    if kind == "lowrank":
        return _enumerate_lowrank(hierarchical, servers, constraints)
    return _enumerate(hierarchical, servers, constraints, kind == "summing")


def enumerate_options(cluster: Cluster, constraints: Constraints | None = None,
                      compressor: str | None = None) -> list[Option]:
    """Every valid Option for one tensor on ``cluster`` under ``constraints``.

    Args:
        cluster: decides whether hierarchical paths and PushPull steps exist.
        constraints: prunes the tree (default: none).
        compressor: the job's compressor, where its capabilities change the tree (a low-rank
            one, see ``lowrank.py``; one whose payloads sum, :func:`sums_payloads`); None or
            any other elementwise codec: the tree above.

    Returns:
        The options, uncompressed ones first within each path (a new list).
    """
    return list(_options(*_key(cluster, constraints, compressor)))


@functools.lru_cache(maxsize=64)
def _option_set(*key: Any) -> frozenset[Option]:
    return frozenset(_options(*key))


def option_forms(cluster: Cluster, constraints: Constraints | None = None,
                 compressor: str | None = None) -> tuple[Placements, ...] | None:
    """The options of :func:`enumerate_options`, in that order, grouped by form with their
    placements (cached: the same object for the same tree); None for a low-rank
    compressor's tree (its Options are wrapped, not placed)."""
    hierarchical, servers, constraints, kind = _key(cluster, constraints, compressor)
    if kind == "lowrank":
        return None
    return _enumerate_forms(hierarchical, servers, constraints, kind == "summing")


def option_set(cluster: Cluster, constraints: Constraints | None = None,
               compressor: str | None = None) -> frozenset[Option]:
    """The options of :func:`enumerate_options` as a set (cached), for membership tests."""
    return _option_set(*_key(cluster, constraints, compressor))


@functools.lru_cache(maxsize=64)
def _canonical(*key: Any) -> dict[Option, Option]:
    return {o: o for o in _options(*key)}


def canonical_options(cluster: Cluster, constraints: Constraints | None = None,
                      compressor: str | None = None) -> Mapping[Option, Option]:
    """Each option of :func:`enumerate_options` mapped to itself (cached): the tree's own
    object for an equal Option (None: not in the tree), so later lookups match by identity.
    Do not modify the mapping."""
    return _canonical(*_key(cluster, constraints, compressor))


def count_decomposition(cluster: Cluster, constraints: Constraints | None = None,
                        compressor: str | None = None) -> dict[str, int]:
    """Number of options per (path, scheme), plus "total" -- for docs and the CLI."""
    counts: Counter[str] = Counter()
    for option in enumerate_options(cluster, constraints, compressor):
        path, scheme = path_of(option)
        counts[f"{path} {scheme}"] += 1
    out = dict(sorted(counts.items()))
    out["total"] = sum(counts.values())
    return out
