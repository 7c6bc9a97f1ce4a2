"""llm-compressor writing a tiny gpt-oss as compressed-tensors MXFP4A16: what such a checkpoint is.

Two halves in one file, like tests/llmcompressor_oracle.py (whose side venv it runs in):

- run as a script under the Python of ``QSCHEME_LLMCOMPRESSOR_PYTHON``::

      python gpt_oss_llmcompressor_oracle.py CONFIG_DIR DENSE.safetensors DST

  builds transformers' ``GptOssForCausalLM`` from CONFIG_DIR's config.json (its
  ``quantization_config`` dropped), loads the tensors of DENSE (strictly: every expert parameter
  must be given), linearizes its experts with llm-compressor's own ``linearize_moe`` (gpt-oss's
  ``GptOssLinearExperts``: one ``gate_proj``/``up_proj``/``down_proj`` Linear per expert), quantizes
  the Linears (not the attention, routers or lm_head) with ``oneshot`` and the ``MXFP4A16`` preset,
  and saves with ``save_pretrained`` (compressed). Only transformers, llm-compressor and
  compressed-tensors are imported, never qscheme.

- imported by tests (main venv): ``write_with_llmcompressor``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

IGNORE = ["lm_head", "re:.*mlp\\.router$", "re:.*self_attn\\..*"]


def write_with_llmcompressor(config_dir: Path, dense: Path, dst: Path, *, timeout: float = 600) -> None:
    """Run the oracle (skips the calling test when its venv is not exported; CI always exports it)."""
    from llmcompressor_oracle import oracle_python

    completed = subprocess.run(
        [oracle_python(), __file__, str(config_dir), str(dense), str(dst)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore"},
    )
    if completed.returncode != 0:
        raise RuntimeError(f"llm-compressor failed:\n{completed.stderr[-4000:]}")


def _main(config_dir: str, dense: str, dst: str) -> None:  # pragma: no cover - runs in the oracle venv
    import tempfile

    from loguru import logger

    logger.remove()
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from safetensors.torch import load_file
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig.from_pretrained(config_dir)
    del config.quantization_config
    with tempfile.TemporaryDirectory() as unquantized:
        # oneshot reads the model's config from disk: give it one without quantization
        config.save_pretrained(unquantized)
        model = GptOssForCausalLM(config)
        model.config._name_or_path = unquantized
        state = load_file(dense)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or any(".mlp.experts." in name for name in missing):
            raise SystemExit(f"dense experts not loaded: missing {missing}, unexpected {unexpected}")
        linearize_moe(model)
        oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="MXFP4A16", ignore=IGNORE))
        model.save_pretrained(dst)


if __name__ == "__main__":
    _main(*sys.argv[1:4])
