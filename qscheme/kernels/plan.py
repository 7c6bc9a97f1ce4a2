"""Kernel plans: which accepted kernel runs which batch size M of one layer.

A layer is resolved once, but its inputs come in many batch sizes: M = ``x.numel() // K`` rows,
1 when a model decodes one token, hundreds when it reads a prompt. A GEMV kernel that reads the
weight once per call wins at small M; a kernel that dequantizes tiles and calls a GEMM wins at
large M. A kernel declares the batch sizes it is meant for, per device type, as data
(``KernelDeclaration.batch_ranges``, each with the measurement its boundary comes from), and
resolution returns a plan: ordered entries (M range -> kernel) that cover every M >= 0.

The rules (``build_plan``, a pure function of the resolver's accepted kernels):

- every kernel of a plan was accepted by the resolver for this scheme, shape, dtype and device;
- each M goes to the highest-priority accepted kernel whose range (declared, or overridden by
  the user's ``MSplit``) covers it; a kernel without a range covers every M, so with no ranges
  declared the plan is one entry: today's single kernel;
- an M that no accepted kernel's range covers goes to the highest-priority accepted kernel that
  fits the memory rule, outside its range (said in the entry's reason);
- memory: all kernels of a plan prepare from the same canonical weight, and at most one of them
  may hold a repacked copy (``PreparedState``); the others keep the canonical tensors. A second
  repacking kernel is left out of the plan, with the reason in ``KernelPlan.skipped``. So a plan
  never holds more than its most memory-hungry kernel would alone;
- a forced kernel gives a one-entry plan: it runs every M.

Nothing here reads the environment: ``parse_m_split`` turns the user's text (QSCHEME_M_SPLIT,
``m_split=``, ``qscheme resolve --m-split``) into an ``MSplit`` and the registry passes it in.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qscheme.errors import UsageError
from qscheme.kernels.declaration import KernelDeclaration, describe_batch

if TYPE_CHECKING:
    from qscheme.kernels.problem import Problem

M_SPLIT_VARIABLE = "QSCHEME_M_SPLIT"
OFF_WORDS: tuple[str, ...] = ("off", "none")
MAX_BATCH = 1 << 40  # larger than any batch; bounds what a typo can ask for

M_SPLIT_FORMS = (
    "a boundary M (e.g. 32: every declared boundary moves to 32, small-M kernels run M <= 31 and large-M kernels "
    "M >= 32), 'off' (the kernel for M = 1 runs every M), or kernel=RANGE pairs separated by commas "
    "(e.g. dequant_gemm=32-,cpu_gemv=-31; RANGE is LOW-HIGH, LOW- or -HIGH, or one M)"
)

Range = tuple[int, int | None]


@dataclass(frozen=True)
class MSplit:
    """A user's override of the declared batch ranges (see ``parse_m_split``)."""

    text: str
    off: bool = False
    boundary: int | None = None
    ranges: tuple[tuple[str, int, int | None], ...] = ()

    def range_for(
        self, declaration: KernelDeclaration, device_type: str, problem: Problem | None = None
    ) -> Range | None:
        """The kernel's range under this override (None: every M); ``off`` is handled by
        ``build_plan`` (the kernel for M = 1 runs every M)."""
        for name, low, high in self.ranges:
            if name == declaration.name:
                return low, high
        declared = declaration.batch_range(device_type, problem)
        if declared is None or self.boundary is None:
            return declared
        low, high = declared
        moved_low = self.boundary if low > 0 else 0
        moved_high = None if high is None else self.boundary - 1
        if moved_high is not None and moved_high < moved_low:
            return moved_low, moved_low - 1  # empty: a middle range squeezed out by the boundary
        return moved_low, moved_high

    def kernel_names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.ranges)


_PAIR = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.\-]*)=(.*)$")
_RANGE = re.compile(r"^\s*([0-9]*)\s*(-?)\s*([0-9]*)\s*$")


def _bad(origin: str, text: str, why: str) -> UsageError:
    return UsageError(f"{origin}={text!r}: {why}; expected {M_SPLIT_FORMS}. Fix the value, or unset it")


def _parse_range(origin: str, text: str, part: str, value: str) -> Range:
    match = _RANGE.match(value)
    if match is None or not (match[1] or match[3]):
        raise _bad(origin, text, f"{part!r} is not a range")
    low_text, dash, high_text = match[1], match[2], match[3]
    low = int(low_text) if low_text else 0
    high: int | None
    if not dash:
        high = low  # one M
    else:
        high = int(high_text) if high_text else None
    if low > MAX_BATCH or (high is not None and high > MAX_BATCH):
        raise _bad(origin, text, f"{part!r} is beyond M = {MAX_BATCH}")
    if high is not None and high < low:
        raise _bad(origin, text, f"{part!r} is empty ({high} < {low})")
    return low, high


def parse_m_split(text: object, origin: str = M_SPLIT_VARIABLE, kernels: Collection[str] = ()) -> MSplit | None:
    """``text`` as an MSplit; None for None or an empty value (the declared ranges hold).

    ``kernels``: the declared kernel names a ``name=RANGE`` pair may name (not checked when
    empty). Raises UsageError naming ``origin``, the value, the allowed forms and a fix.
    """
    if text is None:
        return None
    if isinstance(text, MSplit):
        return text
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise UsageError(
            f"{origin}={text!r}: takes a str or an int, not a {type(text).__name__}; expected {M_SPLIT_FORMS}"
        )
    value = str(text).strip()
    if not value:
        return None
    if value.lower() in OFF_WORDS:
        return MSplit(value, off=True)
    if value.isdigit():
        boundary = int(value)
        if not 1 <= boundary <= MAX_BATCH:
            raise _bad(origin, value, f"the boundary must lie in 1..{MAX_BATCH}")
        return MSplit(value, boundary=boundary)
    ranges: list[tuple[str, int, int | None]] = []
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        match = _PAIR.match(part)
        if match is None:
            raise _bad(origin, value, f"{part!r} is neither a boundary nor kernel=RANGE")
        name = match[1]
        if kernels and name not in kernels:
            close = difflib.get_close_matches(name, sorted(kernels), n=1)
            guess = f" (did you mean {close[0]!r}?)" if close else ""
            raise UsageError(
                f"{origin}={value!r}: {name!r} names no declared kernel{guess}; known kernels: "
                f"{', '.join(sorted(kernels))} (`qscheme kernels` lists them). Fix the name, or unset it"
            )
        if any(name == seen for seen, _, _ in ranges):
            raise _bad(origin, value, f"kernel {name!r} is given twice")
        ranges.append((name, *_parse_range(origin, value, part, match[2])))
    if not ranges:
        raise _bad(origin, value, "it names no kernel")
    return MSplit(value, ranges=tuple(ranges))


@dataclass(frozen=True)
class PlanEntry:
    """Inputs with ``m_min <= M <= m_max`` (no upper end when None) run on ``kernel``."""

    m_min: int
    m_max: int | None
    kernel: KernelDeclaration
    reason: str = ""

    def covers(self, m: int) -> bool:
        return self.m_min <= m and (self.m_max is None or m <= self.m_max)

    def describe(self) -> str:
        return f"{describe_batch(self.m_min, self.m_max)}: {self.kernel.name}"

    def as_json(self) -> dict[str, object]:
        return {"m_min": self.m_min, "m_max": self.m_max, "kernel": self.kernel.name, "reason": self.reason}


@dataclass(frozen=True)
class KernelPlan:
    """Ordered entries covering every M >= 0 once; ``skipped``: accepted kernels left out for
    memory (kernel name, why)."""

    entries: tuple[PlanEntry, ...]
    skipped: tuple[tuple[str, str], ...] = ()
    m_split: MSplit | None = field(default=None, compare=False)

    def entry_for(self, m: int) -> PlanEntry:
        for entry in self.entries:
            if entry.covers(m):
                return entry
        raise ValueError(f"the plan covers no M = {m}")  # never: build_plan covers every M >= 0

    def kernel_for(self, m: int) -> KernelDeclaration:
        return self.entry_for(m).kernel

    @property
    def kernels(self) -> tuple[KernelDeclaration, ...]:
        """Each kernel of the plan once, in the order of its first entry."""
        seen: dict[str, KernelDeclaration] = {}
        for entry in self.entries:
            seen.setdefault(entry.kernel.name, entry.kernel)
        return tuple(seen.values())

    @property
    def split(self) -> bool:
        """Whether more than one kernel runs the layer."""
        return len(self.kernels) > 1

    def ranges_of(self, name: str) -> list[PlanEntry]:
        return [entry for entry in self.entries if entry.kernel.name == name]

    def describe(self) -> str:
        """``M <= 15: cpu_gemv; M >= 16: dequant_gemm``."""
        return "; ".join(entry.describe() for entry in self.entries)

    def as_json(self) -> list[dict[str, object]]:
        return [entry.as_json() for entry in self.entries]


def _subtract(free: list[Range], taken: Range) -> tuple[list[Range], list[Range]]:
    """(what of ``free`` lies inside ``taken``, what remains free)."""
    low, high = taken
    inside: list[Range] = []
    remaining: list[Range] = []
    for start, stop in free:
        # the overlap of [start, stop] and [low, high] (None = no end)
        first = max(start, low)
        last = stop if high is None else (high if stop is None else min(stop, high))
        if last is not None and last < first:
            remaining.append((start, stop))
            continue
        inside.append((first, last))
        if start < first:
            remaining.append((start, first - 1))
        if last is not None and (stop is None or last < stop):
            remaining.append((last + 1, stop))
    return inside, remaining


def build_plan(
    accepted: Sequence[KernelDeclaration],
    device_type: str,
    forced: str | None = None,
    m_split: MSplit | None = None,
    problem: Problem | None = None,
) -> KernelPlan:
    """The plan over the resolver's accepted kernels (highest priority first); see the module
    docstring. Empty when none was accepted. ``problem``: the layer, for ranges declared under
    conditions (``BatchRange.when``); without it only unconditional ranges hold."""
    if not accepted:
        return KernelPlan((), m_split=m_split)
    if forced is not None:
        chosen = next(d for d in accepted if d.name == forced)
        return KernelPlan((PlanEntry(0, None, chosen, f"kernel {forced!r} is forced: it runs every M"),), (), m_split)
    if m_split is not None and m_split.off:
        decode = build_plan(accepted, device_type, problem=problem).kernel_for(1)
        why = f"{m_split.text!r}: the kernel for M = 1 runs every M"
        return KernelPlan((PlanEntry(0, None, decode, why),), (), m_split)
    free: list[Range] = [(0, None)]
    pieces: list[PlanEntry] = []
    skipped: list[tuple[str, str]] = []
    repacker: KernelDeclaration | None = None

    def fits(declaration: KernelDeclaration) -> bool:
        return declaration.prepared_state.shares_canonical or repacker is None or repacker.name == declaration.name

    for declaration in accepted:
        if not free:
            break
        declared = declaration.batch_range(device_type, problem)
        wanted = m_split.range_for(declaration, device_type, problem) if m_split is not None else declared
        full = wanted is None
        span: Range = (0, None) if wanted is None else wanted
        if span[1] is not None and span[1] < span[0]:
            continue  # an empty range (a boundary squeezed it out)
        inside, remaining = _subtract(free, span)
        if not inside:
            continue
        if not fits(declaration):
            assert repacker is not None
            skipped.append(
                (
                    declaration.name,
                    f"not in the plan: it repacks the weight, and {repacker.name} already holds a repacked copy "
                    "(a plan keeps at most one)",
                )
            )
            continue
        origin = "declared" if m_split is None or wanted == declared else f"set by {m_split.text!r}"
        why = "no M range: it runs every M it ranks first for" if full else f"its {origin} range"
        pieces.extend(PlanEntry(low, high, declaration, why) for low, high in inside)
        free = remaining
        if not declaration.prepared_state.shares_canonical:
            repacker = declaration
    for low, high in free:  # no accepted kernel's range covers these M: the best one that fits runs them
        fallback = next(d for d in accepted if fits(d))
        pieces.append(PlanEntry(low, high, fallback, "outside its range: no accepted kernel's range covers these M"))
        if not fallback.prepared_state.shares_canonical:
            repacker = fallback
    pieces.sort(key=lambda entry: entry.m_min)
    merged: list[PlanEntry] = []
    for entry in pieces:
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.kernel.name == entry.kernel.name
            and last.reason == entry.reason
            and last.m_max == entry.m_min - 1
        ):
            merged[-1] = PlanEntry(last.m_min, entry.m_max, last.kernel, last.reason)
        else:
            merged.append(entry)
    return KernelPlan(tuple(merged), tuple(skipped), m_split)
