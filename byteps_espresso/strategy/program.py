"""The compiled form of an Option: what every step finds, makes, opens and closes.

:func:`compile_option` turns an :class:`~byteps_espresso.strategy.options.Option` into a
:class:`Program` once (cached per Option): one :class:`Op` per step with the tensor's *form*
before and after it, the divisible or rooted *pair* it opens or closes, the shard path of the
extent it leaves (which group splits are open), where the pieces of the payload it leaves come
from, how many payloads a ``Decomp`` decodes (and a forwarding step moves), which ``Comp``
compresses chunk by chunk for an ``AlltoallC`` and which steps the non-root members of an open
``Reduce``/``GatherC`` sleep through. The executor (``worker/executor.py``), the reference
interpreter (``worker/reference.py``) and the cost model (``costs.py``) read the program
instead of each re-deriving this from the step list; the decision tree (``tree.py``) uses the
same pairing rule (:func:`closes`) and form rule (:func:`leaves`) to enumerate and validate
Options.

A step kind is one row of :data:`RULES` (the forms it takes and makes, the pair it opens or
closes; :func:`leaves` reads a row) plus one handler per interpreter; each interpreter checks
its handlers against the rows (``tests/unit/test_program.py`` runs all three on every step
kind).

Nothing here depends on the tensor's size or the group sizes: extents are *shard paths*
(``Op.shards``: the scopes of the open divisible splits, outermost first), which each
interpreter resolves for its sizes (:func:`shard_numel` for the largest shard, as the cost
model prices; ``layout.split`` per rank, as the executor runs).

Forwarding (the paper's footnote 2): the payloads one gathering step leaves (SUM) may travel
on through the next compressed step without being decoded, when that step moves a list of
payloads of one extent: a summing ``AllgatherC`` or a ``GatherC`` gathers every member's list
(``p1 x p2`` payloads, in group-rank order of the later step, then of the earlier), a
``BroadcastC`` hands the root's list to every member; the ``Decomp`` at the end decodes all of
them and sums them in that order. What stays illegal, rule by rule (:func:`refusal` words each):

- *shards are concatenated one payload each*: a closing ``AllgatherC`` (CONCAT) takes one
  payload per member; a SUM there would make a list of lists per shard, a form no step takes;
- *the servers sum one payload per pusher*: ``PushPullC`` takes one payload;
- *a payload all-reduce sums one payload per member*: ``AllreduceC`` takes one payload;
- *a split compresses dense chunks*: ``AlltoallC`` takes the chunks of a ``Comp``;
- *shards decode before they move*: CONCAT is decoded by the step right after it.

Example:
    >>> prog = compile_option(Option.parse("Comp(gpu) -> AlltoallC(intra) -> Decomp(gpu) "
    ...                                     "-> Allreduce(inter) -> Allgather(intra)"))
    >>> [op.makes.value for op in prog.ops]
    ['chunks', 'sum', 'dense', 'dense', 'dense']
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from byteps_espresso.strategy.options import Device, Kind, Option, OptionError, Scope, Step

__all__ = ["IN_FLIGHT", "REDUCE_SPLIT_BYTES", "RULES", "Form", "Op", "Origin", "Pair",
           "Pairing", "Program", "Rule", "closes", "compile_option", "leaves", "payload_count",
           "reduce_splits", "refusal", "shard_numel"]


class Form(str, enum.Enum):
    """What a worker holds between steps."""

    DENSE = "dense"  # float32 values of the extent
    PAYLOAD = "payload"  # one payload (a list of pieces) of the extent
    CHUNKS = "chunks"  # one payload per member of the next AlltoallC's group (its shards)
    SUM = "sum"  # payloads of this extent, one per member of each gathering group: sum them
    CONCAT = "concat"  # one payload per group member, each of its shard: decode and concatenate
    NONE = "none"  # nothing: a non-root member after Reduce/GatherC, until the Broadcast(C)


class Pairing(str, enum.Enum):
    """How the two halves of a two-step scheme relate."""

    DIVISIBLE = "divisible"  # ReduceScatter/AlltoallC split the extent; Allgather(C) undoes it
    ROOTED = "rooted"  # Reduce/GatherC leave data on the root; Broadcast(C) wakes the others


@dataclass(frozen=True)
class Rule:
    """One step kind's row: the forms it accepts and makes, and its pairing role.

    Attributes:
        takes: forms the step accepts.
        makes: form it leaves (on the root, for a rooted opener; the others hold ``NONE``).
        opens: the pair kind it opens.
        closes: the pair kind it closes.
        may_close: it closes only when the innermost open pair matches (``AllgatherC``: it
            ends a divisible scheme of its scope, or is an indivisible all-gather otherwise).
        makes_closing: form it leaves when it does close (``AllgatherC``: shards, CONCAT).
        takes_closing: forms it accepts when it does close (``AllgatherC``: one payload).

    A step that takes SUM forwards it (leaves SUM): one that makes SUM from a payload
    (a gatherer) gathers every member's list, any other (``BroadcastC``) moves the list.
    """

    takes: frozenset[Form]
    makes: Form
    opens: Pairing | None = None
    closes: Pairing | None = None
    may_close: bool = False
    makes_closing: Form | None = None
    takes_closing: frozenset[Form] | None = None


_D, _P = frozenset({Form.DENSE}), frozenset({Form.PAYLOAD})
_PS = frozenset({Form.PAYLOAD, Form.SUM})  # one payload, or gathered ones forwarded
RULES: dict[Kind, Rule] = {
    # Comp makes CHUNKS instead when its payload feeds an AlltoallC (Op.chunks).
    Kind.COMP: Rule(_D, Form.PAYLOAD),
    Kind.DECOMP: Rule(frozenset({Form.PAYLOAD, Form.SUM, Form.CONCAT}), Form.DENSE),
    Kind.ALLREDUCE: Rule(_D, Form.DENSE),
    # sums one payload per member inside the collective (a linear compressor's: tree.py)
    Kind.ALLREDUCE_C: Rule(_P, Form.PAYLOAD),
    Kind.REDUCE_SCATTER: Rule(_D, Form.DENSE, opens=Pairing.DIVISIBLE),
    Kind.ALLGATHER: Rule(_D, Form.DENSE, closes=Pairing.DIVISIBLE),
    Kind.REDUCE: Rule(_D, Form.DENSE, opens=Pairing.ROOTED),
    Kind.BROADCAST: Rule(_D, Form.DENSE, closes=Pairing.ROOTED),
    Kind.ALLGATHER_C: Rule(_PS, Form.SUM, closes=Pairing.DIVISIBLE, may_close=True,
                           makes_closing=Form.CONCAT, takes_closing=_P),
    Kind.ALLTOALL_C: Rule(frozenset({Form.CHUNKS}), Form.SUM, opens=Pairing.DIVISIBLE),
    Kind.GATHER_C: Rule(_PS, Form.SUM, opens=Pairing.ROOTED),
    Kind.BROADCAST_C: Rule(_PS, Form.PAYLOAD, closes=Pairing.ROOTED),
    Kind.PUSH_PULL: Rule(_D, Form.DENSE),
    Kind.PUSH_PULL_C: Rule(_P, Form.PAYLOAD),
}
assert set(RULES) == set(Kind)


def leaves(kind: Kind, form: Form, closing: bool = False) -> Form | None:
    """The form a ``kind`` step leaves when it finds ``form`` (``closing``: it closes the
    innermost open pair), or None when it does not take ``form`` (:func:`refusal` says why).
    The decision tree enumerates with it and the compiler checks with it."""
    rule = RULES[kind]
    takes = rule.takes_closing if closing and rule.takes_closing is not None else rule.takes
    if form not in takes:
        return None
    if form is Form.SUM:  # forwarded: still payloads to decode and sum
        return Form.SUM
    if closing and rule.makes_closing is not None:
        return rule.makes_closing
    return rule.makes


def refusal(kind: Kind, form: Form, closing: bool = False) -> str:
    """Why a ``kind`` step does not take ``form``, and what to change (for error messages)."""
    if form is Form.SUM and kind is Kind.ALLGATHER_C and closing:
        return ("an AllgatherC that closes a split concatenates one payload per shard and "
                "cannot forward gathered payloads; decode them first (Decomp, then Allgather "
                "or Comp -> AllgatherC)")
    if form is Form.SUM and kind is Kind.PUSH_PULL_C:
        return ("the servers sum one payload per pusher and cannot take gathered payloads; "
                "add Decomp -> Comp before PushPullC")
    if form is Form.SUM and kind is Kind.ALLREDUCE_C:
        return ("AllreduceC sums one payload per member and cannot take gathered payloads; "
                "add Decomp -> Comp before it, or forward them with AllgatherC")
    if form is Form.SUM:
        return (f"{kind.value} cannot forward gathered payloads (only a summing AllgatherC, "
                "GatherC or BroadcastC can); add Decomp before it")
    if form is Form.CONCAT:
        return "gathered shards must be decoded at once; add Decomp before it"
    takes = RULES[kind].takes_closing if closing and RULES[kind].takes_closing is not None \
        else RULES[kind].takes
    return f"needs {_forms(takes)}, the tensor holds {form.value} here"


def payload_count(scopes: Sequence[Scope], size: Callable[[Scope], int]) -> int:
    """How many payloads a SUM/CONCAT of the payload scopes ``scopes`` holds (one per member
    of each scope's group: their product; 1 for none)."""
    return math.prod(size(s) for s in scopes)


@dataclass(frozen=True)
class Pair:
    """An open/close pair of steps: ``open`` and ``close`` are step indices."""

    pairing: Pairing
    scope: Scope
    open: int
    close: int


@dataclass(frozen=True)
class Origin:
    """The step whose output a payload's pieces are (``layout.pieces`` lists them).

    Attributes:
        index: step index of the ``Comp``, or of the ``PushPullC`` the pieces belong to.
        ps: whether the pieces are PS partitions (a ``Comp`` feeding ``PushPullC``, and the
            servers' aggregate).
    """

    index: int
    ps: bool


@dataclass(frozen=True)
class Op:
    """One compiled step.

    Attributes:
        index, step: position and step.
        takes, makes: form before and after (``makes`` on the root of a rooted opener).
        opens, closes: the pair this step opens or closes (None: neither).
        shards: scopes of the divisible splits open after the step, outermost first: the
            extent held is the nested shard (full tensor when empty).
        piece_shards: the shard path each held payload covers (None while dense): the
            current extent, or for CONCAT the members' shards of the closed split; for a
            Decomp, those of the payloads it decodes.
        payloads: SUM/CONCAT: the scopes of the steps that gathered them (one payload per
            member of each group; :func:`payload_count`), outermost first; empty: one
            payload. For a Decomp: those it decodes.
        forwards: a compressed step that takes SUM: the payload scopes of the list each
            member sends on (empty: it moves one payload).
        chunks: Comp only: compress chunk by chunk, one per member of this scope's group
            (the next communication step is an AlltoallC of that scope).
        feeds: Comp only: index of the communication step that moves its payload.
        origin: the producer of the payload pieces held after the step (None while dense;
            for a Decomp: of the pieces it decodes).
        codec: the compressor of the payloads held after the step (for a Comp: its own; for a
            Decomp: of those it decodes): None for the job's or while dense, else a partner's
            name (``Comp(gpu,fp16)``).
        sleepers: rooted scopes open during the step (not the one it closes): members that
            are not root (group rank 0) of every one of them hold nothing and skip it.
        rooted: rooted scopes open after the step (any: one worker per machine holds data).
    """

    index: int
    step: Step
    takes: Form
    makes: Form
    opens: Pair | None
    closes: Pair | None
    shards: tuple[Scope, ...]
    piece_shards: tuple[Scope, ...] | None
    payloads: tuple[Scope, ...]
    forwards: tuple[Scope, ...]
    chunks: Scope | None
    feeds: int | None
    origin: Origin | None
    sleepers: tuple[Scope, ...]
    rooted: tuple[Scope, ...]
    codec: str | None = None

    @property
    def kind(self) -> Kind:
        return self.step.kind

    @property
    def scope(self) -> Scope | None:
        return self.step.scope

    @property
    def device(self) -> Device | None:
        return self.step.device


@dataclass(frozen=True)
class Program:
    """An Option compiled: one :class:`Op` per step, and its pairs."""

    option: Option
    ops: tuple[Op, ...]
    pairs: tuple[Pair, ...]

    def __len__(self) -> int:
        return len(self.ops)

    @functools.cached_property
    def forwards(self) -> bool:
        """Whether a step forwards gathered payloads undecoded (:attr:`Op.forwards`)."""
        return any(op.forwards for op in self.ops)

    @functools.cached_property
    def in_flight(self) -> int | None:
        """The step the executor leaves in flight (``Executor.start``): the last
        communication step when its kind is one of :data:`IN_FLIGHT` (only compute steps
        follow it), else None. The lane that runs the Option is free once this step is
        issued: the compute steps after it run in the call that waits for the result."""
        last = max((op.index for op in self.ops if not op.kind.is_compute), default=None)
        return last if last is not None and self.ops[last].kind in IN_FLIGHT else None


# The collectives the transport issues ``async_op`` (worker/transport.py) and the executor
# leaves in flight as an Option's last communication step (its handlers, executor._TAILS).
IN_FLIGHT = frozenset({Kind.ALLREDUCE, Kind.ALLGATHER, Kind.ALLREDUCE_C, Kind.ALLGATHER_C})


def closes(kind: Kind, scope: Scope, open_pairing: Pairing | None,
           open_scope: Scope | None) -> bool:
    """Whether a ``kind`` step of ``scope`` closes the innermost open pair (the one rule).

    A closing kind (``Allgather``, ``Broadcast``, ``BroadcastC``) must close a pair of its
    pairing and scope; ``AllgatherC`` closes one when it matches and is an indivisible
    all-gather otherwise.

    Raises:
        OptionError: a closing kind with no matching pair open.
    """
    rule = RULES[kind]
    if rule.closes is None:
        return False
    if open_pairing is rule.closes and open_scope is scope:
        return True
    if rule.may_close:
        return False
    raise OptionError(f"{kind.value}({scope.value}) does not close the divisible step "
                      "before it")


@dataclass
class _Open:
    pairing: Pairing
    scope: Scope
    index: int
    shards: tuple[Scope, ...]  # the shard path at the opener (restored by the closer)


def _next_comm(steps: Sequence[Step], i: int) -> int | None:
    return next((j for j in range(i + 1, len(steps)) if not steps[j].kind.is_compute), None)


class _Walk:
    """The compiler's state between steps; one method per step role."""

    def __init__(self, steps: Sequence[Step]) -> None:
        self.steps = steps
        self.stack: list[_Open] = []
        self.form = Form.DENSE
        self.shards: tuple[Scope, ...] = ()
        self.piece_shards: tuple[Scope, ...] | None = None
        self.payloads: tuple[Scope, ...] = ()
        self.origin: Origin | None = None
        self.codec: str | None = None  # the held payloads' compressor (None: the job's)
        self.closed: dict[int, int] = {}  # opener index -> closer index

    def rooted(self) -> tuple[Scope, ...]:
        return tuple(o.scope for o in self.stack if o.pairing is Pairing.ROOTED)

    def _closing(self, step: Step) -> bool:
        if step.kind.is_compute:
            return False
        top = self.stack[-1] if self.stack else None
        return closes(step.kind, step.scope, top and top.pairing,  # type: ignore[arg-type]
                      top and top.scope)

    def step(self, i: int) -> dict:
        step = self.steps[i]
        rule = RULES[step.kind]
        closing = self._closing(step)
        if leaves(step.kind, self.form, closing) is None:
            raise OptionError(f"step {i} {step}: {refusal(step.kind, self.form, closing)}")
        self._check_codec(i, step)
        row = {"takes": self.form, "opens": False, "closes": None, "chunks": None,
               "feeds": None, "sleepers": self.rooted(), "payloads": (),
               "forwards": self.payloads if self.form is Form.SUM and not step.kind.is_compute
               else (),
               "piece_shards": None, "origin": None, "codec": None}
        if step.kind is Kind.COMP:
            self.codec = step.codec
            makes = self._comp(i, row)
        elif step.kind is Kind.DECOMP:
            row.update(payloads=self.payloads, piece_shards=self.piece_shards,
                       origin=self.origin, codec=self.codec)
            makes, self.origin, self.piece_shards, self.payloads = Form.DENSE, None, None, ()
            self.codec = None
        else:
            makes = self._comm(i, rule, row, closing)
        if step.kind is not Kind.DECOMP and makes is not Form.DENSE:
            row.update(payloads=self.payloads, piece_shards=self.piece_shards,
                       origin=self.origin, codec=self.codec)
        row.update(makes=makes, shards=self.shards, rooted=self.rooted())
        self.form = makes
        return row

    def _check_codec(self, i: int, step: Step) -> None:
        """A Decomp names the compressor of the payloads it finds; the servers aggregate
        with the job's compressor only."""
        held = self.codec
        if step.kind is Kind.DECOMP and step.codec != held:
            raise OptionError(f"step {i} {step}: the payloads here are "
                              f"{_codec_name(held)}'s; write {step.kind.value}("
                              f"{step.arg}{'' if held is None else ',' + held})")
        if step.kind is Kind.PUSH_PULL_C and held is not None:
            raise OptionError(f"step {i} {step}: the servers aggregate payloads of the job's "
                              f"compressor, not {held}'s; compress with the job's compressor "
                              "(Comp(gpu)) before PushPullC")

    def _comp(self, i: int, row: dict) -> Form:
        j = _next_comm(self.steps, i)
        if j is None:
            raise OptionError(f"step {i} {self.steps[i]}: Comp must precede a communication "
                              "step")
        nxt = self.steps[j]
        row["feeds"] = j
        self.origin = Origin(j, True) if nxt.kind is Kind.PUSH_PULL_C else Origin(i, False)
        self.piece_shards, self.payloads = self.shards, ()
        if nxt.kind is Kind.ALLTOALL_C:
            row["chunks"] = nxt.scope
            return Form.CHUNKS
        return Form.PAYLOAD

    def _comm(self, i: int, rule: Rule, row: dict, closing: bool) -> Form:
        scope = self.steps[i].scope
        assert scope is not None
        makes = leaves(self.steps[i].kind, self.form, closing)
        assert makes is not None
        top = self.stack[-1] if self.stack else None
        if closing:
            assert top is not None
            self.stack.pop()
            self.closed[top.index] = i
            row["closes"] = top.index
            if top.pairing is Pairing.ROOTED:  # the closer's own non-roots take part
                row["sleepers"] = self.rooted()
            elif makes is Form.CONCAT:  # shards of the split: one per member
                self.piece_shards, self.payloads = self.shards, (scope,)
            self.shards = top.shards
        if rule.opens is not None:
            self.stack.append(_Open(rule.opens, scope, i, self.shards))
            row["opens"] = True
            if rule.opens is Pairing.DIVISIBLE:
                self.shards = (*self.shards, scope)
        if makes is Form.SUM and rule.makes is Form.SUM:  # gathers: every member's list
            self.piece_shards, self.payloads = self.shards, (*self.payloads, scope)
        elif makes is Form.PAYLOAD:
            self.piece_shards, self.payloads = self.shards, ()
        return makes


@functools.lru_cache(maxsize=8192)
def compile_option(option: Option) -> Program:
    """Compile ``option`` (cached): forms, pairs, shard paths, origins, sleepers per step.

    Raises:
        OptionError: a step finds a form it does not take, a closing step has nothing to
            close, a divisible/rooted step is never closed, or a Comp has no communication
            step after it. (The path grammar is ``tree.validate``'s.)
    """
    steps = option.steps
    walk = _Walk(steps)
    rows = [walk.step(i) for i in range(len(steps))]
    if walk.stack:
        top = walk.stack[-1]
        raise OptionError(f"{steps[top.index]} (step {top.index}) is never closed")
    if walk.form is not Form.DENSE:
        raise OptionError("the option must end with dense values (add Decomp)")
    pairs = {j: Pair(RULES[steps[j].kind].opens, steps[j].scope, j, i)  # type: ignore[arg-type]
             for j, i in walk.closed.items()}
    ops = tuple(Op(i, step, r["takes"], r["makes"], pairs[i] if r["opens"] else None,
                   pairs[r["closes"]] if r["closes"] is not None else None, r["shards"],
                   r["piece_shards"], r["payloads"], r["forwards"], r["chunks"], r["feeds"],
                   r["origin"], r["sleepers"], r["rooted"], r["codec"])
                for i, (step, r) in enumerate(zip(steps, rows, strict=True)))
    return Program(option, ops, tuple(pairs[j] for j in sorted(pairs)))


# How the transport runs a dense Reduce (worker/transport.py) and the cost model prices it: a
# gather to the root (p-1 messages, (p-1) n bytes at the root) for 2 members or below this
# size, else a reduce-scatter then a gather of the summed shards (2(p-1) messages, 2 (p-1)/p n
# bytes at the root; Rabenseifner's reduce with the shards summed in group-rank order, so the
# result stays bit-identical to the reference). The split wins above n = a B p / (p - 2);
# with a = 20 us per message and B = 25 Gbit/s (3125 bytes/us) that is 62.5 KB x p / (p-2),
# 125 KB at p = 4 and 83 KB at p = 8. Bytes of float32 values.
REDUCE_SPLIT_BYTES = 64 * 1024


def reduce_splits(members: int, nbytes: int) -> bool:
    """Whether a dense Reduce over ``members`` of ``nbytes`` each is a reduce-scatter plus a
    gather of shards (else a gather of the whole tensor)."""
    return members > 2 and nbytes >= REDUCE_SPLIT_BYTES


def _codec_name(codec: str | None) -> str:
    return "the job's compressor" if codec is None else codec


def _forms(forms: frozenset[Form]) -> str:
    return " or ".join(sorted(f.value for f in forms))


def shard_numel(numel: np.ndarray, shards: Sequence[Scope],
                size: Callable[[Scope], int]) -> np.ndarray:
    """Elements of the largest shard on the path ``shards`` (the first shards of a split are
    the longer ones: ``ceil`` at each level), for tensors of ``numel`` elements."""
    out = numel
    for scope in shards:
        out = np.ceil(out / size(scope))
    return out
