"""checked_device: a ``device=`` argument as a torch.device, or a UsageError that says what is allowed."""

from __future__ import annotations

import torch

from qscheme.errors import UsageError

DEVICE_FORMS = "'cpu', 'cuda', 'cuda:N' or a torch.device"


def checked_device(device: object, caller: str = "load_checkpoint") -> torch.device:
    """``device=`` as a torch.device; a UsageError naming the value and the allowed forms otherwise.

    Checked before anything is read: the value must parse, must not be the meta device, and a
    CUDA device must be visible.
    """
    if isinstance(device, torch.device):
        torch_device = device
    elif isinstance(device, str):
        try:
            torch_device = torch.device(device)
        except (RuntimeError, ValueError):
            raise UsageError(f"{caller}(device={device!r}): not a device; pass {DEVICE_FORMS}") from None
    else:
        example = f"'cuda:{device}'" if isinstance(device, int) and not isinstance(device, bool) else "'cpu'"
        raise UsageError(
            f"{caller}(device={device!r}): a device is {DEVICE_FORMS}, not of type {type(device).__name__}; "
            f"e.g. device={example}"
        )
    if torch_device.type == "cpu":
        return torch.device("cpu")  # "cpu:0" is the one CPU device too
    if torch_device.type == "meta":
        raise UsageError(
            f"{caller}(device={device!r}): nothing can be loaded onto the meta device; pass 'cpu' or 'cuda'"
        )
    if torch_device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(
                f"{caller}(device={device!r}): no CUDA device is visible here (torch {torch.__version__}, "
                "torch.cuda.is_available() is False); pass device='cpu', or run where a GPU is visible"
            )
        count = torch.cuda.device_count()
        if torch_device.index is not None and torch_device.index >= count:
            raise UsageError(
                f"{caller}(device={device!r}): there is no CUDA device {torch_device.index} here; "
                f"{count} visible: pass one of {', '.join(f'cuda:{i}' for i in range(count))}"
            )
    return torch_device
