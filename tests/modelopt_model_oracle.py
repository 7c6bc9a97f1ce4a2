"""Run under a Python that has nvidia-modelopt: a fixture's whole model as ModelOpt computes it.

    python modelopt_model_oracle.py IN.pt OUT.pt FIXTURE [FIXTURE ...]

ModelOpt's model is made to hold **the committed fixture's tensors**; nothing the fixture holds
is recomputed. Rebuilding a fixture from its seed is not machine independent: torch's ``normal_``
draws other numbers without AVX2 (so the initial weights differ), calibration sums float32
activations, and AWQ's scale search compares float32 losses, so its scales move by an ulp from
one CPU to another (2.4e-7 on an AVX-512 Xeon). The oracle therefore only borrows ModelOpt's
*structure* from a quantize run and replaces every number with the fixture's:

- **fake_quant** (FP8, int4 AWQ: ModelOpt's fake quantization runs on CPU). The model is built
  and quantized as tests/fixtures/modelopt/generate.py does (same config and algorithm, so the
  same quantizers, the same ``pre_quant_scale`` inputs and the same norms carrying AWQ's folded
  scales). Inside ``export_hf_checkpoint``, right before ModelOpt packs the weights, every
  parameter is replaced by the fixture's (quantized weights by their exact dequantization,
  ``code * weight_scale``), each quantizer's ``amax`` by the float32 value whose ``amax / bound``
  is the stored scale, and ``pre_quant_scale`` by the stored one. The fake-quantized model then
  runs on IN.pt's ``input_ids`` (logits and greedy ``generate()`` tokens), and the export goes on.
  Its packing rounds given weights with given scales (elementwise, no reduction), so the
  re-export must equal the fixture byte for byte on any CPU: ``reexport_differs`` lists the
  tensors that do not.
- **qtensor** (the NVFP4 family: ModelOpt's fake quantization asserts CUDA). The float model
  loaded from the fixture with every quantized weight replaced by ModelOpt's own dequantization
  (``NVFP4QTensor.dequantize``) and activations, where the scheme quantizes them, quantized and
  dequantized with ModelOpt's ``NVFP4QTensor`` at the fixture's input_scale. No export is run.

OUT.pt, per fixture: {"logits", "tokens", "oracle": "fake_quant" | "qtensor",
"loaded": [the fixture tensors loaded into the model], "weight_ulps": largest distance, in
float32 ulps, between ModelOpt's fake-quantized weight and the fixture's dequantized weight
(fake_quant only), "reexport_differs": [tensor names] (fake_quant only)}.
Only torch, transformers, safetensors and modelopt are imported, never qscheme.
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


def _split(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """The fixture's plain tensors, and its quantized modules' tensors by module."""
    plain: dict[str, torch.Tensor] = {}
    quantized: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        module, _, tensor = key.rpartition(".")
        if f"{module}.weight_scale" in state:
            quantized.setdefault(module, {})[tensor] = value
        else:
            plain[key] = value
    return plain, quantized


def _load_plain(model, plain: dict[str, torch.Tensor], quantized: set[str]) -> None:  # type: ignore[no-untyped-def]
    """The fixture's plain tensors go in; left out are only the quantized modules' weights (loaded
    next), the quantizers' own state (set next) and rotary buffers (computed, never stored)."""
    missing, unexpected = model.load_state_dict(plain, strict=False)
    left = [
        key
        for key in missing
        if "rotary" not in key and "_quantizer." not in key and key.rpartition(".")[0] not in quantized
    ]
    assert not unexpected and not left, (unexpected, left)


def _dequantized_int4(gen, tensors: dict[str, torch.Tensor], group: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return gen.unpack_modelopt_int4(tensors["weight"], tensors["weight_scale"], group)


def _amax_for(scale: torch.Tensor, bound: float) -> torch.Tensor:
    """The float32 amax with ``amax / bound == scale`` bit for bit (the stored scale came from one)."""
    scale = scale.float()
    guess = (scale.double() * bound).float()
    chosen = guess.clone()
    found = guess / bound == scale
    up, down = guess.clone(), guess.clone()
    for _ in range(4):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.zeros_like(down))
        for candidate in (up, down):
            hit = ~found & (candidate / bound == scale)
            chosen = torch.where(hit, candidate, chosen)
            found |= hit
    assert bool(found.all()), f"no float32 amax gives scale {scale[~found][:4].tolist()} with bound {bound}"
    return chosen


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.float().contiguous().view(torch.int32).to(torch.int64)
        return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)

    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def _same_bytes(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def _load_quantized(gen, model, quantized, algo: str, group) -> int:  # type: ignore[no-untyped-def]
    """Put the fixture's weights, scales and pre_quant_scales into ModelOpt's quantized modules.

    Returns the largest ulp distance between ModelOpt's fake-quantized weight and the fixture's.
    """
    worst = 0
    for name, tensors in quantized.items():
        module = model.get_submodule(name)
        wq, iq = module.weight_quantizer, module.input_quantizer
        if algo == "W4A16_AWQ":
            weight = _dequantized_int4(gen, tensors, group)
        else:
            weight = gen.dequantize(algo, group, tensors)
        assert weight is not None and weight.shape == module.weight.shape, name
        module.weight.data.copy_(weight.to(module.weight.dtype))
        wq.amax = _amax_for(tensors["weight_scale"], wq.maxbound).reshape(wq.amax.shape)
        if "input_scale" in tensors:
            assert iq.is_enabled, f"{name}: the fixture has an input_scale, ModelOpt's model no input quantizer"
            iq.amax = _amax_for(tensors["input_scale"], iq.maxbound).reshape(iq.amax.shape)
        else:
            assert not iq.is_enabled or iq.amax is None, f"{name}: ModelOpt quantizes the input, no input_scale"
        ours = iq.pre_quant_scale
        if "pre_quant_scale" in tensors:
            assert ours is not None, f"{name}: the fixture has a pre_quant_scale, ModelOpt's model none"
            iq.pre_quant_scale = tensors["pre_quant_scale"]
        else:
            assert ours is None, f"{name}: ModelOpt's model has a pre_quant_scale, the fixture none"
        with torch.no_grad():
            worst = max(worst, _ulps(wq(module.weight), weight))
    return worst


def _qtensor_model(gen, fixture, state, quant, input_ids):  # type: ignore[no-untyped-def]
    """The fixture's model in float, with ModelOpt's own dequantized weights (and NVFP4 input quantization)."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    algo, group = quant["quant_algo"], quant["group_size"]
    model = gen.build_model(fixture)
    plain, quantized = _split(state)
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


def _fake_quant_model(gen, fixture, state, quant, input_ids) -> dict:  # type: ignore[no-untyped-def]
    """ModelOpt's fake-quantized model holding the fixture's tensors; and its re-export of them."""
    model = gen.build_model(fixture)
    batches = gen.calibration_batches()

    def forward_loop(m):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            for batch in batches:
                m(batch)

    # the quantize run gives ModelOpt's structure; every number it computes is replaced below
    gen.mtq.quantize(model, gen.quant_config(fixture), forward_loop)
    plain, quantized = _split(state)
    result: dict = {}
    original = gen.unified_export_hf._process_quantized_modules

    def at_export(m, *args, **kwargs):  # type: ignore[no-untyped-def]
        _load_plain(m, plain, set(quantized))
        result["weight_ulps"] = _load_quantized(gen, m, quantized, quant["quant_algo"], quant.get("group_size"))
        result["logits"], result["tokens"] = _run(m, input_ids)
        return original(m, *args, **kwargs)

    gen.unified_export_hf._process_quantized_modules = at_export
    with tempfile.TemporaryDirectory() as tmp:
        try:
            gen.export_hf_checkpoint(model, export_dir=tmp)
        finally:
            gen.unified_export_hf._process_quantized_modules = original
        exported = gen.read_safetensors(Path(tmp) / "model.safetensors")
    result["reexport_differs"] = sorted(
        name for name in set(exported) | set(state) if not _same_bytes(exported.get(name), state.get(name))
    )
    result["oracle"] = "fake_quant"
    return result


def oracle(gen, name: str, input_ids) -> dict:  # type: ignore[no-untyped-def]
    fixture = next(f for f in gen.FIXTURES if f.name == name)
    state = gen.read_safetensors(FIXTURES / name / "model.safetensors")
    quant = gen.json.loads((FIXTURES / name / "hf_quant_config.json").read_text())["quantization"]
    if quant["quant_algo"] in ("FP8", "W4A16_AWQ"):
        result = _fake_quant_model(gen, fixture, state, quant, input_ids)
    else:
        result = {"oracle": "qtensor"}
        result["logits"], result["tokens"] = _qtensor_model(gen, fixture, state, quant, input_ids)
    result["loaded"] = sorted(state)
    return result


def main() -> None:
    source, target, *names = sys.argv[1:]
    torch.set_num_threads(1)
    gen = _generator()
    input_ids = torch.load(source)["input_ids"]
    torch.save({name: oracle(gen, name, input_ids) for name in names}, target)


if __name__ == "__main__":
    main()
