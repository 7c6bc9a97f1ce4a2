"""The llama.cpp oracle's side: runs inside the venv of `bash scripts/oracle-venv.sh llamacpp`.

    python oracle_side.py COMMAND SPEC.json

tests/llamacpp_oracle.py writes SPEC (a JSON object; arrays travel as .npy files named in it) and
reads the results this writes. Commands:

- ``quantize``   {input, type, output}: ggml_quantize_chunk on float32 [rows, K], no importance
  matrix; writes uint8 [rows, row_bytes].
- ``dequantize`` {input, type, k, output}: the type traits' to_float (ggml's C dequantizer) on
  uint8 [rows, row_bytes]; writes float32 [rows, K].
- ``convert``    {model_dir, out, outtype, pre_tokenizer}: the sdist's convert_hf_to_gguf.py
  (unpacked to <venv>/llama.cpp by finish_venv.py); with pre_tokenizer set, its BPE
  pre-tokenizer hash check is replaced by that name (tiny test tokenizers have no known hash).
- ``quantize_gguf`` {src, dst, ftype, pure, timing}: llama_model_quantize with
  LLAMA_FTYPE_MOSTLY_<ftype>, one thread; with ``timing``, the call's seconds are written there.
- ``logits``     {gguf, tokens, output}: Llama(...).eval one token at a time (n_batch=1: batched
  eval of tiny models crashed); writes float32 [len(tokens), vocab].

Only llama.cpp's own code, numpy and gguf are used here, never qscheme.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import runpy
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)


class TypeTraits(ctypes.Structure):
    # struct ggml_type_traits in ggml.h
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


def ggml_base() -> ctypes.CDLL:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llama_cpp is not installed in this venv")
    lib = ctypes.CDLL(str(Path(next(iter(spec.submodule_search_locations))) / "lib" / "libggml-base.so"))
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    lib.ggml_get_type_traits.restype = ctypes.POINTER(TypeTraits)
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    lib.ggml_quantize_init.restype = None
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_float),
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.POINTER(ctypes.c_float),
    ]
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    return lib


def ggml_type(lib: ctypes.CDLL, name: str) -> tuple[int, TypeTraits]:
    """ggml's enum value of a type name (numbered as gguf numbers it), checked against ggml's own name."""
    import gguf

    try:
        value = int(gguf.GGMLQuantizationType[name])
    except KeyError:
        raise SystemExit(f"unknown ggml type {name!r}") from None
    traits = lib.ggml_get_type_traits(value).contents
    own_name = (traits.type_name or b"").decode()
    if own_name.lower() != name.lower():
        raise SystemExit(f"gguf numbers {name} as {value}, which this ggml names {own_name!r}")
    return value, traits


def quantize(spec: dict[str, Any]) -> None:
    lib = ggml_base()
    value, traits = ggml_type(lib, spec["type"])
    if lib.ggml_quantize_requires_imatrix(value):
        raise SystemExit(f"{spec['type']} needs an importance matrix, which this oracle does not take")
    weights = np.ascontiguousarray(np.load(spec["input"]), dtype=np.float32)
    rows, k = weights.shape
    if k % traits.blck_size:
        raise SystemExit(f"K={k} is not a multiple of {spec['type']}'s block of {traits.blck_size}")
    row_bytes = lib.ggml_row_size(value, k)
    out = np.zeros((rows, row_bytes), dtype=np.uint8)
    lib.ggml_quantize_init(value)
    written = lib.ggml_quantize_chunk(
        value,
        weights.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
        out.ctypes.data_as(ctypes.c_void_p),
        0,
        rows,
        k,
        None,
    )
    if written != out.nbytes:
        raise SystemExit(f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}")
    np.save(spec["output"], out)


def dequantize(spec: dict[str, Any]) -> None:
    lib = ggml_base()
    value, traits = ggml_type(lib, spec["type"])
    if not traits.to_float:
        raise SystemExit(f"ggml has no to_float for {spec['type']}")
    raw = np.ascontiguousarray(np.load(spec["input"]), dtype=np.uint8)
    k = int(spec["k"])
    rows = raw.shape[0]
    if k % traits.blck_size or raw.shape[1] != lib.ggml_row_size(value, k):
        raise SystemExit(f"rows of {raw.shape[1]} bytes do not hold K={k} values of {spec['type']}")
    out = np.zeros((rows, k), dtype=np.float32)
    TO_FLOAT(traits.to_float)(
        raw.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), rows * k
    )
    np.save(spec["output"], out)


def convert(spec: dict[str, Any]) -> None:
    script = Path(sys.prefix) / "llama.cpp" / "convert_hf_to_gguf.py"
    sys.path.insert(0, str(script.parent))
    sys.argv = [str(script), spec["model_dir"], "--outfile", spec["out"], "--outtype", spec["outtype"]]
    converter = runpy.run_path(str(script), run_name="convert_hf_to_gguf")
    if spec.get("pre_tokenizer"):
        from conversion.base import TextModel

        name = spec["pre_tokenizer"]
        TextModel.get_vocab_base_pre = lambda self, tokenizer: name  # type: ignore[method-assign]
    converter["main"]()


def quantize_gguf(spec: dict[str, Any]) -> None:
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{spec['ftype']}", None)
    if ftype is None:
        known = sorted(
            n.removeprefix("LLAMA_FTYPE_MOSTLY_") for n in dir(llama_cpp) if n.startswith("LLAMA_FTYPE_MOSTLY_")
        )
        raise SystemExit(f"llama.cpp has no ftype {spec['ftype']!r}; it has {', '.join(known)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 1
    params.pure = bool(spec.get("pure", False))
    start = time.perf_counter()
    status = llama_cpp.llama_model_quantize(spec["src"].encode(), spec["dst"].encode(), ctypes.byref(params))
    seconds = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"llama_model_quantize returned {status}")
    if spec.get("timing"):
        Path(spec["timing"]).write_text(json.dumps({"seconds": seconds}))


def logits(spec: dict[str, Any]) -> None:
    from llama_cpp import Llama

    tokens = [int(token) for token in spec["tokens"]]
    model = Llama(
        model_path=spec["gguf"],
        n_ctx=max(16, len(tokens)),
        n_batch=1,
        n_ubatch=1,
        n_threads=1,
        n_threads_batch=1,
        logits_all=True,
        verbose=False,
    )
    model.eval(tokens)
    np.save(spec["output"], np.array(model.scores[: len(tokens)], dtype=np.float32))


COMMANDS = {
    "quantize": quantize,
    "dequantize": dequantize,
    "convert": convert,
    "quantize_gguf": quantize_gguf,
    "logits": logits,
}


if __name__ == "__main__":
    command, spec_path = sys.argv[1], sys.argv[2]
    COMMANDS[command](json.loads(Path(spec_path).read_text()))
