"""benchmarks/cpu_decode.py: the smoke run (a tiny Llama, 2 greedy tokens, every variant in one
process) writes a speed row per variant, llama.cpp rows for the GGUF variants where its oracle
venv exists, where each decode token's time goes, and a kernel plan per quantized variant
covering every Linear of the model. No assertion is on a time."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess  # every test here: the smoke fixture asks the llama.cpp venv how it was built

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
cpu_decode = importlib.import_module("cpu_decode")

SPEED_HEADER = (
    "| variant | engine | threads | decode tok/s | vs bf16 | prefill ms | load s | RSS loaded MiB "
    "| RSS after decode MiB | peak MiB | greedy tokens agreeing |"
)
PLAN_HEADER = "| variant | layers | scheme | plan | kernel at M=1 |"
BREAKDOWN_HEADER = (
    "| variant | ms per token | quantized layers | other linear layers (lm_head; all of bf16's) | the rest |"
)
LINEARS_PER_LLAMA_LAYER = 7  # q, k, v, o, gate, up, down (lm_head is left unquantized)


def _table(text: str, header: str) -> list[list[str]]:
    lines = text[text.index(header) :].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("| "):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, object]]]:
    out = tmp_path_factory.mktemp("cpu_decode")
    assert cpu_decode.main(["--smoke", "--markdown", str(out / "t.md"), "--json", str(out / "r.json")]) == 0
    return (out / "t.md").read_text(), json.loads((out / "r.json").read_text())


def test_a_speed_row_per_variant_and_engine(smoke: tuple[str, list[dict[str, object]]]) -> None:
    text, results = smoke
    rows = _table(text, SPEED_HEADER)
    expected = [("bf16", "transformers")] * 2 + [  # bf16 first and last
        (variant.name, "qscheme") for variant in cpu_decode.VARIANTS if variant.scheme is not None
    ]
    if cpu_decode.llamacpp_python() is not None:
        expected += [(variant.name, "llama.cpp") for variant in cpu_decode.VARIANTS if variant.gguf is not None]
    assert sorted((row[0], row[1]) for row in rows) == sorted(expected)
    assert {"Q4_0", "Q8_0", "NVFP4A16", "W4A16", "FP8_DYNAMIC"} <= {row[0] for row in rows}
    for row in rows:
        assert len(row) == 11
        assert row[2] == "2"  # --threads default
        assert float(row[3]) > 0
        assert row[4].endswith("x")
        assert float(row[7]) > 0 and float(row[9]) >= float(row[8]) - 1  # peak >= RSS after decode
    assert "1.00x" in [row[4] for row in rows if row[0] == "bf16"]  # the faster bf16 run is the base
    for result in results:  # the prefill's token and one per decode step
        assert len(result["generated"]) == 3  # type: ignore[arg-type]


def test_the_plans_cover_every_linear_of_the_model(smoke: tuple[str, list[dict[str, object]]]) -> None:
    text, _ = smoke
    rows = _table(text, PLAN_HEADER)
    layers = cpu_decode.SMOKE_SHAPE["num_hidden_layers"] * LINEARS_PER_LLAMA_LAYER
    by_variant: dict[str, int] = {}
    for variant, count, scheme, plan, kernel in rows:
        by_variant[variant] = by_variant.get(variant, 0) + int(count)
        assert kernel in plan  # the M = 1 kernel is one of the plan's
        assert scheme.endswith("/" + variant)
    assert by_variant == {variant.name: layers for variant in cpu_decode.VARIANTS if variant.scheme is not None}


def test_each_transformers_run_says_where_its_decode_time_goes(smoke: tuple[str, list[dict[str, object]]]) -> None:
    text, _ = smoke
    rows = _table(text, BREAKDOWN_HEADER)
    expected = ["bf16"] * 2 + [variant.name for variant in cpu_decode.VARIANTS if variant.scheme is not None]
    assert sorted(row[0] for row in rows) == sorted(expected)  # llama.cpp runs have no hooks to time
    for variant, total, quantized, linear, rest in rows:
        parts = [float(quantized), float(linear), float(rest)]
        assert abs(sum(parts) - float(total)) <= 0.25  # the three parts make the whole (each rounded to 0.1)
        assert float(linear) > 0  # lm_head is an nn.Linear in every variant
        if variant == "bf16":
            assert float(quantized) == 0  # no QuantLinear in the bf16 model
        else:
            assert float(quantized) > 0


def test_the_prompt_length_is_an_option() -> None:
    assert cpu_decode.prompt_ids(8) == cpu_decode.PROMPT and cpu_decode.prompt_ids(3) == cpu_decode.PROMPT[:3]
    ids = cpu_decode.prompt_ids(300)
    assert len(ids) == 300 and ids[:8] == cpu_decode.PROMPT and len(set(ids)) > 200
    assert all(0 <= token < cpu_decode.SMOKE_SHAPE["vocab_size"] for token in ids)
    with pytest.raises(SystemExit) as refused:
        cpu_decode.main(["--prompt-tokens", "0"])
    assert refused.value.code == 2
