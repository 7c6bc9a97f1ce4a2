"""qscheme.triton.launch: the host's grid arithmetic equals Triton's own."""

from __future__ import annotations

import triton

from qscheme.triton.launch import cdiv, next_power_of_2


def test_cdiv_equals_tritons() -> None:
    for a in range(0, 600):
        for b in (1, 2, 3, 7, 16, 32, 64, 100, 128, 1024):
            assert cdiv(a, b) == triton.cdiv(a, b) == -(-a // b)


def test_next_power_of_2_equals_tritons_for_sizes() -> None:
    for n in [*range(1, 5000), 2**20 - 1, 2**20, 2**20 + 1, 2**31 - 1]:
        value = next_power_of_2(n)
        assert value == triton.next_power_of_2(n)
        assert value >= n and value & (value - 1) == 0 and (value == 1 or value // 2 < n)
