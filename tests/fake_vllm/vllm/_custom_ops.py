"""Recording stand-ins for vLLM 0.33's Marlin op wrappers (signatures as in vLLM 0.33.0).

Each checks its arguments the way vLLM 0.33's compiled ops do (shapes, dtypes, which optional
tensors a scalar type needs, tile multiples), raising ValueError where the real op would
refuse, so the stub tests prove the calls would be accepted, not only that they were made.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.scalar_type import ScalarType

# What torch.ops._C holds in this build; a test empties it to simulate a CPU build.
COMPILED: set[str] = {"gptq_marlin_repack", "marlin_gemm"}
# (op name, keyword arguments) of every call, in order.
CALLS: list[tuple[str, dict[str, Any]]] = []


def gptq_marlin_repack(
    b_q_weight: torch.Tensor, size_k: int, size_n: int, num_bits: int, is_a_8bit: bool = False
) -> torch.Tensor:
    CALLS.append(
        (
            "gptq_marlin_repack",
            {
                "b_q_weight": b_q_weight,
                "size_k": size_k,
                "size_n": size_n,
                "num_bits": num_bits,
                "is_a_8bit": is_a_8bit,
            },
        )
    )
    pack_factor = 32 // num_bits
    _require(b_q_weight.dtype == torch.int32 and b_q_weight.is_contiguous(), "repack input must be contiguous int32")
    _require(
        tuple(b_q_weight.shape) == (size_k // pack_factor, size_n),
        f"repack input is {tuple(b_q_weight.shape)}, not (size_k / {pack_factor}, size_n) = "
        f"({size_k // pack_factor}, {size_n})",
    )
    _require(_on_tiles(size_n, size_k), f"size_n={size_n}, size_k={size_k} are not on Marlin's tiles")
    return torch.zeros((size_k // 16, size_n * 16 // pack_factor), dtype=b_q_weight.dtype, device=b_q_weight.device)


def marlin_gemm(
    a: torch.Tensor,
    c: torch.Tensor | None,
    b_q_weight: torch.Tensor,
    b_bias: torch.Tensor | None,
    b_scales: torch.Tensor,
    a_scales: torch.Tensor | None,
    global_scale: torch.Tensor | None,
    b_zeros: torch.Tensor | None,
    workspace: torch.Tensor,
    b_q_type: ScalarType,
    size_m: int,
    size_n: int,
    size_k: int,
    use_atomic_add: bool = False,
    use_fp32_reduce: bool = False,
    is_zp_float: bool = False,
) -> torch.Tensor:
    arguments = dict(locals())
    CALLS.append(("marlin_gemm", arguments))
    _check_gemm(arguments)
    dtype = a.dtype if a.dtype in (torch.float16, torch.bfloat16) else b_scales.dtype
    # a recognisable output: row i, column j holds i + j / 1024 (checks the kernel's slicing)
    rows = torch.arange(size_m, dtype=torch.float32).unsqueeze(1)
    columns = torch.arange(size_n, dtype=torch.float32).unsqueeze(0) / 1024
    return (rows + columns).to(dtype=dtype, device=a.device)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _on_tiles(size_n: int, size_k: int) -> bool:
    return (size_n % 64 == 0 and size_k % 128 == 0) or (size_n % 128 == 0 and size_k % 64 == 0)


def _check_gemm(args: dict[str, Any]) -> None:
    """What vLLM 0.33's marlin_gemm checks before it runs (marlin.cu), as far as a stub can."""
    a, weight, scales, kind = args["a"], args["b_q_weight"], args["b_scales"], args["b_q_type"]
    size_m, size_n, size_k = args["size_m"], args["size_n"], args["size_k"]
    _require(a.dtype in (torch.bfloat16, torch.float16), f"a must be bf16 or fp16, not {a.dtype}")
    _require(tuple(a.shape) == (size_m, size_k), f"a is {tuple(a.shape)}, not (size_m, size_k)")
    _require(a.stride(-1) == 1 and a.stride(0) % 8 == 0, "a's rows must be contiguous with a stride multiple of 8")
    _require(_on_tiles(size_n, size_k), f"size_n={size_n}, size_k={size_k} are not on Marlin's tiles")
    pack = 32 // kind.size_bits
    _require(
        weight.dtype == torch.int32 and tuple(weight.shape) == (size_k // 16, size_n * 16 // pack),
        f"b_q_weight is {weight.dtype} {tuple(weight.shape)}, not int32 ({size_k // 16}, {size_n * 16 // pack})",
    )
    _require(
        scales.ndim == 2 and scales.shape[1] == size_n, f"b_scales is {tuple(scales.shape)}, not [groups, {size_n}]"
    )
    groups = scales.shape[0]
    _require(size_k % groups == 0, f"size_k={size_k} is not a multiple of {groups} scale groups")
    fp4 = kind.name == "float4_e2m1f"
    if fp4:
        _require(
            scales.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu),
            f"FP4 scales must be e4m3 or e8m0, not {scales.dtype}",
        )
    else:
        _require(scales.dtype == a.dtype, f"scales must be in the activation dtype {a.dtype}, not {scales.dtype}")
    nvfp4 = fp4 and scales.dtype == torch.float8_e4m3fn
    global_scale = args["global_scale"]
    _require((global_scale is not None) == nvfp4, "a global scale is required for NVFP4 weights and only for them")
    if global_scale is not None:
        _require(global_scale.dtype == torch.float32, f"global_scale must be float32, not {global_scale.dtype}")
    zeros = args["b_zeros"]
    if zeros is not None:
        _require(kind.name in ("uint4", "uint8"), f"zero points need a uint4 or uint8 type, not {kind.name}")
        _require(
            zeros.dtype == torch.int32 and tuple(zeros.shape) == (groups, size_n // pack),
            f"b_zeros is {zeros.dtype} {tuple(zeros.shape)}, not int32 ({groups}, {size_n // pack})",
        )
    else:
        _require(kind.name != "uint4", "the uint4 type needs zero points")
    bias = args["b_bias"]
    if bias is not None:
        _require(tuple(bias.shape) == (size_n,) and bias.dtype == a.dtype, "b_bias must be [size_n] in a's dtype")
    workspace = args["workspace"]
    _require(workspace.dtype == torch.int32 and workspace.numel() >= 1, "workspace must be int32 lock counters")
