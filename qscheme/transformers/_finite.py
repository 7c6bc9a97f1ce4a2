"""``from_pretrained``'s plain tensors (embeddings, norms, ``lm_head``) must hold finite values.

transformers loads the tensors qscheme does not quantize itself, so ``load_checkpoint``'s check
(``qscheme.checkpoint.plain``) does not see them on this route. After loading, every parameter and
buffer outside the quantized modules is checked the same way (in chunks, no copy of a tensor), and
a NaN-filled ``lm_head`` is a CheckpointError naming it instead of NaN logits.
"""

from __future__ import annotations

from pathlib import Path

import torch

from qscheme.checkpoint.plain import nonfinite_problem
from qscheme.errors import CheckpointError
from qscheme.modules.experts import QuantExperts
from qscheme.modules.linear import QuantLinear

SHOWN_PROBLEMS = 5


def check_plain_finite(model: torch.nn.Module, folder: Path | None) -> None:
    """Raise a CheckpointError listing the plain tensors of ``model`` that hold NaN or infinity."""
    where = str(folder) if folder is not None else "from_pretrained"
    problems = []
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        if isinstance(module, (QuantLinear, QuantExperts)):
            continue  # quantized: checked by qscheme's loader before it was built
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for tensor_name, tensor in tensors:
            if tensor is None or id(tensor) in seen or tensor.is_meta:
                continue
            seen.add(id(tensor))  # a tied weight is checked once
            name = f"{module_name}.{tensor_name}" if module_name else tensor_name
            problem = nonfinite_problem(name, tensor.detach(), where)
            if problem is not None:
                problems.append(problem)
    if problems:
        shown = "\n".join(f"  {problem}" for problem in problems[:SHOWN_PROBLEMS])
        more = len(problems) - SHOWN_PROBLEMS
        tail = f"\n  ... and {more} more" if more > 0 else ""
        raise CheckpointError(
            f"{where}: {len(problems)} plain tensor(s) of the loaded model hold NaN or infinite values:\n{shown}{tail}"
        )
