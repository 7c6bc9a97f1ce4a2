"""The descriptor concepts bitsandbytes' schemes need, in their general form (docs/schemes.md,
"Codebooks, flat tensors, quantized scales and JSON states"): each key parsed strictly, the JSON
state checked key by key, and the loader's reading of a layer built from the declared layout (the
producer's own checkpoints are tested against bitsandbytes itself in test_bitsandbytes_oracle.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from qscheme.canonical import canonicalize, dequantize
from qscheme.catalog import load_scheme
from qscheme.descriptor import parse_scheme_text
from qscheme.descriptor.shapes import Dim
from qscheme.descriptor.state import read_state
from qscheme.errors import QuantizeError, SchemeError

SCHEMES = Path(__file__).resolve().parents[1] / "schemes" / "bitsandbytes"
BASE = (SCHEMES / "NF4.yaml").read_text()


def _errors(text: str) -> str:
    with pytest.raises(SchemeError) as error:
        parse_scheme_text(text, "b.yaml")
    return str(error.value)


def test_product_dimension_counts_the_whole_layer() -> None:
    assert Dim.parse("ceil(N*K/16384)").evaluate(64, 256) == 1
    assert Dim.parse("ceil(N * K/16384)").evaluate(128, 256) == 2
    assert Dim.parse("N*K/2").evaluate(3, 4) == 6
    assert Dim.parse("N*K/8").evaluate(3, 5) is None  # exact division


def test_flat_tensor_shapes_are_the_declared_shape_as_one_column() -> None:
    scheme = load_scheme("bitsandbytes/NF4")
    assert scheme.weight.tensor.flat and scheme.weight.scale.tensor.flat
    assert scheme.weight.tensor.expected_shapes(64, 128) == [(4096,), (4096, 1)]
    assert scheme.weight.tensor.layout_shapes(64, 128) == [(64, 64)]
    assert scheme.weight.scale.tensor.expected_shapes(64, 128) == [(128,), (128, 1)]
    assert scheme.weight_family == "codebook" and scheme.weight.pack_order == (1, 0)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("  pack_order: [1, 0]", "  pack_order: [1, 1]", r"not an order of a byte's two nibbles"),
        ("  table: [-1.0, ", "  table: [", r"a table of 15 values for format 'uint4'"),
        ("  format: uint4", "  format: int4", r"a table is indexed by unsigned codes"),
        ("shape: [N, K/2], flat: true}", "shape: [N, K/2], flat: true, transposed: true}", r"drop transposed or flat"),
        ("    shape_key: shape\n", "", r"weight\.state: missing required key 'shape_key'"),
        (
            "      blocksize: [64]",
            "      blocksize: 64",
            r"weight\.state\.values\.blocksize: expected a non-empty list",
        ),
        ("  table_tensor:", "  table_tensr:", r"unknown key 'table_tensr'"),
    ],
)
def test_new_keys_are_parsed_strictly(old: str, new: str, message: str) -> None:
    assert old in BASE
    assert re.search(message, _errors(BASE.replace(old, new, 1))), message


def test_quantized_scales_restore_to_float32_multipliers() -> None:
    text = (SCHEMES / "NF4_DQ.yaml").read_text().replace("    format: fp32\n", "    format: fp16\n", 1)
    assert "quantized scales restore to fp32 multipliers" in _errors(text)


STATE = load_scheme("bitsandbytes/NF4_DQ").weight.state


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"quant_type": "fp4"}, r"key 'quant_type' is \"fp4\"; this scheme reads \"nf4\""),
        ({"shape": [64]}, r"key 'shape' is \[64\]; expected the layer's \[N, K\]"),
        ({"shape": [64, True]}, r"two positive integers"),
        ({"nested_offset": float("inf")}, r"key 'nested_offset' is Infinity; expected a finite number"),
        ({"blocksize": True}, r"key 'blocksize' is true; this scheme reads 64"),
        ({"extra": 1}, r"key 'extra' is not one this scheme reads"),
    ],
)
def test_state_is_checked_key_by_key(change: dict[str, object], message: str) -> None:
    assert STATE is not None
    state = {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [64, 128], "nested_blocksize": 256}
    state |= {"nested_dtype": "float32", "nested_offset": 0.25}
    good = read_state(STATE, json.dumps(state).encode())
    assert not isinstance(good, str) and good.shape == (64, 128) and good.numbers == {"nested_offset": 0.25}
    problem = read_state(STATE, json.dumps(state | change).encode())
    assert isinstance(problem, str) and re.search(message, problem), problem
    missing = read_state(STATE, json.dumps({k: v for k, v in state.items() if k != "dtype"}).encode())
    reads = "shape, quant_type, blocksize, dtype, nested_blocksize, nested_dtype, nested_offset"
    assert missing == f"key 'dtype' is missing (the scheme reads {reads})"
    assert "not UTF-8 JSON" in str(read_state(STATE, b"\xff"))


def _layer(quant_type: str = "nf4") -> dict[str, torch.Tensor]:
    """One [2, 64] layer in the layout the NF4 descriptor declares: codes 0..15 then 15..0 per row
    (high nibble first), one absmax per row, the table copy and the state."""
    scheme = load_scheme(f"bitsandbytes/{quant_type.upper()}")
    assert scheme.weight.table is not None
    codes = torch.cat([torch.arange(16).repeat(4), torch.arange(15, -1, -1).repeat(4)]).to(torch.uint8)
    packed = (codes[0::2] << 4) | codes[1::2]
    state = {"quant_type": quant_type, "blocksize": 64, "dtype": "float32", "shape": [2, 64]}
    return {
        "weight": packed.reshape(-1, 1),
        "weight.absmax": torch.tensor([0.5, 3.0]),
        "weight.quant_map": torch.tensor(scheme.weight.table, dtype=torch.float32),
        f"weight.quant_state.bitsandbytes__{quant_type}": torch.tensor(
            list(json.dumps(state).encode()), dtype=torch.uint8
        ),
    }


def test_codes_high_nibble_first_index_the_table_times_the_block_absmax() -> None:
    scheme = load_scheme("bitsandbytes/NF4")
    assert scheme.weight.table is not None
    table = torch.tensor(scheme.weight.table, dtype=torch.float32)
    weight = dequantize(canonicalize(scheme, _layer()))
    codes = torch.cat([torch.arange(16).repeat(4), torch.arange(15, -1, -1).repeat(4)]).reshape(2, 64)
    expected = table[codes] * torch.tensor([[0.5], [3.0]])
    assert torch.equal(weight.view(torch.int32), expected.view(torch.int32))


def test_a_table_copy_that_differs_is_refused() -> None:
    tensors = _layer()
    tensors["weight.quant_map"] = tensors["weight.quant_map"].flip(0)
    with pytest.raises(QuantizeError, match=r"tensor 'weight.quant_map' is not the scheme's table"):
        canonicalize(load_scheme("bitsandbytes/NF4"), tensors)


def test_a_flat_tensor_of_the_wrong_size_is_refused() -> None:
    tensors = _layer()
    tensors["weight.absmax"] = torch.tensor([0.5, 3.0, 1.0])
    with pytest.raises(QuantizeError, match=r"flat tensor 'weight.absmax' holds 3 values, expected the 2 of"):
        canonicalize(load_scheme("bitsandbytes/NF4"), tensors)
