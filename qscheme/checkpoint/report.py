"""What a load did, as data: per layer scheme, shape, kernel and fuse policy; rendered as text or JSON.

``render`` shows names from the checkpoint (its path, producer, schemes, kernels, notes) through
``shown``: escaped, newlines included, and bounded, so the text is safe on a terminal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qscheme.checkpoint.fuse import FuseOutcome
from qscheme.text import expert_blocks, listing, shown


@dataclass(frozen=True)
class LayerReport:
    """One QuantLinear of a loaded checkpoint."""

    name: str
    scheme: str
    n: int
    k: int
    origin: str
    members: tuple[str, ...]
    kernel: str | None = None
    tolerated: tuple[str, ...] = ()
    fuse: FuseOutcome | None = None
    fuse_reason: str = ""

    def as_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "scheme": self.scheme,
            "n": self.n,
            "k": self.k,
            "origin": self.origin,
            "members": list(self.members),
            "kernel": self.kernel,
            "tolerated": list(self.tolerated),
            "fuse": None if self.fuse is None else {**self.fuse.as_json(), "reason": self.fuse_reason},
        }


@dataclass(frozen=True)
class CheckpointReport:
    """Everything ``load_checkpoint`` decided, for people (``render``) and tools (``as_json``)."""

    path: str
    producer: str
    producer_version: str | None
    config_file: str | None
    files: tuple[str, ...]
    total_bytes: int
    layers: tuple[LayerReport, ...]
    ignored: dict[str, str]
    plain_tensors: tuple[str, ...]
    kv_cache_tensors: tuple[str, ...]
    tolerated_tensors: tuple[str, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def scheme_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for layer in self.layers:
            counts[layer.scheme] = counts.get(layer.scheme, 0) + len(layer.members)
        return dict(sorted(counts.items()))

    @property
    def fused(self) -> tuple[LayerReport, ...]:
        return tuple(layer for layer in self.layers if layer.fuse is not None)

    def as_json(self) -> dict[str, object]:
        return {
            "path": self.path,
            "producer": {"name": self.producer, "version": self.producer_version, "config": self.config_file},
            "files": list(self.files),
            "total_bytes": self.total_bytes,
            "schemes": self.scheme_counts,
            "layers": [layer.as_json() for layer in self.layers],
            "ignored": self.ignored,
            "plain_tensors": list(self.plain_tensors),
            "kv_cache_tensors": list(self.kv_cache_tensors),
            "tolerated_tensors": list(self.tolerated_tensors),
            "notes": list(self.notes),
        }

    def render(self) -> str:
        version = f" {shown(self.producer_version)}" if self.producer_version else ""
        schemes = ", ".join(f"{shown(k)}: {v}" for k, v in self.scheme_counts.items())
        lines = [
            f"checkpoint: {shown(self.path, limit=1000)}",
            f"producer: {shown(self.producer)}{version}",
            f"quantized layers: {len(self.layers)} ({schemes})",
            f"plain tensors: {len(self.plain_tensors)}; ignored modules: {len(self.ignored)}",
        ]
        if self.tolerated_tensors:
            lines.append(f"tolerated tensors dropped: {len(self.tolerated_tensors)}")
        kernels: dict[str, int] = {}
        for layer in self.layers:
            kernels[layer.kernel or "-"] = kernels.get(layer.kernel or "-", 0) + 1
        lines.append("kernels: " + ", ".join(f"{shown(k)}: {v}" for k, v in sorted(kernels.items())))
        blocks = expert_blocks([layer.name for layer in self.layers])
        if blocks:
            count = sum(len(members) for members in blocks.values())
            lines.append(f"expert layers: {count} in {len(blocks)} MoE blocks: {listing(list(blocks), 4)}")
        for layer in self.fused:
            assert layer.fuse is not None
            lines.append(f"fused {shown(layer.fuse.describe(), limit=1000)} [{shown(layer.fuse_reason, limit=1000)}]")
        lines.extend(f"note: {shown(note, limit=2000)}" for note in self.notes)
        return "\n".join(lines)
