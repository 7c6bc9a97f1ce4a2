"""qscheme reads bitsandbytes checkpoints but writes none: ``qscheme quantize`` and ``convert`` write
compressed-tensors, ModelOpt or qscheme's own config instead."""

from __future__ import annotations

from typing import Any

from qscheme.descriptor import Scheme
from qscheme.errors import UsageError
from qscheme.producers.base import WriteRequest


def writes(scheme: Scheme) -> bool:
    return False


def write_config(request: WriteRequest) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    raise UsageError(f"qscheme does not write bitsandbytes checkpoints (scheme {request.scheme.name})")
