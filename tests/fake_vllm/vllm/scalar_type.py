"""The scalar types of vLLM 0.33's Marlin, by name, with the ids vLLM 0.33.0 gives them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScalarType:
    name: str
    id: int
    size_bits: int


class scalar_types:
    uint4b8 = ScalarType("uint4b8", 0x4000000100400, 4)
    uint4 = ScalarType("uint4", 0x4000000000400, 4)
    uint8b128 = ScalarType("uint8b128", 0x4000001000800, 8)
    float8_e4m3fn = ScalarType("float8_e4m3fn", 0xA000000010304, 8)
    float4_e2m1f = ScalarType("float4_e2m1f", 0x2000000010102, 4)
