"""GPTQ and AWQ layouts pinned to their producers' documented packing, and the strictness of their
loads (issue 27, point 7), on tiny checkpoints written here from that layout.

The layouts, as GPTQModel's ``PackableQuantLinear.pack`` and AutoAWQ's ``WQLinear_GEMM.from_linear``
write them (the oracle tests, tests/test_gptq_awq_oracle.py, check files those libraries wrote):

- GPTQ: ``qweight`` int32 [K*bits/32, N]: input channel k of output n is bits ``bits*(k % per)``
  upward of word ``k // per`` (per = 32 / bits), low bits first; ``qzeros`` int32 [K/g, N*bits/32]
  packed the same way along N; ``scales`` float16 [K/g, N]; ``g_idx`` int32 [K]; w = scale *
  (q - zero). ``checkpoint_format: gptq`` (v1) stores zero - 1, ``gptq_v2`` the zero.
- GPTQ 3-bit: no whole number of codes fits a word, so both are one bit stream along their axis,
  32 codes in 3 words: code i occupies bits 3i to 3i+2 of the stream, word w holding stream bits
  32w to 32w+31 (codes 10 and 21 of each 32 straddle two words).
- AWQ GEMM: ``qweight`` int32 [K, N/8]: slot i (bits 4i upward) of word j holds output
  8j + (0, 2, 4, 6, 1, 3, 5, 7)[i]; ``qzeros`` [K/g, N/8] likewise; ``scales`` [K/g, N].
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qscheme.canonical import canonicalize, dequantize
from qscheme.catalog import load_scheme
from qscheme.checkpoint import load_checkpoint
from qscheme.errors import QSchemeError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
MODULE = "model.layers.0.mlp.down_proj"


def _words(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack unsigned values [rows, L] along L into int32 words, slot i <- element order[i]."""
    per = 32 // bits
    order = order or tuple(range(per))
    rows, length = values.shape
    words = torch.zeros(rows, length // per, dtype=torch.int64)
    for word in range(length // per):
        for slot, element in enumerate(order):
            words[:, word] |= values[:, word * per + element].to(torch.int64) << (bits * slot)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _stream(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned values [rows, L] along L as one bit stream into int32 words, bit by bit."""
    rows, length = values.shape
    words = torch.zeros(rows, length * bits // 32, dtype=torch.int64)
    for element in range(length):
        for bit in range(bits):
            position = element * bits + bit
            words[:, position // 32] |= ((values[:, element].to(torch.int64) >> bit) & 1) << (position % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _gptq_tensors(
    q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, bits: int, group: int, v1: bool
) -> dict[str, torch.Tensor]:
    """q [N, K] unsigned codes, zero/scale [N, K/g]: GPTQ's tensors."""
    k = q.shape[1]
    pack = _stream if 32 % bits else _words
    return {
        "qweight": pack(q, bits).T.contiguous(),  # packed along K, stored [K*bits/32, N]
        "qzeros": pack((zero - 1 if v1 else zero).T.contiguous(), bits),  # [K/g, N*bits/32]
        "scales": scale.T.contiguous().half(),
        "g_idx": (torch.arange(k) // group).to(torch.int32),
    }


def _awq_tensors(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "qweight": _words(q.T.contiguous(), 4, AWQ_ORDER),  # [K, N/8]
        "qzeros": _words(zero.T.contiguous(), 4, AWQ_ORDER),  # [K/g, N/8]
        "scales": scale.T.contiguous().half(),
    }


def _codes(n: int, k: int, bits: int, group: int, seed: int, low_zero: int = 1) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=generator)
    zero = torch.randint(low_zero, 2**bits, (n, k // group), generator=generator)
    scale = (torch.rand(n, k // group, generator=generator) + 0.5).half().float() / 64
    return q, zero, scale


def _expected(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    columns = torch.arange(q.shape[1]) // group
    return (q - zero[:, columns]).float() * scale[:, columns]


@pytest.mark.parametrize(
    ("scheme", "bits", "group", "v1"),
    [
        ("gptq/W4A16_ASYM_G32", 4, 32, True),
        ("gptq_v2/W4A16_ASYM_G32", 4, 32, False),
        ("gptq/W4A16_ASYM", 4, 128, True),
        ("gptq/W2A16_ASYM", 2, 128, True),
        ("gptq_v2/W2A16_ASYM", 2, 128, False),
        ("gptq/W3A16_ASYM", 3, 128, True),
        ("gptq_v2/W3A16_ASYM_G32", 3, 32, False),
        ("gptq/W3A16_ASYM_G64", 3, 64, True),
    ],
)
def test_gptq_layout_dequantizes_to_scale_times_code_minus_zero(scheme: str, bits: int, group: int, v1: bool) -> None:
    q, zero, scale = _codes(64, 256, bits, group, seed=bits + group)
    tensors = _gptq_tensors(q, zero, scale, bits, group, v1)
    assert tensors["qweight"].shape == (256 * bits // 32, 64) and tensors["qzeros"].shape == (
        256 // group,
        64 * bits // 32,
    )
    assert torch.equal(dequantize(canonicalize(load_scheme(scheme), tensors)), _expected(q, zero, scale, group))


def test_gptq_8bit_symmetric_layout_and_its_zero_point() -> None:
    q, _, scale = _codes(32, 128, 8, 128, seed=8)
    zero = torch.full_like(scale, 128, dtype=torch.int64)
    tensors = _gptq_tensors(q, zero, scale, 8, 128, v1=True)
    weight = canonicalize(load_scheme("gptq/W8A16"), tensors)
    assert weight.zero_point is None  # symmetric: the stored zeros are checked, then dropped
    assert torch.equal(dequantize(weight), _expected(q, zero, scale, 128))


def test_awq_layout_dequantizes_to_scale_times_code_minus_zero() -> None:
    q, zero, scale = _codes(64, 256, 4, 128, seed=3, low_zero=0)
    tensors = _awq_tensors(q, zero, scale)
    assert tensors["qweight"].shape == (256, 8)
    # slot 1 of the first word holds output 2 of input 0 (the 0, 2, 4, 6, 1, 3, 5, 7 order)
    assert (int(tensors["qweight"][0, 0]) >> 4) & 0xF == int(q[2, 0])
    assert torch.equal(dequantize(canonicalize(load_scheme("awq/W4A16_ASYM"), tensors)), _expected(q, zero, scale, 128))


def test_gptq_and_awq_share_compressed_tensors_canonical_codes() -> None:
    q, zero, scale = _codes(64, 256, 4, 128, seed=5)
    gptq = canonicalize(load_scheme("gptq_v2/W4A16_ASYM"), _gptq_tensors(q, zero, scale, 4, 128, v1=False))
    awq = canonicalize(load_scheme("awq/W4A16_ASYM"), _awq_tensors(q, zero, scale))
    assert torch.equal(gptq.codes, awq.codes) and torch.equal(gptq.zero_point, awq.zero_point)  # type: ignore[arg-type]
    assert (
        gptq.scheme.weight_family
        == awq.scheme.weight_family
        == load_scheme("compressed-tensors/W4A16_ASYM").weight_family
    )


# ---------------------------------------------------------------------------- strictness


def _folder(tmp_path: Path, tensors: dict[str, torch.Tensor], config: dict[str, object]) -> Path:
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    save_file({f"{MODULE}.{name}": value.contiguous() for name, value in tensors.items()}, folder / "model.safetensors")
    document = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "quantization_config": config}
    (folder / "config.json").write_text(json.dumps(document))
    return folder


GPTQ_V1 = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


def _gptq_layer() -> dict[str, torch.Tensor]:
    q, zero, scale = _codes(64, 128, 4, 32, seed=11)
    return _gptq_tensors(q, zero, scale, 4, 32, v1=True)


def test_a_well_formed_gptq_checkpoint_loads(tmp_path: Path) -> None:
    checkpoint = load_checkpoint(_folder(tmp_path, _gptq_layer(), GPTQ_V1))
    assert checkpoint.modules[MODULE].scheme.name == "gptq/W4A16_ASYM_G32"


def test_a_transposed_packed_weight_is_refused(tmp_path: Path) -> None:
    tensors = _gptq_layer()
    tensors["qweight"] = tensors["qweight"].T.contiguous()  # [N, K/8]: the compressed-tensors orientation
    with pytest.raises(QSchemeError, match=r"qweight.*\[64, 16\]"):
        load_checkpoint(_folder(tmp_path, tensors, GPTQ_V1))


def test_an_orphan_qzeros_without_its_weight_is_refused(tmp_path: Path) -> None:
    tensors = _gptq_layer()
    del tensors["qweight"]
    with pytest.raises(QSchemeError, match=r"qweight"):
        load_checkpoint(_folder(tmp_path, tensors, GPTQ_V1))


def test_an_orphan_g_idx_in_an_awq_layer_is_refused(tmp_path: Path) -> None:
    q, zero, scale = _codes(64, 128, 4, 128, seed=12, low_zero=0)
    tensors = {**_awq_tensors(q, zero, scale), "g_idx": torch.zeros(128, dtype=torch.int32)}
    with pytest.raises(QSchemeError, match=r"g_idx"):
        load_checkpoint(_folder(tmp_path, tensors, AWQ))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda g: g.fill_(4), r"values in \[4, 4\]; allowed: group numbers 0\.\.3"),
        (lambda g: g.__setitem__(0, 1), r"puts 31 columns in group 0, which holds 32"),
        (lambda g: g.__setitem__(-1, -1), r"values in \[-1, 3\]"),
    ],
)
def test_a_g_idx_that_is_not_a_group_assignment_is_refused(tmp_path: Path, damage, message: str) -> None:  # type: ignore[no-untyped-def]
    tensors = _gptq_layer()
    damage(tensors["g_idx"])
    with pytest.raises(QSchemeError, match=message):
        load_checkpoint(_folder(tmp_path, tensors, GPTQ_V1))


def test_dtypes_and_widths_that_disagree_with_the_config_are_refused(tmp_path: Path) -> None:
    wider = _folder(tmp_path, _gptq_layer(), {**GPTQ_V1, "bits": 8, "group_size": 128, "sym": True})  # 4-bit words
    with pytest.raises(QSchemeError, match=r"qweight"):
        load_checkpoint(wider)
    tensors = _gptq_layer()
    tensors["scales"] = tensors["scales"].to(torch.int32)
    (tmp_path / "b").mkdir()
    with pytest.raises(QSchemeError, match=r"scales.*int32"):
        load_checkpoint(_folder(tmp_path / "b", tensors, GPTQ_V1))


def test_3bit_words_of_a_width_no_layer_has_or_read_as_4bit_are_refused(tmp_path: Path) -> None:
    q, zero, scale = _codes(64, 128, 3, 32, seed=12)
    tensors = _gptq_tensors(q, zero, scale, 3, 32, v1=True)
    config = {**GPTQ_V1, "bits": 3}
    load_checkpoint(_folder(tmp_path, tensors, config))  # well formed: loads
    cut = {**tensors, "qweight": tensors["qweight"][:-1].contiguous()}  # 11 words: not whole 32-code runs
    (tmp_path / "cut").mkdir()
    with pytest.raises(QSchemeError, match=r"qweight.*\[11, 64\]"):
        load_checkpoint(_folder(tmp_path / "cut", cut, config))
    (tmp_path / "as4").mkdir()  # 3-bit words labelled 4-bit: the widths disagree, named
    with pytest.raises(QSchemeError, match=r"qweight"):
        load_checkpoint(_folder(tmp_path / "as4", tensors, GPTQ_V1))


def _3bit_descriptor(qweight_shape: str, extra_scale_key: str = "") -> str:
    text = (Path(__file__).resolve().parents[1] / "schemes" / "gptq" / "W3A16_ASYM.yaml").read_text()
    text = text.replace("shape: [K/32*3, N]", f"shape: {qweight_shape}")
    return text.replace("    granularity: group\n", f"    granularity: group\n{extra_scale_key}")


def test_the_descriptor_states_3bit_words_as_whole_runs_of_the_bit_stream() -> None:
    from qscheme.descriptor import parse_scheme_text
    from qscheme.errors import SchemeError

    assert parse_scheme_text(_3bit_descriptor("[K/32*3, N]")).weight.format == "int3"
    # ten whole codes per word is not how the stream is cut: the declared words must be K/32*3
    with pytest.raises(SchemeError, match=r"\[K/10, N\].*32 elements per 3 int32 words along K.*\[K/32\*3, N\]"):
        parse_scheme_text(_3bit_descriptor("[K/10, N]"))
    with pytest.raises(SchemeError, match=r"signed"):
        parse_scheme_text(_3bit_descriptor("[K/32*3, N]", "    signed: maybe\n"))


def test_a_v1_zero_of_zero_is_refused_not_read_as_sixteen(tmp_path: Path) -> None:
    q, zero, scale = _codes(64, 128, 4, 32, seed=13)
    zero[5, 1] = 0  # v1 stores zero - 1: -1 has no 4-bit field; GPTQModel borrows, AutoGPTQ reads 16
    tensors = _gptq_tensors(q, zero.clamp(min=1), scale, 4, 32, v1=True)
    word = tensors["qzeros"][1, 0]
    tensors["qzeros"][1, 0] = int(word) | (0xF << 20)  # the nibble of output 5 now holds 15 (= -1)
    with pytest.raises(QSchemeError, match=r"zero points 'qzeros' \(stored with offset -1\) must lie in \[-8, 7\]"):
        load_checkpoint(_folder(tmp_path, tensors, GPTQ_V1))


def test_a_module_a_dynamic_entry_skips_must_not_be_quantized(tmp_path: Path) -> None:
    config = {**GPTQ_V1, "dynamic": {r"-:.*down_proj": {}}}
    with pytest.raises(QSchemeError, match=r"left unquantized by dynamic '-:\.\*down_proj' but stores quantized"):
        load_checkpoint(_folder(tmp_path, _gptq_layer(), config))


def test_a_config_no_scheme_matches_names_the_known_rules(tmp_path: Path) -> None:
    with pytest.raises(QSchemeError, match=r"checkpoint_format 'gptq_p' with bits 4.*matches no scheme"):
        load_checkpoint(_folder(tmp_path, _gptq_layer(), {**GPTQ_V1, "checkpoint_format": "gptq_p"}))


# ---------------------------------------------------------------------------- kernel routes


@pytest.mark.parametrize(
    ("name", "twin"),
    [
        ("gptq/W4A16", "compressed-tensors/W4A16"),
        ("gptq_v2/W4A16_ASYM", "compressed-tensors/W4A16_ASYM"),
        ("awq/W4A16_ASYM", "compressed-tensors/W4A16_ASYM"),
    ],
)
def test_the_kernels_see_compressed_tensors_tensors_and_take_the_same_routes(name: str, twin: str) -> None:
    from kernel_fakes import AS_IF_IMPLEMENTED, fake_device

    from qscheme.kernels.problem import Problem
    from qscheme.kernels.resolver import resolve
    from qscheme.quantize import quantize_weight

    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(21)) * 0.05
    ours = canonicalize(load_scheme(name), quantize_weight(weight, name))
    theirs = canonicalize(load_scheme(twin), quantize_weight(weight, twin))
    assert ours.kernel_tensors().keys() == theirs.kernel_tensors().keys()
    for field, value in ours.kernel_tensors().items():
        assert torch.equal(value, theirs.kernel_tensors()[field]), field
    # so Marlin (vLLM's gptq/awq Marlin repack of these canonical tensors) and cpu_gemv take them as they do
    # compressed-tensors'
    for device in ("cpu", "sm80", "sm90", "sm120"):
        problem = Problem(4096, 4096)
        chosen = resolve(load_scheme(name), problem, fake_device(device), AS_IF_IMPLEMENTED).kernel
        expected = resolve(load_scheme(twin), problem, fake_device(device), AS_IF_IMPLEMENTED).kernel
        assert chosen is not None and expected is not None and chosen.name == expected.name, device
        assert chosen.name == ("cpu_gemv" if device == "cpu" else "marlin")


@pytest.mark.parametrize("name", ["gptq/W4A16", "gptq_v2/W4A16_ASYM_G32", "awq/W4A16_ASYM"])
def test_tinygemm_cpu_runs_them_within_its_declared_bound(name: str) -> None:
    from qscheme_plugins.tinygemm_kernel import TinygemmCpuKernel
    from test_tinygemm import CPU, assert_within, expected_and_bound

    from qscheme.triton.samples import random_weight

    weight = random_weight(load_scheme(name), 64, 256, scale_dtype="bfloat16", seed=9)
    kernel = TinygemmCpuKernel()
    state = kernel.prepare(weight, CPU)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    expected, bound = expected_and_bound(weight, x, None, CPU)
    assert_within(kernel.apply(state, x, None), expected, bound, name)


def test_act_order_layers_hold_their_columns_permuted_and_dequantize_in_the_inputs_order() -> None:
    q, zero, scale = _codes(64, 256, 4, 32, seed=17)
    order = torch.randperm(256, generator=torch.Generator().manual_seed(17))
    g_idx = torch.empty(256, dtype=torch.int32)
    g_idx[order] = (torch.arange(256) // 32).to(torch.int32)  # desc_act: group i // 32 for the i-th column taken
    tensors = {**_gptq_tensors(q, zero, scale, 4, 32, v1=False), "g_idx": g_idx}
    weight = canonicalize(load_scheme("gptq_v2/W4A16_ASYM_G32"), tensors)
    assert weight.input_permutation is not None
    assert torch.equal(g_idx[weight.input_permutation].long(), torch.arange(256) // 32)  # groups now consecutive
    expected = (q - zero[:, g_idx.long()]).float() * scale[:, g_idx.long()]
    assert torch.equal(dequantize(weight), expected)
