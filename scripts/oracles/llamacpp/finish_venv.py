"""Finish and check the llama.cpp oracle venv; run by oracle-venv.sh inside that venv.

pip installs llama-cpp-python's Python package and libraries but not llama.cpp's converter
(`convert_hf_to_gguf.py` with its `conversion/` package and the `gguf-py/` it puts on sys.path).
This unpacks those three from the same sdist into `<venv>/llama.cpp/`, then checks what the tests
use: the llama library, ggml's quantizer symbols, a CPU backend built without AVX/FMA/F16C (so the
quantizer's arithmetic does not depend on the build machine), and that the converter starts.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

CONVERTER_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def unpack_converter(destination: Path) -> None:
    version = metadata.version("llama-cpp-python")
    with tempfile.TemporaryDirectory(dir=destination.parent) as scratch:
        download = [
            "download",
            "-q",
            "--no-deps",
            "--no-binary",
            "llama-cpp-python",
            "-d",
            scratch,
            f"llama-cpp-python=={version}",
        ]
        subprocess.run([sys.executable, "-m", "pip", *download], check=True, stdout=sys.stderr)
        (archive,) = Path(scratch).glob("*.tar.gz")
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        staging = Path(scratch) / "llama.cpp"
        with tarfile.open(archive) as sdist:
            members = [
                member
                for member in sdist.getmembers()
                if member.name.startswith(prefix)
                and member.name[len(prefix) :].startswith(CONVERTER_MEMBERS)
                and (member.isfile() or member.isdir())
            ]
            for member in members:
                member.name = member.name[len(prefix) :]
            sdist.extractall(staging, members=members, filter="data")
        shutil.move(staging, destination)


def check_libraries() -> None:
    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(str(lib / "libggml-base.so"))
    for symbol in ("ggml_quantize_chunk", "ggml_quantize_init", "ggml_get_type_traits"):
        getattr(base, symbol)
    cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"))
    for feature in ("avx", "avx2", "fma", "f16c", "avx512"):
        if getattr(cpu, f"ggml_cpu_has_{feature}")():
            raise SystemExit(f"llama.cpp oracle: ggml-cpu was built with {feature}; rebuild without")
    llama_cpp.llama_model_quantize_default_params()


def check_converter(destination: Path) -> None:
    subprocess.run(
        [sys.executable, str(destination / "convert_hf_to_gguf.py"), "--print-supported-models"],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def main() -> None:
    destination = Path(sys.prefix) / "llama.cpp"
    if not (destination / "convert_hf_to_gguf.py").is_file():
        shutil.rmtree(destination, ignore_errors=True)
        unpack_converter(destination)
    check_libraries()
    check_converter(destination)


if __name__ == "__main__":
    main()
