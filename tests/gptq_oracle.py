"""GPTQModel and AutoAWQ as oracles: tiny Llama checkpoints packed by their own code, and their own
CPU dequantization of every quantized layer.

Two halves in one file, like the other oracles:

- run as a script under the Python of ``QSCHEME_GPTQ_PYTHON`` (the side venv of
  ``scripts/oracle-venv.sh gptq``: gptqmodel 7.7.0 and autoawq 0.2.9 installed without their
  GPU dependencies)::

      python gptq_oracle.py SPEC.json        # or --check: import what the jobs use

  SPEC holds ``jobs``; each builds a tiny LlamaForCausalLM (``model``: LlamaConfig keywords, float32,
  seeded) and quantizes every Linear of its decoder layers round-to-nearest (the scales and zero
  points are computed here, as a plain RTN quantizer would: the layouts are the libraries'):

  - ``kind: gptq``: GPTQModel's ``TorchLinear.pack`` (its pure-PyTorch path), then for
    ``checkpoint_format: gptq`` GPTQModel's own v2 -> v1 conversion; the config is GPTQModel's
    ``QuantizeConfig(...).to_dict()`` (with ``dynamic`` when given: ``-:`` modules stay float,
    ``+:`` ones take their ``bits``/``group_size``). ``act_order: true`` packs with a permuted
    ``g_idx`` (groups of ``group_size`` columns taken in a seeded random order, as desc_act gives).
  - ``kind: awq``: AutoAWQ's ``WQLinear_GEMM.from_linear``; the config is AutoAWQ's
    ``AwqConfig(...).to_transformers_dict()``.

  It writes ``model.safetensors`` and ``config.json`` (quantization_config) into ``dst``, and
  ``reference.safetensors`` with, per quantized module, ``<module>.dequantized``: the library's own
  dequantization in float32 (GPTQModel's ``dequantize_weight`` after its v1 -> v2 load
  conversion; AutoAWQ's ``dequantize_gemm``), [N, K]. Only torch, transformers, safetensors,
  gptqmodel and awq are imported, never qscheme.

- imported by tests (main venv): ``oracle_python()`` and ``build_checkpoints``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ENV = "QSCHEME_GPTQ_PYTHON"


def oracle_python() -> str:
    """The oracle venv's Python, or skip the calling test (CI always sets it)."""
    import oracle_jobs  # the tests' helper; the oracle side (run as a script in the venv) needs none

    return oracle_jobs.oracle_python(ENV, "gptq")


def build_checkpoints(jobs: Sequence[Mapping[str, Any]], *, python: str | None = None, timeout: float = 600) -> None:
    """Write each job's checkpoint (see the module docstring) in one oracle process."""
    import oracle_jobs

    oracle_jobs.run_jobs(
        __file__,
        jobs,
        python=python or oracle_python(),
        label="GPTQ/AWQ",
        timeout=timeout,
        extra_env={"GPTQMODEL_DISABLE_PACK_EXT": "1"},
    )


# ----------------------------------------------------------------------------- the oracle side


def _import_libraries() -> dict[str, Any]:
    """The libraries' modules the jobs use. Their package ``__init__`` files import the whole
    quantization toolkits (datasets, GPU kernels, ...), which these CPU checks never run: the
    packages are entered without them, and only the modules below are executed as shipped."""
    import importlib.util
    import types

    roots: dict[str, Path] = {}
    for top in ("gptqmodel", "awq"):
        spec = importlib.util.find_spec(top)
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError(f"{top} is not installed in {sys.prefix}")
        roots[top] = Path(next(iter(spec.submodule_search_locations)))

    def enter(package: str) -> None:
        root = roots[package.split(".")[0]]
        module = types.ModuleType(package)
        module.__path__ = [str(root.joinpath(*package.split(".")[1:]))]  # type: ignore[attr-defined]
        module.DEBUG_ON = False  # type: ignore[attr-defined]  # what gptqmodel/__init__ sets from $DEBUG
        sys.modules[package] = module

    for package in ("gptqmodel", "gptqmodel.models", "awq", "awq.models", "awq.modules", "awq.modules.linear"):
        enter(package)
    from awq.models._config import AwqConfig
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.quantization.config import QuantizeConfig
    from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module, convert_gptq_v2_to_v1_format_module

    return {
        "AwqConfig": AwqConfig,
        "WQLinear_GEMM": WQLinear_GEMM,
        "dequantize_gemm": dequantize_gemm,
        "TorchLinear": TorchLinear,
        "QuantizeConfig": QuantizeConfig,
        "v1_to_v2": convert_gptq_v1_to_v2_format_module,
        "v2_to_v1": convert_gptq_v2_to_v1_format_module,
    }


def _rtn(weight: Any, bits: int, group_size: int, sym: bool, g_idx: Any) -> tuple[Any, Any]:
    """Round-to-nearest scales and zero points [N, groups] (GPTQ's min/max quantizer, float16 scales)."""
    import torch

    k = weight.shape[1]
    groups = int(g_idx.max()) + 1
    maxq = 2**bits - 1
    scales, zeros = [], []
    for group in range(groups):
        columns = weight[:, g_idx == group]
        low = columns.amin(dim=1).clamp(max=0)
        high = columns.amax(dim=1).clamp(min=0)
        if sym:
            high = torch.maximum(low.abs(), high)
            scale = (2 * high / maxq).clamp(min=1e-5)
            zero = torch.full_like(scale, (maxq + 1) / 2)
        else:
            scale = ((high - low) / maxq).clamp(min=1e-5)
            zero = torch.round(-low / scale).clamp(0, maxq)
        scales.append(scale.half().float())
        zeros.append(zero)
    del k
    return torch.stack(scales, dim=1), torch.stack(zeros, dim=1)


def _dynamic_for(dynamic: Mapping[str, Any] | None, module: str) -> Mapping[str, Any] | bool | None:
    import re

    for pattern, values in (dynamic or {}).items():
        negative = pattern.startswith("-:")
        text = pattern[2:] if pattern.startswith(("-:", "+:")) else pattern
        if re.match(text, module):
            return False if negative else values
    return None


def _gptq_job(job: Mapping[str, Any], model: Any, libs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    state: dict[str, Any] = {}
    reference: dict[str, Any] = {}
    generator = torch.Generator().manual_seed(int(job.get("seed", 0)) + 1)
    fmt = job.get("checkpoint_format", "gptq")
    for name, module in model.model.layers.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        full = f"model.layers.{name}"
        override = _dynamic_for(job.get("dynamic"), full)
        if override is False:
            continue
        values = {"bits": job["bits"], "group_size": job["group_size"], "sym": job["sym"], **(override or {})}
        bits, group_size, sym = int(values["bits"]), int(values["group_size"]), bool(values["sym"])
        k, n = module.in_features, module.out_features
        size = k if group_size == -1 else group_size
        g_idx = torch.arange(k, dtype=torch.int32) // size
        if job.get("act_order"):
            g_idx = g_idx[torch.randperm(k, generator=generator)]
        scales, zeros = _rtn(module.weight.data, bits, group_size, sym, g_idx)
        layer = libs["TorchLinear"](
            bits=bits,
            group_size=group_size,
            sym=sym,
            desc_act=bool(job.get("act_order")),
            in_features=k,
            out_features=n,
            bias=module.bias is not None,
            pack_dtype=torch.int32,
        )
        layer.pack(module, scales, zeros, g_idx)
        if fmt == "gptq":
            settings = libs["QuantizeConfig"](bits=bits, group_size=group_size, sym=sym, offload_to_disk=False)
            libs["v2_to_v1"](layer, settings)
        for short in ("qweight", "qzeros", "scales", "g_idx"):
            state[f"{full}.{short}"] = getattr(layer, short).clone()  # the load conversion below is in place
        if module.bias is not None:
            state[f"{full}.bias"] = layer.bias.clone()
        # GPTQModel's own load path: v1 checkpoints are converted to v2, then dequantized; float32
        # scales make its product exact (its float16 product is this rounded once)
        if fmt == "gptq":
            libs["v1_to_v2"](layer, bits, torch.int32)
        layer.scales = layer.scales.float()
        layer.post_init()
        reference[f"{full}.dequantized"] = layer.dequantize_weight().T.contiguous().float()
    config = libs["QuantizeConfig"](
        bits=job["bits"],
        group_size=job["group_size"],
        sym=job["sym"],
        desc_act=bool(job.get("act_order")),
        format=fmt,
        dynamic=job.get("dynamic"),
        offload_to_disk=False,  # a run-time setting (a temporary folder), not part of the format
    ).to_dict()
    config.pop("meta", None)  # run-time settings of the quantizer (temporary paths), not the format
    return state, {"quantization_config": json.loads(json.dumps(config, default=str)), "reference": reference}


def _awq_job(job: Mapping[str, Any], model: Any, libs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    state: dict[str, Any] = {}
    reference: dict[str, Any] = {}
    bits, group_size = int(job["bits"]), int(job["group_size"])
    for name, module in model.model.layers.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        full = f"model.layers.{name}"
        g_idx = torch.arange(module.in_features) // group_size
        scales, zeros = _rtn(module.weight.data, bits, group_size, False, g_idx)
        layer = libs["WQLinear_GEMM"].from_linear(
            module, bits, group_size, scales=scales.T.contiguous(), zeros=zeros.T.contiguous().to(torch.int32)
        )
        for short in ("qweight", "qzeros", "scales"):
            state[f"{full}.{short}"] = getattr(layer, short).clone()  # the load conversion below is in place
        if module.bias is not None:
            state[f"{full}.bias"] = layer.bias.clone()
        dequantized = libs["dequantize_gemm"](layer.qweight, layer.qzeros, layer.scales.float(), bits, group_size)
        reference[f"{full}.dequantized"] = dequantized.T.contiguous().float()
    config = libs["AwqConfig"](q_group_size=group_size, w_bit=bits, zero_point=True, version="GEMM")
    return state, {"quantization_config": config.to_transformers_dict(), "reference": reference}


def _run_job(job: Mapping[str, Any], libs: Mapping[str, Any]) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(int(job.get("seed", 0)))
    config = LlamaConfig(**job["model"])
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config).eval()
    make = _gptq_job if job["kind"] == "gptq" else _awq_job
    quantized, extra = make(job, model, libs)
    quantized_modules = {name.rpartition(".")[0] for name in quantized}
    state = {
        name: value.contiguous()
        for name, value in model.state_dict().items()
        if name.rpartition(".")[0] not in quantized_modules
    }
    state.update(quantized)
    dst = Path(job["dst"])
    dst.mkdir(parents=True, exist_ok=True)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(extra["reference"], str(dst / "reference.safetensors"))
    document = config.to_dict()
    document["quantization_config"] = extra["quantization_config"]
    (dst / "config.json").write_text(json.dumps(document, indent=2, default=str))


def main(argv: Sequence[str]) -> None:
    libs = _import_libraries()
    if argv[1:] == ["--check"]:  # the venv's check (scripts/oracle-venv.sh): AutoRound's oracle too
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import auto_round_oracle

        auto_round_oracle.import_libraries()
        return
    spec = json.loads(Path(argv[1]).read_text())
    for job in spec["jobs"]:
        _run_job(job, libs)


if __name__ == "__main__":
    main(sys.argv)
