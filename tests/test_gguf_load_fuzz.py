"""Fuzz loading a whole GGUF model: a damaged file loads as the original, as its reference reader
reads it, or raises a QSchemeError.

One small valid file (a tiny llama written by gguf-py, tests/gguf_tiny.py: Q8_0, Q4_0, Q4_K, Q6_K
and F32 tensors, llama's q/k rows permuted as llama.cpp stores them) is damaged one seeded way per
case: bytes of the header flipped, inserted or deleted; a metadata value (integer, float or
string) set to an odd one; a tensor info's name, dims, type or offset changed; a count changed;
bytes of the tensor data flipped; the file cut short. ``qscheme.load_checkpoint`` must then

- raise a QSchemeError (nothing else: no IndexError, struct.error, MemoryError, no hang), or
- return layers and plain tensors whose values equal the original file's (the damage hit nothing
  a load reads, a padding byte say), or
- return what transformers' own GGUF loader (gguf-py's reader and dequantizer) reads from the
  damaged file, the same names and the same values (a flipped code byte changes a weight, which
  no reader can notice).

Seeded and bounded: a fixed number of cases, each under a watchdog, a few seconds in all.
"""

from __future__ import annotations

import random
import signal
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from gguf_tiny import reference_state, write_tiny_gguf  # noqa: E402

import qscheme  # noqa: E402
from qscheme.errors import QSchemeError  # noqa: E402

pytestmark = pytest.mark.slow  # ~25 s on two cores

CASES = 48
CASE_SECONDS = 20  # a load takes ~0.3 s; longer is a hang

KINDS = ("header_flip", "metadata_value", "tensor_info", "count", "data_flip", "truncate", "insert_delete")
ODD_U32 = (0, 1, 2, 3, 7, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1)
ODD_U64 = (0, 1, 2**31, 2**32, 2**40, 2**63, 2**64 - 1)
ODD_FLOATS = (0.0, -1.0, 1e-45, 1e38, float("inf"), float("-inf"), float("nan"))
OFFSET_MOVES = (1, -1, 16, -32, 32, 4096, -4096)


def types(name: str, shape: tuple[int, ...]) -> str:
    """Every block family the loader reads: Q8_0, Q4_0, Q4_K, Q6_K; norms and the head F32."""
    if len(shape) < 2 or name == "output.weight":
        return "F32"
    for part, kind in ((".attn_q.", "Q4_K"), (".attn_k.", "Q6_K"), (".attn_output.", "Q4_0"), (".ffn_down.", "Q4_0")):
        if part in name:
            return kind
    return "Q8_0"


@dataclass(frozen=True)
class Place:
    """A numeric or string field of the original file: where it is, how wide, what it holds."""

    kind: str  # "u32", "u64", "f32", "string", "tensor_name", "dim", "type", "offset", "count"
    position: int
    width: int
    label: str  # the metadata key or tensor it belongs to


@dataclass(frozen=True)
class Sample:
    raw: bytes
    places: tuple[Place, ...]
    infos_start: int
    data_start: int
    values: dict[str, torch.Tensor]  # the original's layers (dequantized) and plain tensors


def _part_positions(offset: int, parts: list[object]) -> list[int]:
    positions, position = [], offset
    for part in parts:
        positions.append(position)
        position += int(part.nbytes)  # type: ignore[attr-defined]
    return positions


def _places(path: Path) -> tuple[list[Place], int, int]:
    """The fields of the original file by gguf-py's reader (the reference), independently of qscheme."""
    reader = gguf.GGUFReader(path)
    places: list[Place] = []
    scalar = {gguf.GGUFValueType.UINT32: ("u32", 4), gguf.GGUFValueType.FLOAT32: ("f32", 4)}
    for field in reader.fields.values():
        positions = _part_positions(field.offset, field.parts)
        if field.name in ("GGUF.tensor_count", "GGUF.kv_count"):
            places.append(Place("count", positions[0], 8, field.name))
        elif field.name.startswith("GGUF."):
            continue
        elif field.types[0] in scalar:
            kind, width = scalar[field.types[0]]
            places.append(Place(kind, positions[field.data[0]], width, field.name))
        elif field.types[0] == gguf.GGUFValueType.STRING:
            value = field.parts[field.data[0]]
            places.append(Place("string", positions[field.data[0]], int(value.nbytes), field.name))
    infos_start = min(tensor.field.offset for tensor in reader.tensors)
    for tensor in reader.tensors:
        # parts: name length, name, n_dims, dims, type, offset
        name_length, name, _, dims, type_at, offset = _part_positions(tensor.field.offset, tensor.field.parts)
        label = tensor.name
        places.append(Place("tensor_name", name, int(tensor.field.parts[1].nbytes), label))
        places.extend(Place("dim", dims + 8 * d, 8, label) for d in range(len(tensor.shape)))
        places.extend([Place("type", type_at, 4, label), Place("offset", offset, 8, label)])
        places.append(Place("u64", name_length, 8, f"{label} (name length)"))
    return places, infos_start, int(reader.data_offset)


def _load(path: Path) -> dict[str, torch.Tensor]:
    checkpoint = qscheme.load_checkpoint(path)
    values = {f"{name}.weight": layer.dequantize() for name, layer in checkpoint.items()}
    values.update({name: tensor.float() for name, tensor in checkpoint.tensors.items()})
    return values


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Sample:
    path = tmp_path_factory.mktemp("gguf_load_fuzz") / "tiny.gguf"
    written = write_tiny_gguf(path, "llama", types)
    assert set(written.types.values()) == {"Q8_0", "Q4_0", "Q4_K", "Q6_K", "F32"}
    places, infos_start, data_start = _places(path)
    values = _load(path)
    reference = reference_state(path)  # the original itself reads as its reference reader reads it
    assert values.keys() == reference.keys() and all(torch.equal(values[n], reference[n]) for n in values)
    return Sample(path.read_bytes(), tuple(places), infos_start, data_start, values)


def _set(data: bytearray, place: Place, value: int | float) -> None:
    form = {("f32", 4): "<f", ("u32", 4): "<I", ("type", 4): "<I"}.get((place.kind, place.width), "<Q")
    if form == "<f":
        struct.pack_into(form, data, place.position, value)
    else:
        struct.pack_into(form, data, place.position, int(value) % 2 ** (8 * place.width))


def damage(sample: Sample, rng: random.Random) -> tuple[str, bytes]:
    """One seeded damage: ("KIND: what was done", the damaged bytes)."""
    kind = KINDS[rng.randrange(len(KINDS))]
    what, damaged = _damage(sample, rng, kind)
    return f"{kind}: {what}", damaged


def _damage(sample: Sample, rng: random.Random, kind: str) -> tuple[str, bytes]:
    data = bytearray(sample.raw)
    if kind in ("header_flip", "data_flip"):
        low, high = (0, sample.data_start) if kind == "header_flip" else (sample.data_start, len(data))
        positions = [rng.randrange(low, high) for _ in range(rng.randint(1, 3))]
        for position in positions:
            data[position] ^= rng.randint(1, 255)
        return f"bytes {positions} flipped", bytes(data)
    if kind == "truncate":
        cut = rng.randrange(0, len(data))
        return f"truncate to {cut} bytes", bytes(data[:cut])
    if kind == "insert_delete":
        position, count = rng.randrange(4, sample.data_start), rng.choice((1, 4, 8, 32))
        if rng.random() < 0.5:
            data[position:position] = bytes([rng.randrange(256)]) * count
            return f"insert {count} bytes at {position}", bytes(data)
        del data[position : position + count]
        return f"delete {count} bytes at {position}", bytes(data)
    wanted = {
        "metadata_value": ("u32", "f32", "string"),
        "tensor_info": ("tensor_name", "dim", "type", "offset"),
        "count": ("count", "u64"),
    }[kind]
    place = rng.choice([place for place in sample.places if place.kind in wanted])
    if place.kind in ("string", "tensor_name"):
        position = place.position + rng.randrange(place.width)
        data[position] ^= rng.choice((1, 0x20, 0x80, 0xFF))
        return f"{place.kind} of {place.label} flipped at byte {position}", bytes(data)
    if place.kind == "f32":
        value: int | float = rng.choice(ODD_FLOATS)
    elif place.kind in ("u32", "type"):
        value = rng.choice(ODD_U32)
    else:
        (old,) = struct.unpack_from("<Q", data, place.position)
        value = rng.choice((*ODD_U64, old + 1, max(old - 1, 0), 2 * old))
        if place.kind == "offset":
            value = max(old + rng.choice(OFFSET_MOVES), 0)
    _set(data, place, value)
    return f"{place.kind} of {place.label} (byte {place.position}) set to {value!r}", bytes(data)


class Hang(BaseException):
    """Raised by the watchdog; a BaseException so that no `except Exception` in the loader hides it."""


@pytest.fixture
def watchdog() -> Iterator[None]:
    def bark(signum: int, frame: FrameType | None) -> None:
        raise Hang(f"load_checkpoint ran for more than {CASE_SECONDS} s")

    previous: Callable[..., object] | int | None = signal.signal(signal.SIGALRM, bark)
    signal.alarm(CASE_SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return got.keys() == expected.keys() and all(torch.equal(got[name], expected[name]) for name in got)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("seed", range(CASES))
def test_a_damaged_file_loads_as_its_reference_reads_it_or_is_refused(
    sample: Sample, tmp_path: Path, watchdog: None, seed: int
) -> None:
    what, raw = damage(sample, random.Random(seed))
    path = tmp_path / "damaged.gguf"
    path.write_bytes(raw)
    try:
        got = _load(path)
    except QSchemeError as error:
        assert str(path.name) in str(error), f"{what}: the error does not name the file: {error}"
        return
    assert all(torch.isfinite(value).all() for value in got.values()), f"{what}: accepted non-finite values"
    if _same(got, sample.values):
        return
    try:
        expected = reference_state(path)
    except Exception as error:  # the reference reader refuses what qscheme loaded differently
        pytest.fail(f"{what}: loaded with other values than the original's, and transformers cannot read it: {error}")
    assert _same(got, expected), f"{what}: loaded with other values than transformers' GGUF loader reads"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_flipped_code_byte_changes_one_weight_as_the_reference_reads_it(sample: Sample, tmp_path: Path) -> None:
    """The third outcome above, pinned: a code of blk.0.ffn_up (Q8_0: a float16 scale, then 32
    int8 codes per block) flipped changes that one weight of up_proj, as gguf-py reads it."""
    path = tmp_path / "code.gguf"
    path.write_bytes(sample.raw)
    tensor = next(tensor for tensor in gguf.GGUFReader(path).tensors if tensor.name == "blk.0.ffn_up.weight")
    assert tensor.tensor_type.name == "Q8_0"
    data = bytearray(sample.raw)
    data[int(tensor.data_offset) + 2 + 5] ^= 0x01  # block 0, code 5
    path.write_bytes(bytes(data))
    got = _load(path)
    changed = {name for name in got if not torch.equal(got[name], sample.values[name])}
    assert changed == {"model.layers.0.mlp.up_proj.weight"}
    difference = got["model.layers.0.mlp.up_proj.weight"] != sample.values["model.layers.0.mlp.up_proj.weight"]
    assert difference.sum() == 1 and bool(difference[0, 5])
    assert _same(got, reference_state(path))


def test_the_damages_cover_every_kind(sample: Sample) -> None:
    """The seeded cases damage every region of the file: each kind is drawn, and their targets span
    metadata keys and tensor infos."""
    drawn = [damage(sample, random.Random(seed))[0] for seed in range(CASES)]
    assert {what.split(":")[0] for what in drawn} == set(KINDS)
    targets = " ".join(drawn)
    for field in ("tensor_name of", "dim of", "type of", "offset of", "count of", "u32 of", "f32 of", "string of"):
        assert field in targets, field
