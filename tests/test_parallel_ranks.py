"""Real ranks: 2 and 4 torch.distributed processes (gloo, CPU) run sharded layers of real checkpoints.

Each rank loads its shard of every layer (``load_checkpoint_tp``) and the whole layer
(``load_checkpoint``), wraps the shard (``ColumnParallelLinear`` gathering its output,
``RowParallelLinear`` all-reducing it) and compares with the whole layer on the same input:
gathered column outputs and all-reduced row outputs must equal the unsharded layer's (row
outputs within float32 summation order), and the partial sums (``reduce=False``) must add up to
it. Cases: NVFP4 (W4A4 and W4A16), int4 W4A16 with zero points, FP8 128x128 blocks, ModelOpt
int4 AWQ (pre-scale split with K) and a fused qkv module whose members have different global
scales. Layers whose split would cut a group or block at a degree are replicated by the case's
plan (the split rules are tested in test_parallel_rules.py).

The ranks are separate processes started by this file (``python tests/test_parallel_ranks.py
RANK WORLD ...``), meeting through a file store in a temporary folder (no port to choose), under
a deadline: a rank that fails ends the others at once, and a run past the deadline is killed
and fails its test, never the suite.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEADLINE_S = 300  # a loaded 2-core CI machine takes ~15-40 s to start 4 ranks
GLOO_TIMEOUT_S = 120
COLUMN_TOLERANCE = 1e-6  # of the output's largest magnitude: the same products, summed the same way
ROW_TOLERANCE = 1e-5  # partial sums add in another order than one matmul


# ------------------------------------------------------------------------------------ one rank


def _rank_main(rank: int, world: int, store: str, spec_file: str, out_file: str) -> None:
    """Run every case's split layers on this rank; write what was compared to ``out_file``."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from qscheme import load_checkpoint
    from qscheme.parallel import load_checkpoint_tp
    from qscheme.parallel.linear import ColumnParallelLinear, RowParallelLinear

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S),
    )
    results: list[dict[str, object]] = []
    try:
        for case in json.loads(Path(spec_file).read_text()):
            if case["case"] == "dense":
                results.extend(_dense_rows(rank, world))
                continue
            folder = Path(case["path"])
            options = {"kernel": "reference", "fuse": case.get("fuse"), "activation_dtype": "float32"}
            whole = load_checkpoint(folder, **options)
            mine = load_checkpoint_tp(folder, rank, world, case.get("tp_plan"), **options)
            inputs = load_file(str(folder / "reference.safetensors"))
            for name, layer in mine.items():
                shard = mine.shards[name]
                members = shard.members
                key = next(f"{m.layer}.input" for m in members if f"{m.layer}.input" in inputs)
                x = inputs[key].reshape(-1, shard.k).to(torch.float32)
                with torch.no_grad():
                    expected = whole[name](x)
                    row: dict[str, object] = {
                        "case": case["case"],
                        "layer": name,
                        "style": shard.style,
                        "rank": rank,
                        "shard": [layer.out_features, layer.in_features],
                        "whole": [shard.n, shard.k],
                        "scale": float(expected.abs().max()),
                    }
                    wrapped: torch.nn.Module | None = None
                    if shard.style == "column":
                        partitions = tuple(m.n for m in members)
                        wrapped = ColumnParallelLinear(layer, rank, world, partitions=partitions, gather=True)
                        row["error"] = float((wrapped(x) - expected).abs().max())
                    elif shard.style == "row":
                        wrapped = wrapped_row = RowParallelLinear(layer, rank, world, split_input=True)
                        row["error"] = float((wrapped_row(x) - expected).abs().max())
                if wrapped is not None:  # the input's gradient, for a loss every rank computes alike
                    probe = torch.randn(expected.shape, generator=torch.Generator().manual_seed(11))
                    grad = _input_gradient(whole[name], x, probe)
                    row["grad_scale"] = float(grad.abs().max())
                    row["grad_error"] = float((_input_gradient(wrapped, x, probe) - grad).abs().max())
                if shard.style == "row":
                    with torch.no_grad():
                        wrapped_row.reduce = False
                        partial = wrapped_row(x)
                        summed = partial.clone()
                        dist.all_reduce(summed)
                        row["partial_error"] = float((summed - expected).abs().max())
                        row["partial_differs"] = bool(world > 1 and not torch.equal(partial, expected))
                results.append(row)
    finally:
        Path(out_file).write_text(json.dumps(results))
        dist.destroy_process_group()


def _input_gradient(module: Any, x: Any, probe: Any) -> Any:
    """d(sum(module(x) * probe)) / dx."""
    x = x.clone().requires_grad_(True)
    (module(x) * probe).sum().backward()
    return x.grad


def _dense_rows(rank: int, world: int) -> list[dict[str, object]]:
    """Plain nn.Linear shards in the wrappers: a fused-like column layer (partitions 64 + 32),
    gathered, and a row layer whose bias every rank is given (added once, on rank 0)."""
    import torch

    from qscheme.errors import UsageError
    from qscheme.parallel.linear import ColumnParallelLinear, RowParallelLinear

    generator = torch.Generator().manual_seed(7)
    x = torch.randn(5, 256, generator=generator)
    rows: list[dict[str, object]] = []
    for style, (n, k) in (("column", (96, 256)), ("row", (64, 256))):
        whole = torch.nn.Linear(k, n)
        with torch.no_grad():
            whole.weight.copy_(torch.randn(n, k, generator=generator))
            whole.bias.copy_(torch.randn(n, generator=generator))
            expected = whole(x)
            if style == "column":
                rows_of = [
                    torch.arange(start + rank * size // world, start + (rank + 1) * size // world)
                    for start, size in ((0, 64), (64, 32))
                ]
                index = torch.cat(rows_of)
                shard = torch.nn.Linear(k, len(index))
                shard.weight.copy_(whole.weight[index])
                shard.bias.copy_(whole.bias[index])
                wrapped = ColumnParallelLinear(shard, rank, world, partitions=(64, 32), gather=True)
                y = wrapped(x)
            else:
                part = k // world
                shard = torch.nn.Linear(part, n, bias=False)
                shard.weight.copy_(whole.weight[:, rank * part : (rank + 1) * part])
                wrapped = RowParallelLinear(shard, rank, world, bias=whole.bias.clone(), split_input=True)
                y = wrapped(x)
        rows.append(
            {
                "case": "dense",
                "layer": f"dense.{style}",
                "style": style,
                "rank": rank,
                "shard": [shard.out_features, shard.in_features],
                "whole": [n, k],
                "scale": float(expected.abs().max()),
                "error": float((y - expected).abs().max()),
            }
        )
        wrong = RowParallelLinear(torch.nn.Linear(4, 3), (rank + 1) % world, world)  # another rank's shard
        try:
            wrong(torch.zeros(1, 4))
        except UsageError as error:
            rows[-1]["group_error"] = str(error)
        probe = torch.randn(expected.shape, generator=torch.Generator().manual_seed(11))
        grad = _input_gradient(whole, x, probe)
        rows[-1]["grad_scale"] = float(grad.abs().max())
        rows[-1]["grad_error"] = float((_input_gradient(wrapped, x, probe) - grad).abs().max())
    return rows


# ------------------------------------------------------------------------------------ the parent


def _gloo_environment() -> dict[str, str]:
    """The ranks' environment: one thread each, the repository importable, gloo on loopback."""
    environment = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [root, environment.get("PYTHONPATH")]))
    environment["OMP_NUM_THREADS"] = "1"
    environment.setdefault("TQDM_DISABLE", "1")
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    if "lo" in names:  # a container's hostname may not resolve; the loopback always does
        environment.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return environment


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for process in processes:
        process.wait(timeout=30)


def _tail(path: Path) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-3000:]


def run_ranks(world: int, cases: list[dict[str, object]], folder: Path) -> list[dict[str, object]]:
    """Start ``world`` ranks on ``cases`` and return every rank's rows; pytest.fail on any rank's
    failure (its output shown) or past the deadline (every rank killed)."""
    spec = folder / "cases.json"
    spec.write_text(json.dumps(cases))
    store = folder / "store"
    environment = _gloo_environment()
    processes: list[subprocess.Popen[bytes]] = []
    logs = [folder / f"rank{rank}.log" for rank in range(world)]
    outs = [folder / f"rank{rank}.json" for rank in range(world)]
    try:
        for rank in range(world):
            with logs[rank].open("wb") as log:
                command = [sys.executable, __file__, str(rank), str(world), str(store), str(spec), str(outs[rank])]
                processes.append(
                    subprocess.Popen(
                        command, stdout=log, stderr=subprocess.STDOUT, env=environment, start_new_session=True
                    )
                )
        deadline = time.monotonic() + DEADLINE_S
        while any(process.poll() is None for process in processes):
            failed = [rank for rank, process in enumerate(processes) if process.poll() not in (None, 0)]
            if failed:
                _stop(processes)
                pytest.fail(f"rank {failed[0]} of {world} failed:\n{_tail(logs[failed[0]])}")
            if time.monotonic() > deadline:
                _stop(processes)
                shown = "\n".join(f"--- rank {r}:\n{_tail(log)}" for r, log in enumerate(logs))
                pytest.fail(f"{world} ranks did not finish within {DEADLINE_S} s; killed them:\n{shown}")
            time.sleep(0.2)
        failed = [rank for rank, process in enumerate(processes) if process.returncode != 0]
        if failed:
            pytest.fail(f"rank {failed[0]} of {world} failed:\n{_tail(logs[failed[0]])}")
    finally:
        _stop(processes)
    return [row for out in outs for row in json.loads(out.read_text())]


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
    sys.exit(0)


# ------------------------------------------------------------------------------------ the tests

import pytest  # noqa: E402
from checkpoint_cache import ct_checkpoint, modelopt_fixture  # noqa: E402
from safetensors import safe_open  # noqa: E402

QKV = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
ATTENTION = ("q_proj", "k_proj", "v_proj")
MLP_UP = ("gate_proj", "up_proj")
# int4 groups of 128 and FP8 128x128 blocks: a 128-wide K (o_proj) cannot be split, and FP8's
# 128-row blocks allow no split of the 64- and 128-row attention projections.
COLUMN_ONLY = {"q_proj": "column", "k_proj": "column", "v_proj": "column", "gate_proj": "column", "up_proj": "column"}
NO_O_PROJ = {**COLUMN_ONLY, "down_proj": "row"}
DENSE: dict[str, object] = {"case": "dense"}
DENSE_LAYERS = {("dense", "dense.column", "column"), ("dense", "dense.row", "row")}
FP8_BLOCK_PLAN = {"gate_proj": "column", "up_proj": "column", "down_proj": "row"}


def _case(name: str, path: Path, tp_plan: dict[str, str] | None = None, fuse: object = None) -> dict[str, object]:
    return {"case": name, "path": str(path), "tp_plan": tp_plan, "fuse": fuse}


def _global_scales(folder: Path, modules: tuple[str, ...]) -> list[float]:
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        return [float(handle.get_tensor(f"model.layers.0.self_attn.{m}.weight_global_scale")) for m in modules]


def _layers(case: str, *, column: tuple[str, ...], row: tuple[str, ...]) -> set[tuple[str, str, str]]:
    where = {**{m: "self_attn" for m in ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")}}
    named = lambda m: f"model.layers.0.{where.get(m, 'mlp')}.{m}"  # noqa: E731
    return {(case, named(m), "column") for m in column} | {(case, named(m), "row") for m in row}


def _check(rows: list[dict[str, object]], world: int, expected: set[tuple[str, str, str]]) -> None:
    """Every expected split layer ran on every rank, with shard sizes 1/world, matching the whole layer."""
    split = [row for row in rows if row["style"] != "replicate"]
    seen = {(str(r["case"]), str(r["layer"]), str(r["style"])) for r in split}
    assert seen == expected
    for row in split:
        n, k = row["whole"]  # type: ignore[misc]
        shard_n, shard_k = row["shard"]  # type: ignore[misc]
        assert (shard_n, shard_k) == ((n // world, k) if row["style"] == "column" else (n, k // world)), row
        scale = float(row["scale"])  # type: ignore[arg-type]
        assert scale > 0, row
        tolerance = (COLUMN_TOLERANCE if row["style"] == "column" else ROW_TOLERANCE) * scale
        assert float(row["error"]) <= tolerance, row  # type: ignore[arg-type]
        # the input's gradient: a column layer's summed over ranks, a row layer's gathered
        assert float(row["grad_error"]) <= ROW_TOLERANCE * float(row["grad_scale"]), row  # type: ignore[arg-type]
        if row["style"] == "row" and row["case"] != "dense":
            assert float(row["partial_error"]) <= tolerance, row  # type: ignore[arg-type]
            assert row["partial_differs"], row  # a partial sum alone is not the output
    for row in rows:
        if row["case"] == "dense":  # a shard of another rank is refused before any communication
            rank, other = int(row["rank"]), (int(row["rank"]) + 1) % world  # type: ignore[call-overload]
            assert str(row["group_error"]).startswith(
                f"Linear: the shard is rank {other} of {world}, but this process is rank {rank} of {world} in the "
                "default process group"
            ), row
    for key in expected:
        ranks = sorted(int(r["rank"]) for r in split if (r["case"], r["layer"], r["style"]) == key)  # type: ignore[arg-type]
        assert ranks == list(range(world)), key


def test_fused_qkv_members_have_different_global_scales() -> None:
    """The fused case is only a test of per-partition splitting if q, k and v really differ."""
    scales = _global_scales(ct_checkpoint("NVFP4"), ATTENTION)
    assert len(set(scales)) == 3, scales


@pytest.mark.distributed
def test_two_ranks_equal_the_unsharded_layers(tmp_path: Path) -> None:
    everything = ("q_proj", "k_proj", "v_proj", *MLP_UP)
    cases = [
        _case("nvfp4_w4a4", ct_checkpoint("NVFP4")),
        _case("nvfp4_w4a16_bias", ct_checkpoint("NVFP4A16", attention_bias=True)),
        _case("int4_zero_points", ct_checkpoint("W4A16_ASYM"), NO_O_PROJ),
        _case("fp8_block", ct_checkpoint("FP8_BLOCK"), FP8_BLOCK_PLAN),
        _case("modelopt_int4_awq", modelopt_fixture("w4a16_awq"), NO_O_PROJ),
        _case("fused_qkv_nvfp4", ct_checkpoint("NVFP4"), fuse=QKV),
        DENSE,
    ]
    expected = (
        _layers("nvfp4_w4a4", column=everything, row=("o_proj", "down_proj"))
        | _layers("nvfp4_w4a16_bias", column=everything, row=("o_proj", "down_proj"))
        | _layers("int4_zero_points", column=everything, row=("down_proj",))
        | _layers("fp8_block", column=MLP_UP, row=("down_proj",))
        | _layers("modelopt_int4_awq", column=everything, row=("down_proj",))
        | _layers("fused_qkv_nvfp4", column=("qkv_proj", *MLP_UP), row=("o_proj", "down_proj"))
        | DENSE_LAYERS
    )
    _check(run_ranks(2, cases, tmp_path), 2, expected)


@pytest.mark.distributed
def test_four_ranks_equal_the_unsharded_layers(tmp_path: Path) -> None:
    everything = ("q_proj", "k_proj", "v_proj", *MLP_UP)
    cases = [
        _case("nvfp4_w4a4", ct_checkpoint("NVFP4")),
        _case("nvfp4_w4a16_bias", ct_checkpoint("NVFP4A16", attention_bias=True)),
        _case("int4_zero_points", ct_checkpoint("W4A16_ASYM"), COLUMN_ONLY),
        _case("modelopt_int4_awq", modelopt_fixture("w4a16_awq"), COLUMN_ONLY),
        _case("fused_qkv_nvfp4", ct_checkpoint("NVFP4"), fuse=QKV),
        DENSE,
    ]
    expected = (
        _layers("nvfp4_w4a4", column=everything, row=("o_proj", "down_proj"))
        | _layers("nvfp4_w4a16_bias", column=everything, row=("o_proj", "down_proj"))
        | _layers("int4_zero_points", column=everything, row=())
        | _layers("modelopt_int4_awq", column=everything, row=())
        | _layers("fused_qkv_nvfp4", column=("qkv_proj", *MLP_UP), row=("o_proj", "down_proj"))
        | DENSE_LAYERS
    )
    _check(run_ranks(4, cases, tmp_path), 4, expected)


# ------------------------------------------------------------------ the wrappers in one process


def test_one_rank_wrappers_compute_the_layer_and_keep_its_bias_once() -> None:
    import torch

    from qscheme.parallel.linear import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    layer, x = torch.nn.Linear(16, 12), torch.randn(3, 16)
    with torch.no_grad():
        expected = layer(x)
        column = ColumnParallelLinear(layer, 0, 1, partitions=(8, 4), gather=True)
        assert torch.equal(column(x), expected)
        row = RowParallelLinear(layer, 0, 1)
        assert layer.bias is None and row.bias is not None  # moved: added by the wrapper, on rank 0
        assert torch.equal(row(x), expected)
    assert (row.in_features, row.out_features) == (16, 12)


def test_wrapper_arguments_are_checked() -> None:
    import torch

    from qscheme.errors import UsageError
    from qscheme.parallel.linear import ColumnParallelLinear, RowParallelLinear

    with pytest.raises(UsageError, match=r"partitions \[5, 1\] do not split into 2 equal shards of 3 output"):
        ColumnParallelLinear(torch.nn.Linear(4, 3), 0, 2, partitions=(5, 1))
    with pytest.raises(UsageError, match=r"tp_rank=2 is not in 0\.\.1"):
        RowParallelLinear(torch.nn.Linear(4, 3), 2, 2)
    with pytest.raises(UsageError, match="bias has shape"):
        RowParallelLinear(torch.nn.Linear(4, 3, bias=False), 0, 2, bias=torch.zeros(4))
    with pytest.raises(UsageError, match="bias given twice"):
        RowParallelLinear(torch.nn.Linear(4, 3), 0, 2, bias=torch.zeros(3))
    row = RowParallelLinear(torch.nn.Linear(4, 3), 0, 2, split_input=True)
    with pytest.raises(UsageError, match=r"split_input=True takes the full input \[\.\.\., 8\], got \[2, 4\]"):
        row(torch.zeros(2, 4))


def test_a_split_layer_without_a_process_group_says_how_to_start_one() -> None:
    import torch

    from qscheme.errors import UsageError
    from qscheme.parallel.linear import ColumnParallelLinear, RowParallelLinear

    with pytest.raises(UsageError, match=r"Linear: tensor parallelism over 2 ranks needs torch\.distributed"):
        RowParallelLinear(torch.nn.Linear(4, 3), 0, 2)(torch.zeros(1, 4))
    gathered = ColumnParallelLinear(torch.nn.Linear(4, 3), 1, 2, gather=True)
    with pytest.raises(UsageError, match="init_process_group"):
        gathered(torch.zeros(1, 4))
    sharded = ColumnParallelLinear(torch.nn.Linear(4, 3), 1, 2)  # output stays sharded: no communication
    assert sharded(torch.zeros(1, 4)).shape == (1, 3)
