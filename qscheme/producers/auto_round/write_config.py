"""qscheme reads AutoRound checkpoints and writes none in its format: the schemes AutoRound's codes
use belong to GPTQ and AWQ, whose producers write them (``qscheme convert`` to compressed-tensors
also works)."""

from __future__ import annotations

from typing import Any

from qscheme.descriptor import Scheme
from qscheme.errors import QuantizeError
from qscheme.producers.base import WriteRequest


def writes(scheme: Scheme) -> bool:
    return False


def write_config(request: WriteRequest) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    raise QuantizeError(
        f"scheme {request.scheme.name}: qscheme writes no AutoRound configs; write the GPTQ or AWQ scheme "
        "with its own producer"
    )
