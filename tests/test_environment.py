"""qscheme.environment: switches and name lists read strictly, and every QSCHEME_* switch uses them."""

from __future__ import annotations

import pytest

from qscheme.environment import FALSE_VALUES, TRUE_VALUES, env_flag, env_names
from qscheme.errors import UsageError


@pytest.mark.parametrize("value", [*TRUE_VALUES, "TRUE", " On ", "Yes"])
def test_on_values(value: str) -> None:
    assert env_flag("QSCHEME_X", {"QSCHEME_X": value}) is True


@pytest.mark.parametrize("value", [*FALSE_VALUES, "FALSE", " off ", "  "])
def test_off_values_and_unset(value: str) -> None:
    assert env_flag("QSCHEME_X", {"QSCHEME_X": value}) is False
    assert env_flag("QSCHEME_X", {}) is False


@pytest.mark.parametrize("value", ["2", "-1", "enable", "ture", "1,", "y", "n", "x" * 500])
def test_other_values_are_named_errors(value: str) -> None:
    with pytest.raises(UsageError) as caught:
        env_flag("QSCHEME_X", {"QSCHEME_X": value})
    message = str(caught.value)
    assert message.startswith("environment variable QSCHEME_X=")
    assert "is not understood; allowed: 1, true, yes, on (on) or 0, false, no, off, empty or unset (off)" in message
    assert len(message) < 400  # a long value is shortened


def test_name_lists() -> None:
    assert env_names("QSCHEME_P", {}) is None
    assert env_names("QSCHEME_P", {"QSCHEME_P": ""}) == frozenset()
    assert env_names("QSCHEME_P", {"QSCHEME_P": " a , b.c,d-e_f ,"}) == {"a", "b.c", "d-e_f"}
    with pytest.raises(UsageError, match=r"'a b' is not a plugin name"):
        env_names("QSCHEME_P", {"QSCHEME_P": "ok,a b"})


@pytest.mark.parametrize(
    ("variable", "read"),
    [
        ("QSCHEME_STRICT_SCHEMES", "qscheme.catalog:strict_schemes"),
        ("QSCHEME_TRITON_AUTOTUNE", "qscheme.triton.configs:autotune_enabled"),
    ],
)
def test_other_switches_are_read_strictly(variable: str, read: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    module, _, name = read.partition(":")
    function = getattr(importlib.import_module(module), name)
    monkeypatch.setenv(variable, "on")
    assert function() is True
    monkeypatch.setenv(variable, "no")
    assert function() is False
    monkeypatch.setenv(variable, "sometimes")
    with pytest.raises(UsageError, match=rf"environment variable {variable}='sometimes' is not understood"):
        function()


def test_the_gemv_switch_is_read_strictly(monkeypatch: pytest.MonkeyPatch) -> None:
    """QSCHEME_TRITON_GEMV=true used to mean off (only "1" counted); now it means on, and a
    value that is neither is refused."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from qscheme.catalog import load_scheme
    from qscheme.triton import configs
    from qscheme.triton import linear as lin
    from qscheme.triton.samples import random_weight

    prepared = lin.prepare_weight(random_weight(load_scheme("compressed-tensors/NVFP4A16"), 64, 64), "cpu")
    h200 = configs.DeviceFacts("H200-like", 132, 227 * 1024, (9, 0))
    for value, gemv in (("true", True), ("On", True), ("off", False), ("", False)):
        monkeypatch.setenv(lin.GEMV_VARIABLE, value)
        assert lin.heuristic_for(prepared, 1, 8192, 8192, torch.bfloat16, h200).gemv is gemv, value
    monkeypatch.setenv(lin.GEMV_VARIABLE, "fast")
    with pytest.raises(UsageError, match="QSCHEME_TRITON_GEMV='fast' is not understood"):
        lin.heuristic_for(prepared, 1, 8192, 8192, torch.bfloat16, h200)
