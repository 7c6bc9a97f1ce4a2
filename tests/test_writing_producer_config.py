"""producer_config: the configs written parse in compressed-tensors and detect as the scheme."""

from __future__ import annotations

import pytest
from compressed_tensors.quantization import QuantizationConfig

import qscheme
from qscheme.writing.producer_config import config_files, producer_of

CT_SCHEMES = ["NVFP4A16", "NVFP4", "W4A16", "W4A16_ASYM", "FP8", "FP8_DYNAMIC", "FP8_BLOCK", "W8A8", "MXFP4A16"]


@pytest.mark.parametrize("name", CT_SCHEMES)
def test_compressed_tensors_config_validates_in_the_library(name: str) -> None:
    scheme = qscheme.load_scheme(f"compressed-tensors/{name}")
    files = config_files(scheme, {"model_type": "llama"}, ignore=["lm_head"], unquantized_modules=["lm_head"])
    assert list(files) == ["config.json"] and files["config.json"]["model_type"] == "llama"
    section = dict(files["config.json"]["quantization_config"])
    section.pop("version")
    parsed = QuantizationConfig.model_validate(section)
    assert parsed.format == scheme.detect.compressed_tensors.formats[0]  # type: ignore[union-attr]
    assert parsed.ignore == ["lm_head"] and parsed.quantization_status == "compressed"


def test_modelopt_files_and_self_describing() -> None:
    scheme = qscheme.load_scheme("modelopt/NVFP4")
    files = config_files(scheme, {}, ignore=["lm_head"], unquantized_modules=["model.embed_tokens", "lm_head"])
    section = files["hf_quant_config.json"]["quantization"]
    assert section == {
        "quant_algo": "NVFP4",
        "kv_cache_quant_algo": None,
        "group_size": 16,
        "exclude_modules": ["model.embed_tokens", "lm_head"],
    }
    assert files["config.json"]["quantization_config"]["quant_method"] == "modelopt"
    assert producer_of(qscheme.load_scheme("compressed-tensors/FP8")) == "compressed-tensors"
