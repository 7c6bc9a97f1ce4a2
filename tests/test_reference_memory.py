"""The reference kernel keeps no dequantized copy of a weight: resident memory after forwards,
measured in a fresh process, and the chunking and opt-in cache it relies on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from qscheme_plugins.reference_kernel import CACHE_VARIABLE, CHUNK_BYTES, ReferenceKernel, cache_requested, chunk_rows

from qscheme.canonical import dequantize
from qscheme.catalog import load_scheme
from qscheme.errors import UsageError
from qscheme.kernels.interface import KernelExecutionError
from qscheme.modules import QuantLinear
from qscheme.triton.samples import random_weight

MIB = 1 << 20

# Builds a stack of random layers on the reference kernel, runs a small layer once (so that
# libraries and thread pools are loaded), gives freed heap memory back (the baseline then holds
# no reusable free memory that would hide growth), then runs the stack several times and prints
# the resident growth. Linux only (/proc, glibc).
MEASURE = """
import ctypes, json, sys
import psutil, torch
from qscheme.catalog import load_scheme
from qscheme.modules import QuantLinear
from qscheme.triton.samples import random_weight

scheme_name, n, k, layers, dtype_name = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
dtype = getattr(torch, dtype_name)
scheme = load_scheme(scheme_name)
def layer(n, k, seed):
    weight = random_weight(scheme, n, k, seed=seed)
    return QuantLinear.from_canonical(weight, kernel="reference", activation_dtype=dtype)
model = torch.nn.Sequential(layer(n, k, 0), *[layer(n, n, seed) for seed in range(1, layers)])
with torch.no_grad():
    layer(64, k, 99)(torch.randn(2, k, dtype=dtype))
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = psutil.Process().memory_info().rss
    for _ in range(4):
        y = model(torch.randn(3, k, dtype=dtype) * 0.01)
    after = psutil.Process().memory_info().rss
print(json.dumps({"growth": after - before, "kernel": model[0].kernel.name, "finite": bool(y.isfinite().all())}))
"""


# glibc's malloc with a fixed mmap threshold: blocks of 128 KiB and more are mapped and unmapped
# on free, so the RSS growth is what stays allocated. By default the threshold rises to the
# largest block freed so far, and freed chunks stay in the heap for reuse: a few tens of MiB,
# however many layers the model has (docs/benchmarks.md, from_pretrained memory).
RETURN_FREED = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def resident_growth(scheme: str, n: int, k: int, layers: int, dtype: str, environ: dict[str, str]) -> int:
    env = {key: value for key, value in os.environ.items() if key not in (CACHE_VARIABLE, *RETURN_FREED)}
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, scheme, str(n), str(k), str(layers), dtype],
        capture_output=True,
        text=True,
        env=env | environ,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["kernel"] == "reference" and result["finite"]
    return int(result["growth"])


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures RSS with glibc's malloc_trim")


@linux_only
@pytest.mark.parametrize(
    ("scheme", "dtype"),
    [("compressed-tensors/NVFP4A16", "bfloat16"), ("compressed-tensors/FP8_DYNAMIC", "float32")],
)
@pytest.mark.subprocess
def test_forwards_grow_resident_memory_by_at_most_one_activation_copy_of_the_largest_layer(
    scheme: str, dtype: str
) -> None:
    n = k = 4096
    layers = 4
    copy = n * k * getattr(torch, dtype).itemsize  # one activation-dtype copy of the largest layer
    # A float32 copy per layer (what the kernel kept before) would be layers * n * k * 4 bytes.
    growth = resident_growth(scheme, n, k, layers, dtype, RETURN_FREED)
    assert growth <= copy, f"forwards kept {growth / MIB:.1f} MiB allocated; allowed {copy / MIB:.0f} MiB"
    # With malloc's defaults, freed chunks it keeps for reuse come on top, but not per layer.
    growth = resident_growth(scheme, n, k, layers, dtype, {})
    assert growth <= 2 * copy, f"forwards grew RSS by {growth / MIB:.1f} MiB; allowed {2 * copy / MIB:.0f} MiB"


@linux_only
@pytest.mark.subprocess
def test_the_opt_in_cache_keeps_one_activation_copy_per_layer_and_the_measure_sees_it() -> None:
    n = k = 2048
    layers = 4
    copy = n * k * 2
    growth = resident_growth(
        "compressed-tensors/NVFP4A16", n, k, layers, "bfloat16", {CACHE_VARIABLE: "1", **RETURN_FREED}
    )
    assert layers * copy * 0.95 <= growth <= (layers + 1) * copy, f"cache grew RSS by {growth / MIB:.1f} MiB"


def test_a_chunk_stays_within_half_an_activation_copy_of_its_layer_and_the_chunk_budget() -> None:
    for n, k, activation_bytes, tile_rows in [
        (4096, 4096, 2, 1),
        (4096, 4096, 4, 128),
        (151936, 2048, 2, 1),
        (96, 64, 2, 1),
        (7, 3, 2, 128),
        (1, 1, 2, 1),
    ]:
        rows = chunk_rows(n, k, activation_bytes, tile_rows)
        assert rows >= 1
        if rows > 1:
            assert rows * k * 4 <= min(CHUNK_BYTES, n * k * activation_bytes // 2)
        if rows >= tile_rows:
            assert rows % tile_rows == 0


@pytest.mark.parametrize(
    "scheme_name", ["compressed-tensors/NVFP4A16", "modelopt/fp8_pb_wo", "compressed-tensors/W4A16_ASYM"]
)
def test_chunked_forwards_equal_one_float32_product_of_the_whole_dequantized_weight(
    scheme_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import qscheme_plugins.reference_kernel as reference_kernel

    # chunks of 37 rows: not aligned to fp8_pb_wo's 128-row blocks, the last one partial
    monkeypatch.setattr(reference_kernel, "CHUNK_BYTES", 37 * 256 * 4)
    assert chunk_rows(300, 256, 4) == 37
    weight = random_weight(load_scheme(scheme_name), 300, 256, seed=3)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    kernel = ReferenceKernel()
    state = kernel.prepare(weight, torch.device("cpu"))
    assert state.cache is None
    whole = dequantize(weight)
    # the same float32 products, summed in another order per chunk: within 2K float32 roundings of
    # sum |x w| (a fixed relative tolerance fails where an output cancels to near zero)
    bound = 2 * 256 * 2.0**-24 * (x.double().abs() @ whole.double().abs().t())
    assert bool(((kernel.apply(state, x, None).double() - (x @ whole.t()).double()).abs() <= bound).all())


def test_the_cache_multiplies_the_weight_rounded_to_the_input_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    scheme = load_scheme("modelopt/NVFP4")
    weight = random_weight(scheme, 64, 128, seed=1)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    plain = ReferenceKernel().apply(ReferenceKernel().prepare(weight, torch.device("cpu")), x, None)
    monkeypatch.setenv(CACHE_VARIABLE, "1")
    kernel = ReferenceKernel()
    state = kernel.prepare(weight, torch.device("cpu"))
    cached = kernel.apply(state, x, None)
    assert state.cache is not None and list(state.cache) == [torch.bfloat16]
    assert torch.equal(state.cache[torch.bfloat16], dequantize(weight).to(torch.bfloat16))
    torch.testing.assert_close(cached, plain, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("value", ["2", "cache", "bf16", "1,"])
def test_a_bad_cache_variable_is_a_usage_error_naming_it(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match=rf"{CACHE_VARIABLE}={value!r} is not understood; allowed: 1, .* \(on\)"):
        cache_requested({CACHE_VARIABLE: value})
    monkeypatch.setenv(CACHE_VARIABLE, value)
    weight = random_weight(load_scheme("compressed-tensors/W4A16"), 8, 128)
    layer = QuantLinear.from_canonical(weight, kernel="reference", layer_name="model.fc")
    with pytest.raises(KernelExecutionError, match=rf"model\.fc.*{CACHE_VARIABLE}") as raised:
        layer(torch.randn(2, 128, dtype=torch.bfloat16))
    assert isinstance(raised.value, UsageError)


def test_an_unset_or_off_cache_variable_asks_for_no_cache() -> None:
    assert cache_requested({}) is False
    for off in ("0", "", "off", "no"):
        assert cache_requested({CACHE_VARIABLE: off}) is False
    for on in ("1", "true", " On "):
        assert cache_requested({CACHE_VARIABLE: on}) is True


@pytest.mark.parametrize("scheme_name", ["compressed-tensors/W4A16", "compressed-tensors/FP8_DYNAMIC"])
def test_forwards_and_dequantize_run_under_inference_mode_on_several_threads(scheme_name: str) -> None:
    # the slab workers write into tensors made under the caller's inference mode
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        weight = random_weight(load_scheme(scheme_name), 1024, 512)
        layer = QuantLinear.from_canonical(weight, kernel="reference")
        x = torch.randn(3, 512, dtype=torch.bfloat16)
        expected = layer(x)
        with torch.inference_mode():
            assert torch.equal(layer(x), expected)
            assert torch.equal(dequantize(weight), layer.dequantize())
    finally:
        torch.set_num_threads(threads)
