"""What benchmarks/cpu_gemm.py and benchmarks/gpu_gemm.py share.

- ``runnable_kernels``: the kernels the resolver accepts for a layer on a device (every accepted
  one, not only the chosen one), read from its trace: no kernel name is written here, so a
  kernel a plugin adds is benchmarked as soon as it is installed.
- ``build_layer``: a ``QuantLinear`` with one of them forced; ``reference_error``: its largest
  error against the reference kernel.
- ``resident_bytes``: the memory a layer holds (its buffers and every tensor reachable from its
  prepared kernel state, each storage once), by device; ``state_bytes``: what the kernel state
  alone holds, the bytes a call reads.
- ``interleaved_medians``: CPU timing of peers in turn, so that a noisy machine slows them alike.
- ``markdown_table``: the tables both scripts print and write.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from qscheme.canonical import CanonicalWeight
from qscheme.descriptor import Scheme
from qscheme.kernels import registry
from qscheme.kernels.devices import DeviceFacts
from qscheme.modules import QuantLinear, problem_for

INTERPRETER_VARIABLE = "TRITON_INTERPRET"
REFERENCE_KERNEL = "reference"  # the oracle every kernel is checked against (plugins/reference.py)
MIB = float(1 << 20)


def device_facts(device: str, interpreter: bool) -> DeviceFacts:
    """The resolver's facts for ``device`` ("cpu" or "cuda"); ``interpreter=False`` drops
    TRITON_INTERPRET from them, so kernels that run on the CPU only under the Triton interpreter
    (a test path, not a way to serve) are rejected whatever the environment says."""
    facts = registry.device_for(device)
    if interpreter:
        return facts
    kept = tuple((name, value) for name, value in facts.environment if name != INTERPRETER_VARIABLE)
    return dataclasses.replace(facts, environment=kept)


@dataclass(frozen=True)
class Runnable:
    """The kernels that can run one layer, in the resolver's order, and why others were left out
    (kernels accepted by their declaration whose code fails to import; a scheme that cannot
    store the shape)."""

    kernels: tuple[str, ...]
    notes: tuple[str, ...] = ()


def runnable_kernels(
    weight: CanonicalWeight,
    facts: DeviceFacts,
    activation_dtype: str = "bfloat16",
    only: Sequence[str] = (),
    skip: Sequence[str] = (),
) -> Runnable:
    """Every kernel the resolver accepts for ``weight`` on ``facts`` (``only``: just these;
    ``skip``: not these)."""
    resolution = registry.resolve_layer(weight.scheme, problem_for(weight, activation_dtype), facts)
    if resolution.layout is not None:
        return Runnable((), (f"{weight.scheme.name} {weight.n}x{weight.k}: {resolution.layout.reason}",))
    kernels: list[str] = []
    notes: list[str] = []
    for candidate in resolution.trace:
        if not candidate.accepted or (only and candidate.kernel not in only) or candidate.kernel in skip:
            continue
        failure = registry.implementation_failure(registry.get_declaration(candidate.kernel))
        if failure:
            notes.append(f"{candidate.kernel}: accepted, but its code does not import ({failure})")
        else:
            kernels.append(candidate.kernel)
    return Runnable(tuple(kernels), tuple(notes))


def build_layer(weight: CanonicalWeight, kernel: str, device: str, facts: DeviceFacts) -> QuantLinear:
    """A layer of ``weight`` that runs on ``kernel`` (forced), prepared for bf16 inputs."""
    layer = QuantLinear(weight, device, kernel=kernel, device_facts=facts)
    return layer.prepare()


def reference_output(weight: CanonicalWeight, x: Tensor) -> Tensor:
    """The reference kernel's float32 output for ``x`` (a state of its own, so that no
    benchmarked layer gains a float32 copy)."""
    implementation = registry.load_implementation(registry.get_declaration(REFERENCE_KERNEL))
    state = implementation.prepare(weight, x.device)
    output: Tensor = implementation.apply(state, x.float(), None)
    return output


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """The largest absolute difference over the largest magnitude of ``expected``."""
    difference = (actual.float() - expected.float()).abs().max()
    return float(difference / expected.float().abs().max().clamp_min(1e-30))


# -- memory ------------------------------------------------------------------------------------

_LEAVES = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size)
_OPAQUE = (
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    type,
    torch.nn.Module,  # a module's tensors are its own (the root layer's are counted from its buffers)
)


def reachable_tensors(root: object) -> list[Tensor]:
    """Every tensor reachable from ``root`` through containers (tuples, lists, sets, dicts),
    dataclasses and other objects' ``__dict__`` and ``__slots__``; each object visited once.
    Modules, functions and classes are not entered: what they hold is not the object's."""
    found: list[Tensor] = []
    seen: set[int] = set()
    stack: list[object] = [root]
    while stack:
        value = stack.pop()
        if id(value) in seen or isinstance(value, _LEAVES):
            continue
        seen.add(id(value))
        if isinstance(value, Tensor):
            found.append(value)
        elif isinstance(value, Mapping):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, (tuple, list, set, frozenset)):
            stack.extend(value)
        elif not isinstance(value, _OPAQUE):
            attributes = getattr(value, "__dict__", None)
            if isinstance(attributes, dict):
                stack.extend(attributes.values())
            for cls in type(value).__mro__:
                slots = cls.__dict__.get("__slots__", ())
                for name in (slots,) if isinstance(slots, str) else slots:
                    if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                        stack.append(getattr(value, name))
    return found


def storage_bytes(tensors: Iterable[Tensor]) -> dict[str, int]:
    """Bytes of the distinct storages behind ``tensors``, by device ("cpu", "cuda:0"): views
    of one storage count once, and a view counts its whole storage (it keeps it alive)."""
    seen: set[tuple[str, int]] = set()
    totals: dict[str, int] = {}
    for tensor in tensors:
        if tensor.is_meta:
            continue
        device = str(tensor.device)
        try:
            storage = tensor.untyped_storage()
            key, size = (device, storage.data_ptr()), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # sparse and other layouts without one storage
            key, size = (device, id(tensor)), tensor.numel() * tensor.element_size()
        if size == 0 or key in seen:
            continue
        seen.add(key)
        totals[device] = totals.get(device, 0) + size
    return totals


def kernel_states(layer: QuantLinear) -> list[object]:
    """The layer's prepared kernel states (one per activation dtype it has run). QuantLinear
    keeps them private (``_states``): a benchmark reads them, user code should not."""
    states = getattr(layer, "_states", None)
    if not isinstance(states, dict):
        raise TypeError("QuantLinear no longer keeps its kernel states in _states: update resident_bytes")
    return list(states.values())


def resident_bytes(layer: QuantLinear) -> dict[str, int]:
    """What ``layer`` holds, by device: its buffers (the canonical tensors, the bias) and every
    tensor reachable from its prepared kernel states, each storage once."""
    tensors = [*layer.buffers(), *layer.parameters(), *reachable_tensors(kernel_states(layer))]
    return storage_bytes(tensors)


def canonical_bytes(layer: QuantLinear) -> int:
    """The canonical tensors' bytes: the quantized weight with its scales (and zero points,
    global and input scales), as a checkpoint stores them."""
    buffers = [value for name, value in layer.named_buffers() if name.startswith("canonical_")]
    return sum(storage_bytes(buffers).values())


def state_bytes(layer: QuantLinear) -> int:
    """Bytes of the tensors the kernel state holds on the layer's device (the weight in the
    kernel's form with its scales): what one call reads, besides its input and output. Taken
    right after ``prepare``, before per-call caches exist."""
    device = str(layer.torch_device)
    totals = storage_bytes(reachable_tensors(kernel_states(layer)))
    return sum(size for where, size in totals.items() if where == device or where.split(":")[0] == device)


@dataclass(frozen=True)
class MemoryRow:
    """A layer's memory after its first forward, against its canonical tensors and a bf16 weight."""

    scheme: str
    kernel: str
    n: int
    k: int
    canonical: int
    resident: Mapping[str, int]

    @property
    def total(self) -> int:
        return sum(self.resident.values())

    @property
    def bf16_weight(self) -> int:
        return self.n * self.k * 2

    def cells(self, devices: Sequence[str]) -> list[str]:
        cells = [self.scheme, self.kernel, f"{self.n}x{self.k}", f"{self.canonical / MIB:.2f}"]
        cells += [f"{self.resident.get(device, 0) / MIB:.2f}" for device in devices]
        cells += [f"{self.total / self.canonical:.2f}x", f"{self.total / self.bf16_weight:.2f}x"]
        return cells


def memory_row(scheme: Scheme, kernel: str, layer: QuantLinear) -> MemoryRow:
    return MemoryRow(
        scheme.name, kernel, layer.out_features, layer.in_features, canonical_bytes(layer), resident_bytes(layer)
    )


def memory_table(rows: Sequence[MemoryRow]) -> list[str]:
    """The memory table, a column of resident MiB per device the layers hold memory on."""
    if not rows:
        return []
    devices = sorted({device for row in rows for device in row.resident})
    bf16 = rows[0].bf16_weight
    header = ["scheme", "kernel", "N x K", "canonical MiB", *(f"resident MiB ({d})" for d in devices)]
    header += ["x canonical", "x bf16 weight"]
    return [
        f"A bf16 weight of {rows[0].n}x{rows[0].k} is {bf16 / MIB:.2f} MiB.",
        "",
        *markdown_table(header, [row.cells(devices) for row in rows]),
    ]


# -- timing and tables -------------------------------------------------------------------------


def interleaved_medians(
    calls: Mapping[str, Callable[[], object]],
    rounds: int,
    sample_seconds: float,
    warmup: int = 2,
    budget_seconds: float | None = None,
    least_rounds: int = 3,
) -> dict[str, float]:
    """Median seconds per call of each of ``calls``, timed in turn within each round (the order
    rotating from round to round), so that peers share the machine's moods: after ``warmup``
    calls each and one calibrating call, a sample is as many back-to-back calls as fill
    ``sample_seconds``. A call so slow that ``rounds`` samples would pass ``budget_seconds``
    takes part in fewer rounds, never fewer than ``least_rounds``."""
    names = list(calls)
    repeats: dict[str, int] = {}
    quota: dict[str, int] = {}
    for name in names:
        for _ in range(warmup):
            calls[name]()
        started = time.perf_counter()
        calls[name]()
        single = max(time.perf_counter() - started, 1e-7)
        repeats[name] = max(1, min(10_000, round(sample_seconds / single)))
        affordable = rounds if budget_seconds is None else int(budget_seconds / (single * repeats[name]))
        quota[name] = max(min(least_rounds, rounds), min(rounds, affordable))
    samples: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            if len(samples[name]) >= quota[name]:
                continue
            call, count = calls[name], repeats[name]
            started = time.perf_counter()
            for _ in range(count):
                call()
            samples[name].append((time.perf_counter() - started) / count)
    return {name: statistics.median(values) for name, values in samples.items()}


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def ratio(numerator: float | None, denominator: float | None) -> str:
    """``1.23x``, or ``-`` when either side was not measured."""
    if numerator is None or denominator is None or denominator <= 0:
        return "-"
    return f"{numerator / denominator:.2f}x"


def microseconds(seconds: float) -> str:
    """``12345``, ``123.4`` or ``1.23``: three significant figures or more, never ``0``."""
    value = seconds * 1e6
    return f"{value:.0f}" if value >= 1000 else f"{value:.3g}"


def parse_shape(text: str) -> tuple[int, int]:
    """``4096x14336`` -> (4096, 14336): N x K."""
    n, sep, k = text.lower().partition("x")
    if not sep or not n.isdigit() or not k.isdigit() or int(n) < 1 or int(k) < 1:
        raise ValueError(f"shape {text!r} is not NxK (e.g. 4096x4096)")
    return int(n), int(k)
