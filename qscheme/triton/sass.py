"""What a compiled kernel's main loop executes, read from its SASS (no GPU needed).

The Triton wheel ships ``cuobjdump``; a cubin from ``compile_check`` is disassembled and the
K loop found: the backward branch with the widest span that contains a tensor-core
instruction. Its instructions are counted by opcode and by class. The counts are static (one
pass of the loop body, per thread), which is what a kernel's decode cost is made of: the GEMM
moves the same bytes whatever the code, so fewer instructions per weight and no global load
waited on inside the loop are what let it approach the memory roofline.

Classes (first match on the opcode's leading name):

- ``mma``: tensor-core instructions (HMMA, HGMMA, IMMA, QMMA, UTCMMA, ...);
- ``global_load``: loads from global memory into registers (LDG): each one waited on in the
  loop stalls the warp for a memory latency unless the compiler hoisted it;
- ``async_copy``: global -> shared copies the pipeliner issues ahead (LDGSTS, UTMALDG, ...);
- ``shared_load`` / ``shared_store``: LDS, LDSM / STS;
- ``barrier``: BAR, DEPBAR, MEMBAR, WARPGROUP, fences;
- ``move``: MOV, IMAD.MOV, PRMT, UMOV, SHFL: data shuffled between registers;
- ``integer``, ``float``, ``convert``, ``control``: the rest.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
_PREDICATE = re.compile(r"^@!?U?P[T0-9]+\s+")

# (class, opcode prefixes); the first class with a matching prefix wins.
_CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mma", ("HMMA", "HGMMA", "IMMA", "QMMA", "OMMA", "UTCMMA", "UTCHMMA", "UTCQMMA", "UTCOMMA", "DMMA")),
    ("async_copy", ("LDGSTS", "UTMALDG", "UBLKCP", "LDGDEPBAR")),
    ("global_load", ("LDG",)),
    ("shared_load", ("LDSM", "LDS")),
    ("shared_store", ("STS",)),
    ("barrier", ("BAR", "DEPBAR", "MEMBAR", "WARPGROUP", "FENCE", "SYNCS", "ARRIVES")),
    ("move", ("IMAD.MOV", "MOV", "UMOV", "PRMT", "SHFL")),
    ("convert", ("F2F", "F2FP", "I2F", "F2I", "I2FP", "HADD2.F32")),
    ("float", ("FMUL", "FADD", "FFMA", "FSEL", "FMNMX", "FSETP", "HMUL2", "HADD2", "HFMA2", "HMNMX2", "FCHK")),
    ("control", ("BRA", "EXIT", "NOP", "BSYNC", "BSSY", "CALL", "RET", "WARPSYNC")),
)


def opcode_class(opcode: str) -> str:
    for name, prefixes in _CLASSES:
        if opcode.startswith(prefixes):
            return name
    return "integer"


@dataclass(frozen=True)
class LoopProfile:
    """The main loop of one kernel: instruction counts per pass (per thread)."""

    instructions: int
    opcodes: dict[str, int] = field(default_factory=dict)
    classes: dict[str, int] = field(default_factory=dict)

    def count(self, kind: str) -> int:
        return self.classes.get(kind, 0)


def parse_sass(text: str) -> list[tuple[int, str]]:
    """cuobjdump -sass text -> [(address, instruction without predicate)] in order."""
    instructions = []
    for line in text.splitlines():
        match = _LINE.search(line)
        if match:
            instructions.append((int(match.group(1), 16), _PREDICATE.sub("", match.group(2).strip())))
    return instructions


def main_loop(instructions: list[tuple[int, str]]) -> LoopProfile | None:
    """The widest loop (backward branch) holding a tensor-core instruction, else the widest loop."""
    loops = []
    for address, text in instructions:
        branch = _BRANCH.search(text)
        if branch and int(branch.group(1), 16) < address:
            start = int(branch.group(1), 16)
            body = [op for at, op in instructions if start <= at <= address]
            has_mma = any(opcode_class(op.split()[0]) == "mma" for op in body)
            loops.append((has_mma, address - start, body))
    if not loops:
        return None
    _, _, body = max(loops, key=lambda loop: (loop[0], loop[1]))
    opcodes = Counter(op.split()[0] for op in body)
    classes: Counter[str] = Counter()
    for opcode, count in opcodes.items():
        classes[opcode_class(opcode)] += count
    return LoopProfile(sum(opcodes.values()), dict(opcodes.most_common()), dict(classes.most_common()))


def _cuobjdump() -> Path | None:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return tool if tool.is_file() else None


def disassemble(cubin: bytes) -> str | None:
    """The SASS of a cubin, or None when the triton wheel has no cuobjdump or it fails."""
    tool = _cuobjdump()
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        try:
            completed = subprocess.run([str(tool), "-sass", handle.name], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return None
    return completed.stdout if completed.returncode == 0 else None


def profile_cubin(cubin: bytes) -> LoopProfile | None:
    """The main loop of a cubin's kernel (None without cuobjdump or without a loop)."""
    text = disassemble(cubin)
    return None if text is None else main_loop(parse_sass(text))
