"""Run under a Python that has nvidia-modelopt: a fixture's whole model as ModelOpt computes it.

    python modelopt_model_oracle.py IN.pt OUT.pt FIXTURE [FIXTURE ...]

Rebuilds the fixture's model exactly as tests/fixtures/modelopt/generate.py does (same seed,
config and calibration), quantizes it with ModelOpt and exports it again. Inside the exporter,
right before it packs the weights (the state the checkpoint holds), it runs the fake-quantized
model on IN.pt's ``input_ids``: the logits and greedy ``generate()`` tokens.

Where ModelOpt's fake quantization has no CPU path (the NVFP4 family asserts CUDA), the oracle is
instead the float model loaded from the export with every quantized weight replaced by ModelOpt's
own dequantization (``NVFP4QTensor.dequantize``), and activations, where the scheme quantizes
them, quantized and dequantized with ModelOpt's ``NVFP4QTensor`` at the exported input_scale.

OUT.pt, per fixture: {"logits", "tokens", "oracle": "fake_quant" | "qtensor", "same_checkpoint": bool}, where
``same_checkpoint`` says the re-export is byte-identical to the fixture's model.safetensors.
Only torch, transformers and modelopt are imported, never qscheme.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

FIXTURES = Path(__file__).parent / "fixtures" / "modelopt"
NEW_TOKENS = 6


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("modelopt_fixture_generator", FIXTURES / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _run(model, input_ids):  # type: ignore[no-untyped-def]
    with torch.no_grad():
        logits = model(input_ids).logits.float()
        tokens = model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    return logits, tokens


def _qtensor_model(gen, fixture, export_dir: Path, input_ids):  # type: ignore[no-untyped-def]
    """The exported model in float, with ModelOpt's own dequantized weights (and NVFP4 input quantization)."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor
    from safetensors.torch import load_file

    state = load_file(str(export_dir / "model.safetensors"))
    quant = gen.json.loads((export_dir / "hf_quant_config.json").read_text())["quantization"]
    algo, group = quant["quant_algo"], quant["group_size"]
    model = gen.build_model(fixture)
    plain = {}
    quantized = {}
    for key, value in state.items():
        module, _, tensor = key.rpartition(".")
        if f"{module}.weight_scale" in state:
            quantized.setdefault(module, {})[tensor] = value
        else:
            plain[key] = value
    for module, tensors in quantized.items():
        plain[f"{module}.weight"] = gen.dequantize(algo, group, tensors).to(fixture.dtype)
    missing, unexpected = model.load_state_dict(plain, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)

    def quantize_input(input_scale):  # type: ignore[no-untyped-def]
        def hook(module, args):  # type: ignore[no-untyped-def]
            x = args[0]
            packed, scale, scale_2 = NVFP4QTensor.quantize(x, group, weights_scaling_factor_2=input_scale)
            x_dq = packed.dequantize(dtype=x.dtype, scale=scale, double_scale=scale_2, block_sizes={-1: group})
            return (x_dq.reshape(x.shape),)

        return hook

    for module, tensors in quantized.items():
        if "input_scale" in tensors and algo == "NVFP4":
            model.get_submodule(module).register_forward_pre_hook(quantize_input(tensors["input_scale"].float()))
    return _run(model.eval(), input_ids)


def oracle(gen, name: str, input_ids):  # type: ignore[no-untyped-def]
    fixture = next(f for f in gen.FIXTURES if f.name == name)
    model = gen.build_model(fixture)
    batches = gen.calibration_batches()

    def forward_loop(m):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            for batch in batches:
                m(batch)

    gen.mtq.quantize(model, gen.quant_config(fixture), forward_loop)
    result: dict = {}
    original = gen.unified_export_hf._process_quantized_modules

    def at_export(m, *args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            result["logits"], result["tokens"] = _run(m, input_ids)
            result["oracle"] = "fake_quant"
        except (AssertionError, RuntimeError) as error:  # no CPU fake quant for this format
            result["fake_quant_error"] = f"{type(error).__name__}: {error}"
        return original(m, *args, **kwargs)

    gen.unified_export_hf._process_quantized_modules = at_export
    with tempfile.TemporaryDirectory() as tmp:
        try:
            gen.export_hf_checkpoint(model, export_dir=tmp)
        finally:
            gen.unified_export_hf._process_quantized_modules = original
        exported = Path(tmp)
        result["same_checkpoint"] = (exported / "model.safetensors").read_bytes() == (
            FIXTURES / name / "model.safetensors"
        ).read_bytes()
        if "logits" not in result:
            result["logits"], result["tokens"] = _qtensor_model(gen, fixture, exported, input_ids)
            result["oracle"] = "qtensor"
    return result


def main() -> None:
    source, target, *names = sys.argv[1:]
    torch.set_num_threads(1)
    gen = _generator()
    input_ids = torch.load(source)["input_ids"]
    torch.save({name: oracle(gen, name, input_ids) for name in names}, target)


if __name__ == "__main__":
    main()
