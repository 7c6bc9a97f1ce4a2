"""The problem a kernel is asked to solve: one linear layer's shape and inputs, as plain data."""

from __future__ import annotations

from dataclasses import dataclass, field

from qscheme.errors import UsageError

ACTIVATION_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")
DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "torch.bfloat16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
    "torch.float16": "float16",
    "fp32": "float32",
    "float": "float32",
    "float32": "float32",
    "torch.float32": "float32",
}


def normalize_dtype(name: object) -> str:
    """``bf16`` / ``torch.bfloat16`` / ``"bfloat16"`` -> ``"bfloat16"``; UsageError for anything else."""
    key = str(name).lower()
    if key not in DTYPE_ALIASES:
        allowed = ", ".join(sorted({"bf16", "fp16", "fp32", *ACTIVATION_DTYPES}))
        raise UsageError(
            f"activation dtype {name!r} is not supported; use one of {allowed} "
            "(the kernels take 16- or 32-bit float activations)"
        )
    return DTYPE_ALIASES[key]


@dataclass(frozen=True)
class Problem:
    """A linear layer y = x @ W^T with W of shape [n, k] (N output, K input features).

    ``partitions`` counts the fused checkpoint modules that form the layer (3 for q/k/v -> qkv)
    and ``partition_scales_differ`` says whether their global (or per-tensor) scales differ, so
    that only kernels taking one scale per partition can run it exactly. ``input_pre_scale`` is
    None when unknown (then the scheme decides: a declared, non-optional pre-scale is present).
    ``input_permutation``: the canonical weight holds the input channels permuted (GPTQ act-order),
    known once the layer's group index is read.
    ``layer`` only names the layer in messages: it takes no part in comparisons.
    ``weight_format``: the scheme's weight format (``"blocks"`` for packed blocks), which the
    resolver fills in from the scheme for batch ranges declared per format (``BatchRange.when``);
    it takes no part in comparisons either (the scheme is compared apart). ``weight_bits``: for
    packed blocks, the bits a weight takes in them (a block's bytes over its weights: GGUF Q6_K
    6.5625), filled in the same way for batch ranges declared per block width (``WeightBits``).
    """

    n: int
    k: int
    activation_dtype: str = "bfloat16"
    partitions: int = 1
    partition_scales_differ: bool = False
    input_pre_scale: bool | None = None
    layer: str | None = field(default=None, compare=False)
    input_permutation: bool = False
    weight_format: str | None = field(default=None, compare=False)
    weight_bits: float | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("n", "k", "partitions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise UsageError(f"Problem.{name} must be an int, not {value!r} ({type(value).__name__})")
        if self.n < 1 or self.k < 1:
            raise UsageError(f"a layer needs N >= 1 and K >= 1, not N={self.n}, K={self.k}")
        if self.partitions < 1:
            raise UsageError(f"partitions must be >= 1, not {self.partitions}")
        if self.activation_dtype not in ACTIVATION_DTYPES:
            object.__setattr__(self, "activation_dtype", normalize_dtype(self.activation_dtype))
        if self.weight_format is not None and not isinstance(self.weight_format, str):
            raise UsageError(f"Problem.weight_format must be a str or None, not {self.weight_format!r}")
        bits = self.weight_bits
        if bits is not None and (isinstance(bits, bool) or not isinstance(bits, (int, float)) or not bits > 0):
            raise UsageError(f"Problem.weight_bits must be a positive number or None, not {bits!r}")

    def describe(self) -> str:
        """``N=4096, K=11008, bfloat16 activations`` (+ fused partitions, + layer name)."""
        text = f"N={self.n}, K={self.k}, {self.activation_dtype} activations"
        if self.partitions > 1:
            differ = "different" if self.partition_scales_differ else "equal"
            text += f", {self.partitions} fused partitions with {differ} scales"
        if self.input_pre_scale:
            text += ", input pre-scale"
        if self.input_permutation:
            text += ", input channels permuted (act-order)"
        if self.layer:
            text = f"layer {self.layer}: {text}"
        return text

    def as_json(self) -> dict[str, object]:
        return {
            "layer": self.layer,
            "n": self.n,
            "k": self.k,
            "activation_dtype": self.activation_dtype,
            "partitions": self.partitions,
            "partition_scales_differ": self.partition_scales_differ,
            "input_pre_scale": self.input_pre_scale,
            **({"input_permutation": True} if self.input_permutation else {}),
        }
