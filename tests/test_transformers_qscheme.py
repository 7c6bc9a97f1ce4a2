"""The ``qscheme`` route: a checkpoint ``quantize_checkpoint`` writes for a YAML-only scheme loads
with a plain ``AutoModelForCausalLM.from_pretrained(folder)``.

The scheme is tests/data/triton_schemes/uint4_g48_zero_points.yaml (no producer writes it, so
config.json gets ``quant_method: qscheme`` with the descriptor embedded), copied to a scratch
folder, used once by ``quantize_checkpoint`` and then deleted. The load runs in a fresh Python
whose working directory holds nothing and whose QSCHEME_SCHEME_PATH is unset, so the scheme can
come from config.json only. Its logits must equal, bit for bit, those of the same model built
by hand and loaded with ``apply_to_model`` (same layers, same kernel, same dtype: the two routes
must compute the very same thing).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from checkpoint_cache import single_threaded_torch  # noqa: F401
from test_writing_source import HIDDEN, INTERMEDIATE, KV, VOCAB, write_source_checkpoint

import qscheme.transformers  # noqa: F401  (registers the quantizers)
from qscheme.catalog import SCHEME_PATH_VARIABLE
from qscheme.checkpoint.model import apply_to_model
from qscheme.errors import CheckpointError
from qscheme.modules import QuantLinear
from qscheme.writing.quantize import quantize_checkpoint

SCHEME_FILE = Path(__file__).parent / "data" / "triton_schemes" / "uint4_g48_zero_points.yaml"
SCHEME = "test/UINT4_G48_ZP"
HEAD_DIM = 32
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": 2,
    "num_attention_heads": HIDDEN // HEAD_DIM,
    "num_key_value_heads": KV // HEAD_DIM,
    "head_dim": HEAD_DIM,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
INPUT_IDS = torch.tensor([[1, 5, 9, 200, 33, 7, 100, 2]])
QUANTIZED = 2 * 7  # q, k, v, o, gate, up, down of each layer; lm_head stays bf16 (the default ignore)

LOAD_IN_A_FRESH_PROCESS = """
import sys
import torch
import qscheme.transformers
from transformers import AutoModelForCausalLM
from qscheme.catalog import load_scheme
from qscheme.errors import SchemeNotFoundError
from qscheme.modules import QuantLinear

folder, out = sys.argv[1], sys.argv[2]
try:
    load_scheme("test/UINT4_G48_ZP")
except SchemeNotFoundError:
    pass
else:
    raise SystemExit("the scheme is on a search path: this test proves nothing")
model = AutoModelForCausalLM.from_pretrained(folder).eval()
# the kernel each layer's plan runs for the 8 tokens below
layers = {
    n: (m.scheme.name, m.kernel_for_batch(8).name) for n, m in model.named_modules() if isinstance(m, QuantLinear)
}
with torch.no_grad():
    logits = model(torch.tensor([[1, 5, 9, 200, 33, 7, 100, 2]])).logits
torch.save({"layers": layers, "logits": logits, "dtype": str(model.dtype)}, out)
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny bf16 Llama quantized into the YAML-only scheme; the YAML is gone afterwards."""
    root = tmp_path_factory.mktemp("qscheme_route")
    source = write_source_checkpoint(root / "source", config=LLAMA_CONFIG)
    scheme_file = root / "schemes" / "uint4_g48_zero_points.yaml"
    scheme_file.parent.mkdir()
    shutil.copy(SCHEME_FILE, scheme_file)
    quantize_checkpoint(source, root / "quantized", scheme_file)
    scheme_file.unlink()
    return root / "quantized"


def _by_hand(folder: Path, kernel: str | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{k: v for k, v in LLAMA_CONFIG.items() if k not in ("architectures", "model_type")})
    # built in bf16 as from_pretrained builds it (.to(bf16) would also round the float32 RoPE buffer)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    apply_to_model(model, folder, kernel=kernel)
    return model


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(INPUT_IDS).logits
    return logits


def test_the_checkpoint_describes_itself(checkpoint: Path) -> None:
    quantization = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    assert quantization["quant_method"] == "qscheme" and quantization["scheme"] == SCHEME
    assert f"name: {SCHEME}" in quantization["descriptor"]


@pytest.mark.subprocess
def test_plain_from_pretrained_in_a_fresh_process_equals_apply_to_model(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "loaded.pt"
    # no scheme path; no Triton interpreter (on a CPU the resolver then picks the reference kernel)
    env = {key: value for key, value in os.environ.items() if key not in (SCHEME_PATH_VARIABLE, "TRITON_INTERPRET")}
    empty = tmp_path / "cwd"
    empty.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS, str(checkpoint), str(out)],
        cwd=empty,
        env={**env, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = torch.load(out)
    assert loaded["dtype"] == "torch.bfloat16"  # config.json's dtype, as transformers chooses it
    assert len(loaded["layers"]) == QUANTIZED
    assert {scheme for scheme, _ in loaded["layers"].values()} == {SCHEME}
    kernels = {kernel for _, kernel in loaded["layers"].values()}
    assert len(kernels) == 1, kernels
    by_hand = _by_hand(checkpoint, kernel=kernels.pop())  # the kernel the fresh process ran (M = 8)
    expected_layers = {
        n: (m.scheme.name, m.kernel_for_batch(8).name) for n, m in by_hand.named_modules() if isinstance(m, QuantLinear)
    }
    assert loaded["layers"] == expected_layers
    assert torch.equal(loaded["logits"], _logits(by_hand))


@pytest.mark.interpreter
def test_the_triton_kernel_through_from_pretrained_equals_apply_to_model(checkpoint: Path) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("the Triton kernel needs CUDA or TRITON_INTERPRET=1")
    from transformers import AutoModelForCausalLM

    from qscheme.transformers import via_qscheme

    model = AutoModelForCausalLM.from_pretrained(checkpoint, config=via_qscheme(checkpoint, kernel="triton")).eval()
    kernels = {m.kernel.name for m in model.modules() if isinstance(m, QuantLinear)}
    assert kernels == {"triton"}
    assert torch.equal(_logits(model), _logits(_by_hand(checkpoint, kernel="triton")))


def test_a_descriptor_that_is_not_the_named_scheme_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "renamed"
    shutil.copytree(checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["scheme"] = "test/SOMETHING_ELSE"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"test/SOMETHING_ELSE.*embedded descriptor is named"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_an_unknown_forced_kernel_is_refused_naming_the_known_ones(checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM

    from qscheme.errors import UsageError
    from qscheme.transformers import via_qscheme

    with pytest.raises(UsageError, match=r"unknown kernel 'nope'.*Known kernels: .*reference"):
        AutoModelForCausalLM.from_pretrained(checkpoint, config=via_qscheme(checkpoint, kernel="nope"))
    with pytest.raises(UsageError, match=r"kernel must be a kernel name"):
        via_qscheme(checkpoint, kernel="")
