"""Package discovery for the wheel; everything else is in pyproject.toml.

Three folders of the tree are installed under other names (``plugins/`` as ``qscheme_plugins``,
``schemes/`` as ``qscheme_schemes``), which ``[tool.setuptools.packages.find]`` cannot express, so
the packages are found here from the tree: every package under each root, and the scheme folders
(YAML data, shipped through pyproject.toml's package-data) under ``schemes/``. No list to keep by hand.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from types import MethodType
from typing import Any

from setuptools import Extension, find_namespace_packages, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOTS = {"qscheme": "qscheme", "qscheme_plugins": "plugins", "qscheme_schemes": "schemes"}
DATA_ROOTS = {"qscheme_schemes"}  # folders of descriptors: namespace packages, no __init__.py


def packages() -> list[str]:
    """Every package of every root, named as installed (``plugins.x`` -> ``qscheme_plugins.x``)."""
    found: list[str] = []
    for name, folder in ROOTS.items():
        if name in DATA_ROOTS:
            children = find_namespace_packages(folder, exclude=["*__pycache__*"])
            children = [c for c in children if all(part.isidentifier() for part in c.split("."))]
        else:
            children = find_packages(folder)
        found += [name, *(f"{name}.{child}" for child in sorted(children))]
    return found


def openmp_flags() -> list[str]:
    """``-fopenmp`` where the C++ compiler builds and links an OpenMP program, else nothing.

    With it the compiled kernels run on torch's own OpenMP threads (qscheme/csrc/thread_pool.h);
    without it, on a pool of their own (slower beside torch's operators, still correct).
    """
    compiler = (sysconfig.get_config_var("CXX") or "c++").split()[0]
    if not shutil.which(compiler) or os.environ.get("QSCHEME_NO_OPENMP") == "1":
        return []
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "probe.cpp")
        with open(source, "w", encoding="utf-8") as handle:
            handle.write("#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n")
        command = [compiler, "-fopenmp", source, "-o", os.path.join(folder, "probe")]
        try:
            done = subprocess.run(command, capture_output=True, check=False, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            return []
    if done.returncode != 0:
        print("qscheme: the C++ compiler has no OpenMP; the CPU kernels use their own threads", file=sys.stderr)
        return []
    return ["-fopenmp"]


OPENMP = openmp_flags()

# The per-weight loop of decoding packed blocks (qscheme.formats.blocks), in plain C with no torch
# headers: built by any C compiler, and optional (without a compiler the install still succeeds and
# the torch decoder, bit-identical and slower, is used). -ffp-contract=off: no fused multiply-add,
# so each float32 operation rounds once, as the torch decoder's.
BLOCKS_EXTENSION = Extension(
    "qscheme._blocks",
    sources=["qscheme/csrc/blocks.c"],
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math"],
    optional=True,
)

# The CPU GEMV over canonical quantized weights (qscheme.cpu_gemv), in C++17 with no torch headers
# either: optional in the same way (without it the CPU layers run on the other kernels). Each ISA's
# loops are compiled by a target pragma in their own file and chosen at run time by cpuid.
CPU_GEMV_EXTENSION = Extension(
    "qscheme._cpu_gemv",
    sources=[
        "qscheme/csrc/cpu_gemv.cpp",
        "qscheme/csrc/cpu_gemv_avx512.cpp",
        "qscheme/csrc/cpu_gemv_avx2.cpp",
        "qscheme/csrc/cpu_gemv_amx.cpp",
        "qscheme/csrc/cpu_gemv_int16.cpp",
        "qscheme/csrc/cpu_gemv_bf16dot.cpp",
        "qscheme/csrc/cpu_gemv_gguf.cpp",
        "qscheme/csrc/cpu_gemv_gguf_avx512.cpp",
        "qscheme/csrc/cpu_gemv_gguf_avx2.cpp",
        "qscheme/csrc/cpu_gemv_gguf_bf16.cpp",
        "qscheme/csrc/cpu_gemv_gguf_dequant.cpp",
        "qscheme/csrc/cpu_gemv_gguf_gemm.cpp",
        "qscheme/csrc/cpu_gemv_gguf_bytes.cpp",
        "qscheme/csrc/amx_panel.cpp",  # the panels' AMX multiply, also in qscheme._tile_gemm
        "qscheme/csrc/act_quant.cpp",
        "qscheme/csrc/act_quant_avx512.cpp",
    ],
    depends=[
        "qscheme/csrc/cpu_gemv.h",
        "qscheme/csrc/cpu_gemv_kernel.h",
        "qscheme/csrc/cpu_gemv_dot_kernel.h",
        "qscheme/csrc/cpu_gemv_amx.h",
        "qscheme/csrc/cpu_gemv_gguf.h",
        "qscheme/csrc/cpu_gemv_gguf_kernel.h",
        "qscheme/csrc/cpu_gemv_gguf_v512.h",
        "qscheme/csrc/tile_gemm_bf16_kernel.h",
        "qscheme/csrc/amx_panel.h",
        "qscheme/csrc/amx_config.h",
        "qscheme/csrc/act_quant.h",
        "qscheme/csrc/byte_scales.h",
        "qscheme/csrc/thread_pool.h",
        "qscheme/csrc/bf16_words.h",
        "qscheme/csrc/row_streams.h",
    ],
    language="c++",
    extra_compile_args=["-O3", "-std=c++17", "-fno-fast-math", "-pthread", *OPENMP],
    extra_link_args=["-pthread", *OPENMP],
    optional=True,
)

# The dequant_gemm kernel's bfloat16 tile decoder and fused tile GEMM on AMX or AVX-512 BF16 (qscheme.tile_gemm), C++17
# with no torch headers, optional in the same way (without it dequant_gemm decodes through torch).
TILE_GEMM_EXTENSION = Extension(
    "qscheme._tile_gemm",
    sources=[
        "qscheme/csrc/tile_gemm.cpp",
        "qscheme/csrc/tile_gemm_amx.cpp",
        "qscheme/csrc/tile_gemm_bf16.cpp",
        "qscheme/csrc/amx_panel.cpp",  # the panels' AMX multiply, also in qscheme._cpu_gemv
        "qscheme/csrc/act_quant.cpp",  # the input's pass (qscheme.emulation.prepare_input), also in qscheme._cpu_gemv
        "qscheme/csrc/act_quant_avx512.cpp",
    ],
    depends=[
        "qscheme/csrc/tile_gemm.h",
        "qscheme/csrc/amx_panel.h",
        "qscheme/csrc/amx_config.h",
        "qscheme/csrc/act_quant.h",
        "qscheme/csrc/tile_gemm_bf16_kernel.h",
        "qscheme/csrc/byte_scales.h",
        "qscheme/csrc/thread_pool.h",
    ],
    language="c++",
    extra_compile_args=["-O3", "-std=c++17", "-fno-fast-math", "-pthread", *OPENMP],
    extra_link_args=["-pthread", *OPENMP],
    optional=True,
)

# The cpu_int8_gemm kernel's int8 x int8 GEMM with exact integer sums (qscheme.int8_gemm): VPDPBUSD on
# AVX512-VNNI CPUs, a portable loop elsewhere; C++17 with no torch headers, optional in the same way.
INT8_GEMM_EXTENSION = Extension(
    "qscheme._int8_gemm",
    sources=[
        "qscheme/csrc/int8_gemm.cpp",
        "qscheme/csrc/int8_gemm_vnni.cpp",
        "qscheme/csrc/act_quant.cpp",  # the input's quantizer, also in qscheme._cpu_gemv
        "qscheme/csrc/act_quant_avx512.cpp",
    ],
    depends=["qscheme/csrc/int8_gemm.h", "qscheme/csrc/act_quant.h", "qscheme/csrc/thread_pool.h", "qscheme/csrc/row_streams.h"],
    language="c++",
    extra_compile_args=["-O3", "-std=c++17", "-fno-fast-math", "-pthread", *OPENMP],
    extra_link_args=["-pthread", *OPENMP],
    optional=True,
)


def build_jobs() -> int:
    """Source files compiled at once: ``QSCHEME_BUILD_JOBS``, else the CPUs this process may use."""
    setting = os.environ.get("QSCHEME_BUILD_JOBS", "")
    if setting.isdigit() and int(setting) > 0:
        return int(setting)
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def _compile_in_parallel(
    self: Any,
    sources: list[str],
    output_dir: str | None = None,
    macros: Any = None,
    include_dirs: Any = None,
    debug: int = 0,
    extra_preargs: Any = None,
    extra_postargs: Any = None,
    depends: Any = None,
) -> list[str]:
    """The compiler's ``compile``, each source on its own thread (the work is the compiler process)."""
    macros, objects, extra_postargs, pp_opts, build = self._setup_compile(
        output_dir, macros, include_dirs, sources, depends, extra_postargs
    )
    cc_args = self._get_cc_args(pp_opts, debug, extra_preargs)

    def one(obj: str) -> None:
        if obj in build:  # absent: up to date (the object is newer than its source and depends)
            source, extension = build[obj]
            self._compile(obj, source, extension, cc_args, extra_postargs, pp_opts)

    with ThreadPoolExecutor(build_jobs()) as pool:
        list(pool.map(one, objects))
    return objects


class ParallelBuildExt(build_ext):
    """build_ext compiling an extension's sources in parallel (the four extensions' dozen-odd C++
    files took about two minutes one after another on two cores, twice in CI: the editable install
    and the wheel check)."""

    def build_extensions(self) -> None:
        if build_jobs() > 1:
            self.compiler.compile = MethodType(_compile_in_parallel, self.compiler)
        super().build_extensions()


if __name__ == "__main__":
    setup(
        package_dir=ROOTS,
        packages=packages(),
        ext_modules=[BLOCKS_EXTENSION, CPU_GEMV_EXTENSION, TILE_GEMM_EXTENSION, INT8_GEMM_EXTENSION],
        cmdclass={"build_ext": ParallelBuildExt},
    )
