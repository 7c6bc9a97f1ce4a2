"""Fuzz checkpoint loading: a damaged header, index or config either loads the same tensors or
raises a QSchemeError, before any module is built; ``qscheme inspect`` reports, never crashes.

Four shipped examples are damaged one way per run: the safetensors header of the example
generator's NVFP4 checkpoint (qscheme.examples.make_checkpoint) and of the ModelOpt FP8
fixture (byte flips and insertions in the JSON, a wrong length prefix, odd dtype / shape /
data_offsets values, duplicated keys, deep nesting, huge integers, booleans); the index of
the same checkpoint split into two shards (shard names with ../, NUL, unpaired surrogates,
wrong types); config.json and hf_quant_config.json (wrong types, bad or catastrophic regular
expressions, missing keys, deep nesting, duplicated keys, byte damage).

Some damage would load the same tensors if its guard were missing, so the check above cannot see
the guard go: a tensor entry written twice, data_offsets that leave a gap, overlap or trailing
bytes (the tensors' bytes moved to match), shards reached through ../, NUL or a lone surrogate,
and catastrophic regexes that select the same modules. Those runs must be refused, for the
reason the guard gives (``test_*_is_refused`` below).

"The same tensors" means the same bytes: when a run loads, every quantized module holds the
original weight tensors and every plain tensor holds the bytes of one of the original tensors
(a header may legitimately rename a plain tensor or call bfloat16 data float16).

Deterministic and bounded for CI: derandomized, no example database, 10 to 30 s in all on
one core, 1,170 runs (``max_examples`` below); the deadline only catches a hang.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import io
import json
import shutil
import struct
from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from checkpoint_cache import modelopt_fixture, scratch_root, single_threaded_torch  # noqa: F401  (autouse)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from qscheme.checkpoint.inspect import inspect_checkpoint
from qscheme.checkpoint.load import load_checkpoint
from qscheme.cli.inspect import run as inspect_command
from qscheme.errors import QSchemeError
from qscheme.examples.make_checkpoint import make_checkpoint
from qscheme.modules import QuantLinear

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=timedelta(seconds=30),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=False,
)
WEIGHT_FIELDS = ("codes", "scale", "global_scale", "global_scale_divisor", "zero_point")
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"

HUGE = [2**63, 2**64, 2**64 + 8, 2**70, -(2**63), 10**30]
ODD_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1.5,
    1e308,
    "",
    "F32",
    "X",
    [],
    {},
    [1, 2, 3],
    [-1],
    [True, 4],
    [0, True],
    [1.0, 2.0],
    ["0", "4"],
    {"a": 1},
    *HUGE,
    [0, 2**64],
    [2**64, 2**64 + 4],
]
DTYPES = ["F32", "F16", "BF16", "U8", "I8", "F8_E4M3", "F8_E5M2", "E8M0", "F4", "BOOL", "I64", "f32", "F8_E4M3FN"]
SHARD_NAMES: list[Any] = [
    "../model-00001-of-00002.safetensors",
    "./model-00001-of-00002.safetensors",
    "model-00001-of-00002.safetensors\x00",
    "model\x00.safetensors",
    "\ud800.safetensors",
    "\udcff-00001-of-00002.safetensors",
    "",
    ".",
    "..",
    "/etc/hostname",
    "sub/model-00001-of-00002.safetensors",
    "config.json",
    INDEX,
    "model-00003-of-00003.safetensors",
    "model.safetensors",
    5,
    None,
    True,
    [],
    {},
    *SHARDS,
]
BAD_PATTERNS = [
    "re:[",
    "re:(",
    "re:(a+)+$",
    r"re:(\w+\.?)+x$",
    r"re:model\.(\w+\.)*q_proj",
    "re:(a|ab)*c",
    "re:(?P<x>a)(?P=x)",
    "re:.*a.*b.*c.*d",
    "re:" + "(" * 300 + ")" * 300,
    "re:a{99999999999}",
    "re:\ud800",
    "re:.*",
    "re:.*q_proj$",
    "Linear",
    "Embedding",
    "model.layers.0.self_attn.q_proj",
    "model.layers.9.mlp.nothing",
    "",
]
NESTING_DEPTHS = [50, 1000, 100_000]


# ---------------------------------------------------------------------------- the examples


def _root() -> Path:
    root = scratch_root() / "fuzz"
    root.mkdir(exist_ok=True)
    return root


@functools.cache
def _example(name: str) -> Path:
    """The undamaged example folders: "ct" (one file), "sharded" (index + two shards), "modelopt"."""
    folder = _root() / name
    if name == "ct":
        make_checkpoint(folder, layers=1)
    elif name == "sharded":
        source = _example("ct")
        folder.mkdir()
        shutil.copy(source / "config.json", folder / "config.json")
        with safe_open(str(source / "model.safetensors"), framework="pt") as handle:
            tensors = {key: handle.get_tensor(key) for key in sorted(handle.keys())}
        names = sorted(tensors)
        halves = (names[: len(names) // 2], names[len(names) // 2 :])
        weight_map = {}
        for shard, members in zip(SHARDS, halves, strict=True):
            save_file({key: tensors[key] for key in members}, str(folder / shard), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(members, shard))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    else:
        folder.mkdir()
        for file in ("config.json", "hf_quant_config.json", "model.safetensors"):
            shutil.copy(modelopt_fixture("fp8") / file, folder / file)
    return folder


def _raw_hash(tensor: torch.Tensor) -> str:
    return hashlib.sha1(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class Original:
    """What the undamaged example loads to: each module's weight tensors, every stored tensor's bytes."""

    modules: dict[str, dict[str, torch.Tensor]]
    raw: frozenset[str]


def _weights(layer: QuantLinear) -> dict[str, torch.Tensor]:
    canonical = layer.weight_canonical
    return {name: value for name in WEIGHT_FIELDS if (value := getattr(canonical, name)) is not None}


@functools.cache
def _original(name: str) -> Original:
    folder = _example(name)
    checkpoint = load_checkpoint(folder, progress=False)
    raw = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            raw.update(_raw_hash(handle.get_tensor(key)) for key in handle.keys())
    modules = {module: _weights(layer) for module, layer in checkpoint.items()}
    assert modules, f"example {name} loads no quantized module"
    return Original(modules, frozenset(raw))


def _case(name: str) -> Path:
    """A fresh copy of an example to damage."""
    folder = _root() / "case"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(_example(name), folder)
    return folder


# ---------------------------------------------------------------------------- the check


def check_loads_same_or_refuses(folder: Path, original: Original, refusal: str | None = None) -> None:
    """load_checkpoint raises a QSchemeError (with no module built) or loads the same tensors;
    inspect_checkpoint and the ``qscheme inspect`` command never crash. With ``refusal``, the
    load must raise, with that text in its message, and inspect must report a problem."""
    built: list[str] = []
    error = None

    class CountingQuantLinear(QuantLinear):
        @classmethod
        def from_canonical(cls, *args: Any, **kwargs: Any) -> QuantLinear:
            built.append(str(kwargs.get("layer_name")))
            return QuantLinear.from_canonical(*args, **kwargs)

    loaded = None
    with mock.patch("qscheme.checkpoint.load.QuantLinear", CountingQuantLinear):
        try:
            loaded = load_checkpoint(folder, progress=False)
        except QSchemeError as exc:
            assert not built, f"modules {built} were built before the error"
            error = str(exc)
    inspection = inspect_checkpoint(folder)
    if refusal is not None:
        assert error is not None and refusal in error, f"expected a refusal saying {refusal!r}, got {error!r}"
        assert not inspection.ok, "load refuses, but inspect reports no problem"
    for as_json in (False, True):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(QSchemeError):
            inspect_command(Namespace(checkpoint=str(folder), json=as_json))
    if loaded is None:
        return
    assert inspection.ok, f"loads, but inspect reports problems: {inspection.problems}"
    assert set(loaded.modules) == set(original.modules)
    for module, layer in loaded.items():
        weights = _weights(layer)
        expected = original.modules[module]
        assert set(weights) == set(expected), module
        for field, value in weights.items():
            assert value.dtype == expected[field].dtype and torch.equal(value, expected[field]), f"{module}.{field}"
    for tensor_name, tensor in loaded.tensors.items():
        assert _raw_hash(tensor) in original.raw, f"plain tensor {tensor_name!r} holds bytes no original tensor has"


# ---------------------------------------------------------------------------- JSON damage


def _dumps(value: Any) -> str:
    return json.dumps(value, allow_nan=True)


def _nested(depth: int, inner: Any) -> str:
    return "[" * depth + _dumps(inner) + "]" * depth


def _object_text(pairs: list[tuple[str, str]]) -> str:
    """A JSON object from (key, value text) pairs: keys may repeat, values may be raw text."""
    return "{" + ",".join(f"{_dumps(key)}:{text}" for key, text in pairs) + "}"


def _damage_bytes(text: bytes, draw: Callable[..., Any]) -> bytes:
    """Flip, insert or delete a few bytes."""
    data = bytearray(text)
    for _ in range(draw(st.integers(1, 3))):
        position = draw(st.integers(0, max(len(data) - 1, 0)))
        kind = draw(st.sampled_from(["flip", "insert", "delete"]))
        if kind == "flip" and data:
            data[position] ^= draw(st.integers(1, 255))
        elif kind == "insert":
            data.insert(position, draw(st.sampled_from(list(b'{}[]",:0-9eE.\\ \x00\xff\xc3tfn'))))
        elif data:
            del data[position]
    return bytes(data)


def _tree_paths(tree: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    paths = [prefix]
    if isinstance(tree, dict):
        for key, value in tree.items():
            paths += _tree_paths(value, (*prefix, key))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            paths += _tree_paths(value, (*prefix, index))
    return paths


def _get(tree: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _mutate_tree(tree: Any, draw: Callable[..., Any], odd: list[Any]) -> str:
    """One structural change somewhere in a JSON tree; returns the new JSON text."""
    tree = copy.deepcopy(tree)
    path = draw(st.sampled_from(_tree_paths(tree)))
    kind = draw(st.sampled_from(["replace", "delete", "add", "nest", "duplicate", "rename"]))
    if not path:
        if kind == "nest":
            return _nested(draw(st.sampled_from(NESTING_DEPTHS)), tree)
        return _dumps(draw(st.sampled_from(odd)))
    parent, key = _get(tree, path[:-1]), path[-1]
    if kind == "replace":
        parent[key] = copy.deepcopy(draw(st.sampled_from(odd)))
    elif kind == "delete":
        del parent[key]
    elif kind == "add" and isinstance(parent, dict):
        parent[draw(st.sampled_from(["extra", "", "\ud800", "a\x00b", str(key) + "_"]))] = draw(st.sampled_from(odd))
    elif kind == "add":
        parent.append(copy.deepcopy(draw(st.sampled_from(odd))))
    elif kind == "rename" and isinstance(parent, dict):
        parent[draw(st.sampled_from(["", "\ud800", "a\x00b", str(key).upper(), str(key) + " "]))] = parent.pop(key)
    elif kind in ("nest", "duplicate"):
        marker = "\x01FUZZ\x01"
        value = parent[key]
        parent[key] = marker
        text = _dumps(tree)
        if kind == "nest":
            replacement = _nested(draw(st.sampled_from(NESTING_DEPTHS)), value)
        elif isinstance(parent, dict):  # the key written twice: the first time with another value
            replacement = _dumps(draw(st.sampled_from(odd))) + f",{_dumps(key)}:" + _dumps(value)
        else:
            replacement = _dumps(value) + "," + _dumps(value)
        return text.replace(_dumps(marker), replacement, 1)
    return _dumps(tree)


# ---------------------------------------------------------------------------- safetensors headers


def _split(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + size]), raw[8 + size :]


@st.composite
def damaged_header(draw: Callable[..., Any], header: dict[str, Any]) -> tuple[bytes, int | None]:
    """(header bytes, length prefix or None for the true length) of one kind of damage."""
    names = sorted(key for key in header if key != "__metadata__")
    kind = draw(st.sampled_from(["benign", "field", "tweak", "entry", "tree", "duplicate", "bytes", "prefix"]))
    prefix: int | None = None
    if kind == "benign":  # changes that keep every tensor's bytes: the load must give the same tensors
        header = copy.deepcopy(header)
        plain = [name for name in names if header[name]["dtype"] in ("BF16", "F16")]
        action = draw(st.sampled_from(["reorder", "metadata", "retype", "reshape", "pad"]))
        if action == "reorder":
            header = dict(reversed(header.items()))
        elif action == "metadata":
            header["__metadata__"] = draw(st.sampled_from([{"format": "pt", "note": "x" * 100}, {}]))
        elif action in ("retype", "reshape") and plain:
            entry = header[draw(st.sampled_from(plain))]
            if action == "retype":
                entry["dtype"] = {"BF16": "F16", "F16": "BF16"}[entry["dtype"]]
            else:
                entry["shape"] = [1, *entry["shape"]]
        text = _dumps(header) + " " * draw(st.sampled_from([0, 1, 7])) * (action == "pad")
    elif kind in ("field", "tweak"):
        header = copy.deepcopy(header)
        entry = header[draw(st.sampled_from(names))]
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        if kind == "field":
            entry[field] = draw(st.sampled_from([*ODD_VALUES, *DTYPES]))
        elif field == "dtype":
            entry[field] = draw(st.sampled_from(DTYPES))
        else:
            values = entry[field]
            if values:
                index = draw(st.integers(0, len(values) - 1))
                change = draw(st.sampled_from([1, -1, 2, -2, 4, 8, 16]))
                values[index] = draw(st.sampled_from([values[index] + change, values[index] * 2, 0, True, False]))
            else:
                values.append(draw(st.sampled_from([0, 1, 2])))
        text = _dumps(header)
    elif kind == "entry":
        header = copy.deepcopy(header)
        name = draw(st.sampled_from(names))
        action = draw(st.sampled_from(["delete", "copy", "rename", "odd"]))
        if action == "delete":
            del header[name]
        elif action == "copy":
            header[draw(st.sampled_from(["model.layers.0.extra.weight", name + "_copy", "x"]))] = header[name]
        elif action == "rename":
            new = draw(st.sampled_from(["", "\ud800", "a\x00b", "../" + name, name.replace(".", ".."), "weight"]))
            header[new] = header.pop(name)
        else:
            header[name] = draw(st.sampled_from(ODD_VALUES))
        text = _dumps(header)
    elif kind == "tree":
        text = _mutate_tree(header, draw, [*ODD_VALUES, *DTYPES])
    elif kind == "duplicate":  # one tensor written twice, the second time elsewhere in the data
        name = draw(st.sampled_from(names))
        other = draw(st.sampled_from(names))
        pairs = [(key, _dumps(value)) for key, value in header.items()]
        pairs.insert(draw(st.integers(0, len(pairs))), (name, _dumps(header[other])))
        text = _object_text(pairs)
    else:
        text = _dumps(header)
    data = text.encode("utf-8", "surrogatepass")
    if kind == "bytes":
        data = _damage_bytes(data, draw)
    if kind == "prefix" or (kind == "bytes" and draw(st.booleans())):
        prefix = draw(
            st.sampled_from([len(data) + 1, len(data) - 1, len(data) + 8, 0, 7, 2**64 - 1, 2**63, 100 * 2**20 + 1])
        )
    return data, prefix


def _write_safetensors(path: Path, header: bytes, prefix: int | None, data: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header) if prefix is None else prefix) + header + data)


def _check_damaged_header(data: st.DataObject, example: str) -> None:
    original = _original(example)
    header, tensor_data = _split(_example(example) / "model.safetensors")
    text, prefix = data.draw(damaged_header(header))
    folder = _case(example)
    _write_safetensors(folder / "model.safetensors", text, prefix, tensor_data)
    check_loads_same_or_refuses(folder, original)


@pytest.mark.slow  # over a hundred damaged checkpoints loaded
@settings(FUZZ, max_examples=400)
@given(st.data())
def test_damaged_safetensors_header_loads_the_same_or_raises(data: st.DataObject) -> None:
    _check_damaged_header(data, "ct")


@pytest.mark.slow  # over a hundred damaged checkpoints loaded
@settings(FUZZ, max_examples=120)
@given(st.data())
def test_damaged_modelopt_header_loads_the_same_or_raises(data: st.DataObject) -> None:
    _check_damaged_header(data, "modelopt")


# ---------------------------------------------------------------------------- index files


@pytest.mark.slow  # over a hundred damaged checkpoints loaded
@settings(FUZZ, max_examples=200)
@given(st.data())
def test_damaged_index_loads_the_same_or_raises(data: st.DataObject) -> None:
    original = _original("sharded")
    index = json.loads((_example("sharded") / INDEX).read_text())
    weight_map = index["weight_map"]
    kind = data.draw(st.sampled_from(["shard", "tensor", "tree", "bytes"]))
    if kind == "shard":
        changed = copy.deepcopy(index)
        for name in data.draw(st.lists(st.sampled_from(sorted(weight_map)), min_size=1, max_size=3, unique=True)):
            changed["weight_map"][name] = data.draw(st.sampled_from(SHARD_NAMES))
        text = _dumps(changed)
    elif kind == "tensor":
        changed = copy.deepcopy(index)
        name = data.draw(st.sampled_from(sorted(weight_map)))
        action = data.draw(st.sampled_from(["delete", "rename", "add"]))
        if action == "delete":
            del changed["weight_map"][name]
        elif action == "rename":
            new = data.draw(st.sampled_from(["", "\ud800", "a\x00b", name + "_", name.upper()]))
            changed["weight_map"][new] = changed["weight_map"].pop(name)
        else:
            changed["weight_map"]["model.layers.0.ghost.weight"] = data.draw(st.sampled_from(SHARD_NAMES))
        text = _dumps(changed)
    elif kind == "tree":
        text = _mutate_tree(index, data.draw, [*ODD_VALUES, *SHARD_NAMES])
    else:
        text = _damage_bytes(_dumps(index).encode(), data.draw).decode("utf-8", "surrogateescape")
    folder = _case("sharded")
    (folder / INDEX).write_bytes(text.encode("utf-8", "surrogateescape"))
    check_loads_same_or_refuses(folder, original)


# ---------------------------------------------------------------------------- config files


def _config_text(config: dict[str, Any], draw: Callable[..., Any]) -> str:
    kind = draw(st.sampled_from(["tree", "quantization", "pattern", "bytes"]))
    if kind == "tree":
        return _mutate_tree(config, draw, [*ODD_VALUES, *BAD_PATTERNS])
    if kind == "quantization":  # the part the loader reads, damaged more often than the rest
        changed = copy.deepcopy(config)
        key = "quantization_config" if "quantization_config" in changed else "quantization"
        text = _mutate_tree(changed[key], draw, [*ODD_VALUES, *BAD_PATTERNS, "nvfp4-pack-quantized", "FP8"])
        changed[key] = "\x01FUZZ\x01"
        return _dumps(changed).replace(_dumps("\x01FUZZ\x01"), text, 1)
    if kind == "pattern":
        changed = copy.deepcopy(config)
        quant = changed.get("quantization_config") or {}
        lists = [group.setdefault("targets", []) for group in quant.get("config_groups", {}).values()]
        lists.append(quant.setdefault("ignore", []))
        if "quantization" in changed:
            lists.append(changed["quantization"].setdefault("exclude_modules", []))
        chosen = draw(st.sampled_from(lists))
        chosen.insert(draw(st.integers(0, len(chosen))), draw(st.sampled_from(BAD_PATTERNS)))
        return _dumps(changed)
    return _damage_bytes(_dumps(config).encode(), draw).decode("utf-8", "surrogateescape")


@pytest.mark.slow  # over a hundred damaged checkpoints loaded
@settings(FUZZ, max_examples=300)
@given(st.data())
def test_damaged_config_json_loads_the_same_or_raises(data: st.DataObject) -> None:
    original = _original("ct")
    text = _config_text(json.loads((_example("ct") / "config.json").read_text()), data.draw)
    folder = _case("ct")
    (folder / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    check_loads_same_or_refuses(folder, original)


@pytest.mark.slow  # over a hundred damaged checkpoints loaded
@settings(FUZZ, max_examples=150)
@given(st.data())
def test_damaged_modelopt_configs_load_the_same_or_raise(data: st.DataObject) -> None:
    original = _original("modelopt")
    file = data.draw(st.sampled_from(["hf_quant_config.json", "config.json"]))
    text = _config_text(json.loads((_example("modelopt") / file).read_text()), data.draw)
    folder = _case("modelopt")
    (folder / file).write_bytes(text.encode("utf-8", "surrogateescape"))
    check_loads_same_or_refuses(folder, original)


# ---------------------------------------------------------------------------- damage that must be refused


@st.composite
def invalid_layout(draw: Callable[..., Any], header: dict[str, Any]) -> tuple[bytes, int | None, int, str]:
    """(header, where zero bytes go into the data section or None, how many, what the refusal
    says): the tensors' bytes stay where the header points, so without its check each would load
    the same tensors."""
    header = copy.deepcopy(header)
    names = sorted((key for key in header if key != "__metadata__"), key=lambda key: header[key]["data_offsets"])
    kind = draw(st.sampled_from(["duplicate", "gap", "trailing", "overlap"]))
    if kind == "duplicate":  # the same entry twice: json.loads would keep one silently
        name = draw(st.sampled_from(names))
        pairs = [(key, _dumps(value)) for key, value in header.items()]
        pairs.insert(draw(st.integers(0, len(pairs))), (name, _dumps(header[name])))
        return _object_text(pairs).encode(), None, 0, "more than once"
    if kind == "overlap":  # a second tensor of the same dtype and shape reads the first one's bytes
        alike: dict[str, list[str]] = {}
        for name in names:
            alike.setdefault(_dumps([header[name]["dtype"], header[name]["shape"]]), []).append(name)
        group = draw(st.sampled_from(sorted(members for members in alike.values() if len(members) > 1)))
        first, second = draw(st.lists(st.sampled_from(group), min_size=2, max_size=2, unique=True))
        header[second]["data_offsets"] = list(header[first]["data_offsets"])
        return _dumps(header).encode(), None, 0, "overlap"
    count = draw(st.sampled_from([1, 4, 64]))
    if kind == "trailing":
        return _dumps(header).encode(), header[names[-1]]["data_offsets"][1], count, "trailing"
    moved = draw(st.integers(0, len(names) - 1))  # zero bytes go before this tensor: it and later ones move
    begin = header[names[moved]]["data_offsets"][0]
    for name in names[moved:]:
        header[name]["data_offsets"] = [offset + count for offset in header[name]["data_offsets"]]
    return _dumps(header).encode(), begin, count, "gap"


@settings(FUZZ, max_examples=40)
@given(st.data())
def test_an_invalid_data_layout_is_refused(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(["ct", "modelopt"]))
    original = _original(name)
    header, tensor_data = _split(_example(name) / "model.safetensors")
    text, position, count, refusal = data.draw(invalid_layout(header))
    if position is not None:
        tensor_data = tensor_data[:position] + b"\0" * count + tensor_data[position:]
    folder = _case(name)
    _write_safetensors(folder / "model.safetensors", text, None, tensor_data)
    check_loads_same_or_refuses(folder, original, refusal)


# Each names the first shard's own file, reached another way.
UNSAFE_SHARD_NAMES = [
    f"../sharded/{SHARDS[0]}",
    f"./{SHARDS[0]}",
    f"{SHARDS[0]}\x00",
    f"{SHARDS[0]}\x00.json",
    f"\udcff/../{SHARDS[0]}",
    f"{SHARDS[0]}\ud800",
]


@settings(FUZZ, max_examples=30)
@given(st.data())
def test_an_unsafe_shard_name_is_refused(data: st.DataObject) -> None:
    original = _original("sharded")
    index = json.loads((_example("sharded") / INDEX).read_text())
    unsafe = data.draw(st.sampled_from(UNSAFE_SHARD_NAMES))
    every = data.draw(st.booleans())  # every tensor of the shard, or one
    moved = [name for name, shard in index["weight_map"].items() if shard == SHARDS[0]]
    for name in moved if every else moved[: 1 + data.draw(st.integers(0, len(moved) - 1))]:
        index["weight_map"][name] = unsafe
    folder = _case("sharded")
    if every:  # the other way is then the only one to the shard's tensors
        (folder / SHARDS[0]).unlink()
    (folder / INDEX).write_bytes(_dumps(index).encode("utf-8", "surrogatepass"))
    check_loads_same_or_refuses(folder, original, "is not a file name")


# Each matches the example's linear layers (a target) or none of its modules (an ignore entry).
CATASTROPHIC_TARGETS = [r"re:(?:\w+\.?)+_proj$", r"re:(?:m|mo)*del\..*_proj$", r"re:.*l.*a.*proj$", r"re:(m)\1?odel\."]
CATASTROPHIC_IGNORES = [r"re:(a+)+$", r"re:.*a.*b.*c.*d", r"re:(a|ab)*c", r"re:(?P<x>zz)(?P=x)", r"re:(x)?(?(1)y|z)"]


@settings(FUZZ, max_examples=30)
@given(st.data())
def test_a_catastrophic_pattern_is_refused(data: st.DataObject) -> None:
    original = _original("ct")
    config = json.loads((_example("ct") / "config.json").read_text())
    quant = config["quantization_config"]
    if data.draw(st.booleans()):
        quant["config_groups"]["group_0"]["targets"] = [data.draw(st.sampled_from(CATASTROPHIC_TARGETS))]
    else:
        ignore = quant["ignore"]
        ignore.insert(data.draw(st.integers(0, len(ignore))), data.draw(st.sampled_from(CATASTROPHIC_IGNORES)))
    folder = _case("ct")
    (folder / "config.json").write_text(_dumps(config))
    check_loads_same_or_refuses(folder, original, "is refused")
