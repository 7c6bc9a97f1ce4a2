"""``WriteSummary``: what ``quantize_checkpoint`` and ``convert_checkpoint`` did, for text and ``--json``.

One row per layer (quantized, converted or copied), the bytes read and written, the time taken
and the process's peak resident memory. Both commands return it; the CLI prints it.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Action = Literal["quantized", "converted", "requantized", "copied"]
WORST_SHOWN = 5  # layers listed in the text summary's quantization-error lines


@dataclass(frozen=True)
class LayerRow:
    """One layer's line in the summary.

    ``max_ulps`` is the largest deviation, in float32 units in the last place, of the layer's
    dequantized weight from the source's (an exact or near-exact conversion); ``relative_error``
    is ``||W - Q(W)||_F / ||W||_F`` (Frobenius norms, ``qscheme.writing.error_report``) and
    ``max_abs_error`` ``max |W - Q(W)|``, where ``W`` is the reference (quantize: the source weight;
    a requantizing convert: the source's dequantized weight). None when not measured (copied
    layers; ulps of a quantized or requantized layer, relative error of an exact conversion).
    """

    name: str
    scheme: str
    action: Action
    max_ulps: float | None = None
    max_abs_error: float | None = None
    relative_error: float | None = None


@dataclass
class WriteSummary:
    """The result of writing a checkpoint (``qscheme quantize`` / ``qscheme convert``)."""

    command: str
    src: str
    dst: str
    scheme: str
    layers: list[LayerRow] = field(default_factory=list)
    files_copied: list[str] = field(default_factory=list)
    shards: list[str] = field(default_factory=list)
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    # The process's peak RSS when the write ended (ru_maxrss): this write's own peak in a fresh
    # process (the CLI); in a long-running one it includes whatever the process held before.
    peak_rss_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def layers_written(self) -> int:
        """How many layers were quantized or converted (copied ones not counted)."""
        return sum(1 for row in self.layers if row.action != "copied")

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``qscheme quantize --json`` prints it)."""
        record = asdict(self)
        record["layers_written"] = self.layers_written
        record["throughput_bytes_per_second"] = self.bytes_read / self.seconds if self.seconds > 0 else None
        return record

    def render(self) -> str:
        """A few lines for a terminal: what was written, where, how fast, and the notes."""
        counts: dict[str, int] = {}
        for row in self.layers:
            counts[row.action] = counts.get(row.action, 0) + 1
        done = ", ".join(f"{count} {action}" for action, count in counts.items()) or "no layers"
        speed = f", {self.bytes_read / self.seconds / 1e6:.0f} MB/s" if self.seconds > 0 else ""
        lines = [
            f"{self.command}: {self.src} -> {self.dst} ({self.scheme})",
            f"layers: {done}",
            f"files: {len(self.shards)} shard(s) written, {len(self.files_copied)} other file(s) copied",
            f"read {self.bytes_read / 1e6:.1f} MB, wrote {self.bytes_written / 1e6:.1f} MB in {self.seconds:.2f} s"
            f"{speed}; peak RSS {self.peak_rss_bytes / 1e6:.0f} MB",
        ]
        deviating = [row for row in self.layers if row.max_ulps is not None and row.action == "converted"]
        if deviating:
            top = max(deviating, key=lambda row: row.max_ulps or 0.0)
            lines.append(f"largest deviation: {top.max_ulps:g} ulp ({top.name})")
        lines.extend(self.worst_error_lines())
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)

    def worst_error_lines(self, count: int = WORST_SHOWN) -> list[str]:
        """The layers with the largest relative quantization error, worst first."""
        measured = [row for row in self.layers if row.relative_error is not None]
        if not measured:
            return []
        measured.sort(key=lambda row: -(row.relative_error or 0.0))
        lines = [
            f"quantization error (relative: ||W - Q(W)||_F / ||W||_F, Frobenius norms; max abs: max |W - Q(W)|), "
            f"worst {min(count, len(measured))} of {len(measured)} layer(s):"
        ]
        for row in measured[:count]:
            lines.append(f"  {row.name}: relative {row.relative_error:.3g}, max abs {row.max_abs_error:.3g}")
        return lines


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far, in bytes (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
