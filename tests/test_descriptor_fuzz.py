"""Fuzz the descriptor parser: mutated descriptors raise SchemeError and nothing else."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qscheme.descriptor import parse_scheme_text
from qscheme.errors import SchemeError

TEXTS = [p.read_text() for p in sorted((Path(__file__).resolve().parents[1] / "schemes").rglob("*.yaml"))]
ODD_VALUES = [None, 0, -1, 1.5, True, "", "N", "K/0", "ceil(K)", [], {}, [1, 2, 3], {"a": 1}, "x" * 50, "e2m1", 2**70]


def mutate_tree(tree: object, rng: random.Random) -> object:
    """Replace, delete or add one entry somewhere in a plain YAML tree."""
    if isinstance(tree, dict) and tree:
        key = rng.choice(list(tree))
        roll = rng.random()
        if roll < 0.25:
            del tree[key]
        elif roll < 0.5:
            tree[key] = copy.deepcopy(rng.choice(ODD_VALUES))
        elif roll < 0.6:
            tree[f"{key}_x"] = 1
        else:
            tree[key] = mutate_tree(tree[key], rng)
        return tree
    if isinstance(tree, list) and tree:
        index = rng.randrange(len(tree))
        tree[index] = mutate_tree(tree[index], rng) if rng.random() < 0.7 else copy.deepcopy(rng.choice(ODD_VALUES))
        return tree
    return copy.deepcopy(rng.choice(ODD_VALUES))


def mutate_text(text: str, rng: random.Random) -> str:
    """Byte-level damage: delete, duplicate or swap characters."""
    chars = list(text)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(chars))
        op = rng.random()
        if op < 0.4:
            del chars[i]
        elif op < 0.7:
            chars.insert(i, rng.choice(":-[]{}!&*#'\"\t\n ,0"))
        else:
            j = rng.randrange(len(chars))
            chars[i], chars[j] = chars[j], chars[i]
    return "".join(chars)


def check(text: str) -> None:
    try:
        parse_scheme_text(text, "fuzz.yaml")
    except SchemeError as exc:
        assert str(exc).strip(), "empty error message"
        # every problem is recorded where it is found; the catch-all means one was missed
        assert "the descriptor is incomplete" not in str(exc), str(exc)
        for problem in exc.problems:
            assert problem.location.file == "fuzz.yaml"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), which=st.integers(0, len(TEXTS) - 1), rounds=st.integers(1, 3))
def test_tree_mutations_only_raise_scheme_errors(seed: int, which: int, rounds: int) -> None:
    rng = random.Random(seed)
    tree = yaml.safe_load(TEXTS[which])
    for _ in range(rounds):
        tree = mutate_tree(tree, rng)
    check(yaml.safe_dump(tree, sort_keys=False))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), which=st.integers(0, len(TEXTS) - 1))
def test_text_mutations_only_raise_scheme_errors(seed: int, which: int) -> None:
    check(mutate_text(TEXTS[which], random.Random(seed)))


def test_recursive_alias_is_a_located_error() -> None:
    try:
        parse_scheme_text("name: x\nweight: &w\n  tensor: *w\n", "fuzz.yaml")
    except SchemeError as exc:
        assert "alias" in str(exc) and "fuzz.yaml:" in str(exc)
    else:
        raise AssertionError("a recursive alias must be refused")
