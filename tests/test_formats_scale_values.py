"""Masks over stored scales (qscheme.formats.scale_values): every fp8 and e8m0 byte against
its float32 value, and the one-pass ``any_*`` forms against the masks."""

from __future__ import annotations

import pytest
import torch

from qscheme.formats import decode
from qscheme.formats.scale_values import any_negative, any_nonfinite, negative, nonfinite, not_positive

EVERY_BYTE = torch.arange(256, dtype=torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_bytes_agree_with_their_float_values(dtype: torch.dtype) -> None:
    stored = EVERY_BYTE.view(dtype)
    value = stored.to(torch.float32)
    assert torch.equal(nonfinite(stored), ~torch.isfinite(value))
    assert torch.equal(negative(stored), (value < 0) & torch.isfinite(value))  # -inf is non-finite, not negative
    assert torch.equal(not_positive(stored), ~(value > 0) | torch.isinf(value))
    assert int(nonfinite(stored).sum()) == (2 if dtype == torch.float8_e4m3fn else 8)


def test_e8m0_bytes_are_powers_of_two_but_0xff() -> None:
    value = decode(EVERY_BYTE, "e8m0")
    assert torch.equal(nonfinite(EVERY_BYTE), torch.isnan(value))
    assert torch.equal(not_positive(EVERY_BYTE), torch.isnan(value))  # byte 0 is 2**-127, not zero
    assert not bool(negative(EVERY_BYTE).any()) and not any_negative(EVERY_BYTE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_float_scales(dtype: torch.dtype) -> None:
    value = torch.tensor([1.0, -0.0, 0.0, -2.0, float("inf"), float("-inf"), float("nan"), 3.0], dtype=dtype)
    assert nonfinite(value).tolist() == [False, False, False, False, True, True, True, False]
    assert negative(value).tolist() == [False, False, False, True, False, True, False, False]
    assert not_positive(value).tolist() == [False, True, True, True, True, True, True, False]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.bfloat16, torch.float32])
def test_one_pass_forms_agree_with_the_masks(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    positive = torch.rand(64, generator=generator) + 0.5
    cases = [positive, -positive, positive[:0]]
    if dtype == torch.uint8:
        samples = [torch.randint(0, 255, (64,), generator=generator, dtype=torch.uint8)]
        samples.append(torch.cat([samples[0], torch.tensor([255], dtype=torch.uint8)]))
    else:
        samples = [case.to(dtype) for case in cases]
        for special in (float("nan"), float("inf"), -1.0):
            with_special = positive.clone()
            with_special[7] = special
            samples.append(with_special.to(dtype))
        if dtype == torch.float8_e4m3fn:  # the two NaN bytes, one with the sign bit
            for byte in (0x7F, 0xFF):
                raw = positive.to(dtype).view(torch.uint8).clone()
                raw[3] = byte
                samples.append(raw.view(dtype))
    for sample in samples:
        assert any_nonfinite(sample) == bool(nonfinite(sample).any()), sample
        assert any_negative(sample) == bool(negative(sample).any()), sample
    assert any(any_nonfinite(s) for s in samples) and not any_nonfinite(samples[0])
