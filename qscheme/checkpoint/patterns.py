"""``re:`` targets and ignore entries of a compressed-tensors config: checked, then compiled once.

compressed-tensors matches these with ``re.match`` against module names, and so does qscheme, so
that a config selects the same modules here as in the library. Python's ``re`` backtracks and
cannot be interrupted, so a time limit would need another regex engine (whose syntax and
answers differ from the library's) or a process per match. Instead each pattern's structure is
checked before any matching; a pattern that could backtrack catastrophically is refused:

* backreferences (``\\1``, ``(?P=name)``) and conditionals (``(?(1)...)``);
* nested quantifiers: a repeated group holding a variable-length repeat (``(a+)+``,
  ``(\\w+\\.)*``): ways to split a name among the iterations grow exponentially;
* a repeated choice whose alternatives can start alike or match nothing (``(a|ab)*``);
* more than ``MAX_BACKTRACKING_REPEATS`` variable-length repeats that can give characters
  back to what follows them (``.*a.*b.*c``): a failing match then tries about
  ``len(name) ** count`` splits.

What stays has no exponential case and tries at most a quadratic number of splits of a name,
and detect.py refuses tensor names longer than ``MAX_NAME_LENGTH`` before any pattern runs
(real ones are under ~300 characters), so one pattern's worst case against any name the loader
accepts is a few tens of milliseconds (``benchmarks/regex_speed.py --hostile``). Each entry of a
config is checked and compiled once, when the config is read (``compile_entries``).

The check itself takes time linear in the pattern's length: what each sequence of the pattern
can start with is worked out once, and what can follow each item in one pass from the end
(``check_steps`` counts the work; a 100,000-character pattern is checked in well under a second).
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qscheme.errors import CheckpointError


def _stdlib(name: str, before_311: str) -> Any:
    """A module of the re package's parser (Python 3.11 moved them; importing sre_parse warns there)."""
    try:
        return importlib.import_module(f"re.{name}")
    except ImportError:  # pragma: no cover - Python 3.10
        return importlib.import_module(before_311)


_sre = _stdlib("_constants", "sre_constants")
_sre_parse = _stdlib("_parser", "sre_parse")

PREFIX = "re:"
MAX_BACKTRACKING_REPEATS = 2
# Longest tensor name read. Worst case of an accepted pattern ~ MAX_NAME_LENGTH ** 2 steps; three
# giving repeats on a 6,000-character name took a minute.
MAX_NAME_LENGTH = 1024
FIX = (
    "write a flat pattern: one level of repetition, e.g. 're:.*mlp\\.experts\\.\\d+\\.down_proj$' "
    "(use '[\\w.]*' for '(\\w+\\.)*', '[^.]*' where '.*' should stop at a dot), or list exact module names"
)

# Characters a pattern's pieces are compared on: ASCII, a few others that \d, \w, \s or case
# folding treat specially, and one bit standing for every other character (module names are
# ASCII in practice; counting "other" as overlapping can only refuse more).
_PROBES = [chr(code) for code in range(128)] + list("\u00a0\u00e9\u00df\u017f\u212a\u0663\u4e2d\u2028")
_BITS = {char: 1 << position for position, char in enumerate(_PROBES)}
_OTHER = 1 << len(_PROBES)
_ALL = (_OTHER << 1) - 1
_CATEGORIES = {
    _sre.CATEGORY_DIGIT: r"\d",
    _sre.CATEGORY_NOT_DIGIT: r"\D",
    _sre.CATEGORY_SPACE: r"\s",
    _sre.CATEGORY_NOT_SPACE: r"\S",
    _sre.CATEGORY_WORD: r"\w",
    _sre.CATEGORY_NOT_WORD: r"\W",
}
_REPEATS = {_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", _sre.MAX_REPEAT)}
_ZERO_WIDTH = {_sre.AT, _sre.ASSERT, _sre.ASSERT_NOT}


class PatternRefused(Exception):
    """Why a pattern is refused (internal: config.py and detect.py add where it was written)."""


@dataclass
class _Analysis:
    ignore_case: bool
    backtracking: int = 0
    # Each sequence's (first characters, can match nothing), by id: the parsed pattern holds every
    # sequence for the whole check, so ids stay unique; computed once, so the check is linear.
    firsts: dict[int, tuple[int, bool]] = field(default_factory=dict)
    steps: int = 0  # items looked at, summed over the check (linear in the pattern's length)


def _mask(predicate: Any) -> int:
    mask = 0
    for char, bit in _BITS.items():
        if predicate(char):
            mask |= bit
    return mask


def _literal_mask(code: int) -> int:
    return _BITS.get(chr(code), _OTHER)


@functools.cache
def _range_mask(low: int, high: int) -> int:
    inside = _mask(lambda char: low <= ord(char) <= high)
    covers_other = high - low + 1 > bin(inside).count("1")
    return inside | (_OTHER if covers_other else 0)


@functools.cache
def _category_mask(category: object) -> int:
    escape = _CATEGORIES.get(category)
    if escape is None:
        return _ALL  # linebreak categories and others: compare as "anything"
    compiled = re.compile(escape)
    return _mask(lambda char: compiled.match(char) is not None) | _OTHER


@functools.cache
def _fold(mask: int) -> int:
    """Add the other case of every character in ``mask`` (for IGNORECASE patterns)."""
    members = {char for char, bit in _BITS.items() if mask & bit}
    folded = {variant for char in members for variant in (char.lower(), char.upper(), char.casefold())}
    return mask | _mask(lambda char: char in folded or char.lower() in folded or char.casefold() in folded)


def _set_mask(items: Sequence[tuple[Any, Any]]) -> int:
    mask, negate = 0, False
    for op, value in items:
        if op is _sre.NEGATE:
            negate = True
        elif op is _sre.LITERAL:
            mask |= _literal_mask(value)
        elif op is _sre.RANGE:
            mask |= _range_mask(*value)
        elif op is _sre.CATEGORY:
            mask |= _category_mask(value)
        else:
            return _ALL
    return (_ALL & ~mask) | _OTHER if negate else mask


def _first(items: Iterable[tuple[Any, Any]], analysis: _Analysis) -> tuple[int, bool]:
    """(characters a match of the sequence ``items`` can start with, whether it can match nothing).

    Computed once per sequence of the parsed pattern (``analysis.firsts``)."""
    known = analysis.firsts.get(id(items))
    if known is not None:
        return known
    mask, nullable = 0, True
    for op, value in items:
        item_mask, item_nullable = _item_first(op, value, analysis)
        mask |= item_mask
        if not item_nullable:
            nullable = False
            break
    analysis.firsts[id(items)] = (mask, nullable)
    return mask, nullable


def _item_first(op: Any, value: Any, analysis: _Analysis) -> tuple[int, bool]:
    analysis.steps += 1
    if op is _sre.LITERAL:
        mask = _literal_mask(value)
    elif op is _sre.NOT_LITERAL:
        mask = (_ALL & ~_literal_mask(value)) | _OTHER
    elif op is _sre.ANY:
        mask = _ALL
    elif op is _sre.IN:
        mask = _set_mask(value)
    elif op in _ZERO_WIDTH:
        return 0, True
    elif op is _sre.SUBPATTERN:
        return _first(value[-1], analysis)
    elif op in _REPEATS:
        low, _, body = value
        mask, nullable = _first(body, analysis)
        return mask, nullable or low == 0
    elif op is _sre.BRANCH:
        firsts = [_first(branch, analysis) for branch in value[1]]
        return _or(mask for mask, _ in firsts), any(nullable for _, nullable in firsts)
    elif op is getattr(_sre, "ATOMIC_GROUP", None):
        return _first(value, analysis)
    else:
        return _ALL, True
    return (_fold(mask) if analysis.ignore_case else mask), False


def _or(masks: Iterable[int]) -> int:
    out = 0
    for mask in masks:
        out |= mask
    return out


def _walk(items: Sequence[tuple[Any, Any]], follow: int, analysis: _Analysis, repeated: bool) -> None:
    """Check ``items`` (a sequence), followed by text starting with ``follow``; ``repeated`` when
    an enclosing quantifier can run it more than once."""
    for (op, value), after in zip(items, _followers(items, follow, analysis), strict=True):
        analysis.steps += 1
        if op in (_sre.GROUPREF, _sre.GROUPREF_EXISTS) or op is getattr(_sre, "GROUPREF_IGNORE", None):
            raise PatternRefused(
                "it uses a backreference or a conditional group, which can take exponential time to match"
            )
        if op in _REPEATS:
            low, high, body = value
            variable = high != low
            if variable and repeated:
                raise PatternRefused(
                    "it nests a variable-length repeat inside a repeated group (like '(a+)+' or '(\\w+\\.)*'); "
                    "the ways to split a module name among the iterations grow exponentially with its length"
                )
            body_first, _ = _first(body, analysis)
            if variable and body_first & after:
                analysis.backtracking += 1
            before = analysis.backtracking
            # A fixed count ({3}) is the body written out that many times; a variable one nests.
            _walk(body, after | (body_first if high > 1 else 0), analysis, repeated or (variable and high > 1))
            if not variable:
                analysis.backtracking = before + (analysis.backtracking - before) * min(high, 100)
        elif op is _sre.SUBPATTERN:
            _walk(value[-1], after, analysis, repeated)
        elif op is getattr(_sre, "ATOMIC_GROUP", None):
            _walk(value, after, analysis, repeated)
        elif op is _sre.BRANCH:
            branches = value[1]
            if repeated:
                _check_repeated_choice(branches, analysis)
            for branch in branches:
                _walk(branch, after, analysis, repeated)
        elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
            _walk(value[1], 0, analysis, repeated)


def _followers(items: Sequence[tuple[Any, Any]], follow: int, analysis: _Analysis) -> list[int]:
    """For each item of ``items``, the characters text after it can start with (the rest of the
    sequence, then ``follow`` where the rest can match nothing): one pass from the end."""
    afters = [0] * len(items)
    rest, rest_nullable = 0, True
    for index in range(len(items) - 1, -1, -1):
        afters[index] = rest | (follow if rest_nullable else 0)
        op, value = items[index]
        mask, nullable = _item_first(op, value, analysis)
        rest = mask | (rest if nullable else 0)
        rest_nullable = nullable and rest_nullable
    return afters


def _check_repeated_choice(branches: Sequence[Sequence[tuple[Any, Any]]], analysis: _Analysis) -> None:
    seen = 0
    for branch in branches:
        mask, nullable = _first(branch, analysis)
        if nullable or mask & seen:
            raise PatternRefused(
                "it repeats a choice whose alternatives can match the same text or nothing (like '(a|ab)*'); "
                "the ways to match a module name grow exponentially with its length"
            )
        seen |= mask


def pattern_problem(pattern: str) -> str | None:
    """Why ``pattern`` (the text after ``re:``) is refused, or None when it may be matched."""
    return _check(pattern)[0]


def check_steps(pattern: str) -> int:
    """How many pattern items the structural check looked at: at most a few per character of
    ``pattern`` (each sequence's first characters are worked out once), so a check takes time
    linear in the pattern's length; tests and benchmarks/regex_speed.py count it."""
    return _check(pattern)[1]


def _check(pattern: str) -> tuple[str | None, int]:
    """(why ``pattern`` is refused or None, the items the structural check looked at)."""
    try:
        parsed = _sre_parse.parse(pattern)
        re.compile(pattern)
    except re.error as exc:
        at = f" at {exc.pos}" if exc.pos is not None else ""
        return f"is not a valid regular expression ({exc.msg}{at})", 0
    except (RecursionError, OverflowError, MemoryError):
        return "is not a usable regular expression (nested too deeply or a repeat count too large to compile)", 0
    analysis = _Analysis(ignore_case=_uses_ignore_case(parsed))
    try:
        _walk(list(parsed), 0, analysis, repeated=False)
    except PatternRefused as exc:
        return f"is refused: {exc}", analysis.steps
    except RecursionError:
        return "is not a usable regular expression (groups nested too deeply to check)", analysis.steps
    if analysis.backtracking > MAX_BACKTRACKING_REPEATS:
        return (
            f"is refused: it has {analysis.backtracking} variable-length repeats (such as '.*') that can give "
            f"characters back to what follows them; a failing match tries about len(name)**{analysis.backtracking} "
            f"ways to split a module name (at most {MAX_BACKTRACKING_REPEATS} are allowed)"
        ), analysis.steps
    return None, analysis.steps


def _uses_ignore_case(parsed: Any) -> bool:
    """IGNORECASE for the whole pattern or a (?i:...) group; the analysis then folds case
    everywhere, which can only refuse more."""
    if parsed.state.flags & re.IGNORECASE:
        return True
    pending = [list(parsed)]
    while pending:
        for op, value in pending.pop():
            if op is _sre.SUBPATTERN:
                if value[1] & re.IGNORECASE:
                    return True
                pending.append(list(value[-1]))
            elif op in _REPEATS:
                pending.append(list(value[2]))
            elif op is _sre.BRANCH:
                pending.extend(list(branch) for branch in value[1])
            elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
                pending.append(list(value[1]))
            elif op is getattr(_sre, "ATOMIC_GROUP", None):
                pending.append(list(value))
    return False


def compile_pattern(entry: str, where: str = "") -> re.Pattern[str]:
    """The compiled pattern of a ``re:`` entry; CheckpointError naming ``where`` when refused.

    Not cached: ``compile_entries`` keeps one config's patterns, each checked once.
    """
    pattern = entry.removeprefix(PREFIX)
    problem = pattern_problem(pattern)
    if problem is not None:
        raise CheckpointError(refusal(entry, problem, where))
    return re.compile(pattern)


def compile_entries(
    entries: Sequence[str], into: dict[str, re.Pattern[str]], file: str = "", where: str = ""
) -> dict[str, re.Pattern[str]]:
    """Check and compile every ``re:`` entry of ``entries`` not yet in ``into`` (entry -> pattern).

    A refused entry raises CheckpointError naming ``file: where[index]`` when ``file`` is given.
    """
    for position, entry in enumerate(entries):
        if entry.startswith(PREFIX) and entry not in into:
            into[entry] = compile_pattern(entry, f"{file}: {where}[{position}]" if file else "")
    return into


def any_of(entries: Iterable[str], compiled: Mapping[str, re.Pattern[str]]) -> re.Pattern[str] | None:
    """One pattern that matches (with ``re.match``) exactly when one of the ``re:`` entries does.

    ``compiled`` holds every ``re:`` entry's pattern (``compile_entries``). Trying thousands of
    patterns in one call keeps detection fast; None when they cannot be joined (one has global
    flags such as '(?i)'): then match each.
    """
    patterns = [compiled[entry] for entry in entries if entry.startswith(PREFIX)]
    if any(pattern.flags != re.UNICODE for pattern in patterns):
        return None
    return _joined(tuple(dict.fromkeys(pattern.pattern for pattern in patterns)))


@functools.lru_cache(maxsize=64)
def _joined(patterns: tuple[str, ...]) -> re.Pattern[str] | None:
    if not patterns:
        return re.compile("(?!)")  # matches nothing
    try:
        return re.compile("|".join(f"(?:{pattern})" for pattern in patterns))
    except (re.error, RecursionError, OverflowError):
        return None


def refusal(entry: str, problem: str, where: str = "") -> str:
    """The error message for a refused ``re:`` entry written at ``where`` (file: key path)."""
    prefix = f"{where}: " if where else "target or ignore entry "
    if problem.startswith("is not a valid"):
        fix = "write a Python regular expression after 're:', e.g. 're:.*q_proj$'"
    else:
        fix = FIX
    return f"{prefix}{entry!r} {problem}; {fix}"
