"""A whole tiny transformers Llama under torchrun with 2 ranks (gloo, CPU).

Each rank builds the model from the checkpoint's config, calls ``apply_to_model_tp`` with its
rank, and runs the same tokens; the logits of both ranks must equal the single-process model's
(``apply_to_model``) within float32 summation order (and, for a bfloat16 run, within the
rounding of bfloat16 partial sums). Runs: compressed-tensors NVFP4 (W4A4, every projection
split, 4 query and 2 key/value heads shared as 2 + 1 per rank) in float32 and bfloat16; ModelOpt
NVFP4 with excluded layers (an unquantized down_proj and a whole unquantized second layer,
split from their plain weights); FP8 128x128 blocks with a plan that splits only the MLP.
torchrun runs this file (``--standalone`` picks a free port at run time) under a deadline; a run
past it is killed and fails its test only.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

DEADLINE_S = 300
GLOO_TIMEOUT_S = 120
# of the largest logit: partial sums added in another order across two ranks (float32: 3e-7 seen;
# bfloat16: 1.7e-2 seen, the partial sums being rounded to bfloat16 before the all-reduce, as engines do)
LOGITS_TOLERANCE = {"float32": 5e-6, "bfloat16": 5e-2}
TOKENS = [[3, 17, 42, 5, 99, 250, 7, 64]]


def _model(folder: Path, dtype: str = "float32", **overrides: object):  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # built plain; qscheme puts the quantized layers in
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval().to(getattr(torch, dtype))


def _rank_main(out: str, spec: str) -> None:
    """One torchrun worker: the tensor-parallel model's logits for every run of ``spec`` (a JSON
    mapping run name -> folder, dtype and tp_plan), to ``out``.rankN.json."""
    import torch
    import torch.distributed as dist

    from qscheme.parallel import apply_to_model_tp
    from qscheme.parallel.linear import ColumnParallelLinear, RowParallelLinear

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, object] = {}
    try:
        for run, options in json.loads(Path(spec).read_text()).items():
            folder = options["folder"]
            model = _model(Path(folder), options["dtype"])
            checkpoint = apply_to_model_tp(model, folder, rank, world, options["tp_plan"], kernel="reference")
            attention = model.model.layers[0].self_attn
            kinds = {
                name: type(module).__name__
                for name, module in model.named_modules()
                if isinstance(module, ColumnParallelLinear | RowParallelLinear)
            }
            with torch.no_grad():
                logits = model(torch.tensor(TOKENS)).logits
            results[run] = {
                "logits": logits.float().tolist(),
                "kinds": kinds,
                "q_out": attention.q_proj.out_features,
                "k_out": attention.k_proj.out_features,
                "bytes_read": checkpoint.bytes_read.total,
            }
    finally:
        Path(out).with_suffix(f".rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2])
    sys.exit(0)


import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from checkpoint_cache import ct_checkpoint, modelopt_fixture  # noqa: E402

from qscheme.checkpoint import apply_to_model  # noqa: E402
from qscheme.errors import UsageError  # noqa: E402
from qscheme.modules import QuantLinear  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Run:
    """One model the ranks build: its checkpoint, dtype and TP plan (None: the Llama default)."""

    folder: Path
    dtype: str = "float32"
    tp_plan: dict[str, str] | None = None


def _torchrun(out: Path, runs: dict[str, Run], world: int = 2) -> dict[int, dict[str, dict[str, object]]]:
    """Run this file under torchrun with ``world`` ranks on ``runs``; every rank's results by rank."""
    spec = out.with_suffix(".runs.json")
    spec.write_text(
        json.dumps({name: dataclasses.asdict(run) | {"folder": str(run.folder)} for name, run in runs.items()})
    )
    environment = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [root, environment.get("PYTHONPATH")]))
    environment["OMP_NUM_THREADS"] = "1"
    environment.setdefault("TQDM_DISABLE", "1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        "--max-restarts",
        "0",
        __file__,
        str(out),
        str(spec),
    ]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=environment, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(
            f"torchrun did not finish within {DEADLINE_S} s; killed it:\n{output.decode(errors='replace')[-4000:]}"
        )
    if process.returncode != 0:
        pytest.fail(f"torchrun failed ({process.returncode}):\n{output.decode(errors='replace')[-4000:]}")
    return {rank: json.loads(out.with_suffix(f".rank{rank}.json").read_text()) for rank in range(world)}


def _single_process_logits(folder: Path, dtype: str = "float32") -> torch.Tensor:
    model = _model(folder, dtype)
    apply_to_model(model, folder, kernel="reference")
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)
    with torch.no_grad():
        logits: torch.Tensor = model(torch.tensor(TOKENS)).logits
    return logits.float()


@pytest.mark.distributed
def test_two_ranks_give_the_single_process_logits(tmp_path: Path) -> None:
    nvfp4, excluded, fp8_block = ct_checkpoint("NVFP4"), modelopt_fixture("nvfp4_exclude"), ct_checkpoint("FP8_BLOCK")
    runs = {
        "nvfp4": Run(nvfp4),
        "nvfp4_bf16": Run(nvfp4, "bfloat16"),
        "modelopt_excluded_layers": Run(excluded),
        # 128x128 blocks: only the MLP splits; a plan keeps the attention whole on every rank
        "fp8_block_mlp_only": Run(fp8_block, tp_plan={"gate_proj": "column", "up_proj": "column", "down_proj": "row"}),
    }
    ranks = _torchrun(tmp_path / "logits", runs)
    for name, run in runs.items():
        expected = _single_process_logits(run.folder, run.dtype)
        tolerance = LOGITS_TOLERANCE[run.dtype] * float(expected.abs().max())
        for rank, results in ranks.items():
            found = results[name]
            logits = torch.tensor(found["logits"])
            assert logits.shape == expected.shape
            error = float((logits - expected).abs().max())
            assert error <= tolerance, (name, rank, error, tolerance)
            kinds = found["kinds"]
            assert isinstance(kinds, dict)
            assert kinds["model.layers.0.mlp.down_proj"] == "RowParallelLinear"
            assert kinds["model.layers.0.mlp.gate_proj"] == "ColumnParallelLinear"
            if run.tp_plan is None:  # the heads were split: 2 of 4 query heads, 1 of 2 key/value heads
                assert (found["q_out"], found["k_out"]) == (64, 32)
                assert kinds["model.layers.0.self_attn.o_proj"] == "RowParallelLinear"
            else:  # replicated: every rank runs all heads
                assert (found["q_out"], found["k_out"]) == (128, 64)
                assert "model.layers.0.self_attn.o_proj" not in kinds
        assert ranks[0][name]["logits"] == ranks[1][name]["logits"]  # every rank computes the same logits
    # the unquantized second layer of the ModelOpt checkpoint is split too
    kinds = ranks[0]["modelopt_excluded_layers"]["kinds"]
    assert isinstance(kinds, dict) and kinds["model.layers.1.self_attn.q_proj"] == "ColumnParallelLinear"


def _snapshot(model: torch.nn.Module) -> tuple[dict[str, type], dict[str, torch.Tensor]]:
    modules = {name: type(module) for name, module in model.named_modules()}
    return modules, {name: value.detach().clone() for name, value in model.state_dict().items()}


def _unchanged(model: torch.nn.Module, before: tuple[dict[str, type], dict[str, torch.Tensor]]) -> bool:
    modules, state = _snapshot(model)
    return modules == before[0] and all(torch.equal(state[name], value) for name, value in before[1].items())


def test_a_degree_that_cuts_attention_heads_names_the_module_and_the_working_degrees() -> None:
    from qscheme.parallel import apply_to_model_tp

    folder = ct_checkpoint("NVFP4")
    model = _model(folder)
    before = _snapshot(model)
    with pytest.raises(UsageError) as caught:
        apply_to_model_tp(model, folder, 0, 4, kernel="reference")
    assert str(caught.value) == (
        "apply_to_model(tp_size=4): model.layers.0.self_attn has 2 key/value heads (k_proj), which 4 ranks cannot "
        "share whole; every rank needs whole heads: tp_size 1, 2 divide all of this module's head counts (or "
        "replicate the attention with tp_plan)"
    )
    assert _unchanged(model, before)


def test_a_split_the_scheme_refuses_leaves_the_model_as_it_was() -> None:
    from qscheme.parallel import ShardError, apply_to_model_tp

    folder = ct_checkpoint("FP8_BLOCK")
    model = _model(folder)
    before = _snapshot(model)
    with pytest.raises(ShardError, match=r"model\.layers\.0\.self_attn\.o_proj") as caught:
        apply_to_model_tp(model, folder, 1, 2, kernel="reference")
    assert "128x128 scale block" in str(caught.value)
    assert _unchanged(model, before)


def test_one_rank_is_the_single_process_model_and_needs_no_process_group() -> None:
    from qscheme.parallel import apply_to_model_tp

    folder = ct_checkpoint("NVFP4")
    model = _model(folder)
    checkpoint = apply_to_model_tp(model, folder, 0, 1, kernel="reference")
    assert checkpoint.tp_size == 1
    with torch.no_grad():
        logits = model(torch.tensor(TOKENS)).logits
    torch.testing.assert_close(logits, _single_process_logits(folder), rtol=0, atol=0)


def test_apply_to_model_delegates_with_a_rank_and_a_degree() -> None:
    """``qscheme.apply_to_model(..., tp_rank=, tp_size=)`` is ``apply_to_model_tp``; half of the
    pair is a UsageError before the model is touched."""
    from qscheme import apply_to_model
    from qscheme.errors import UsageError
    from qscheme.parallel import ShardedCheckpoint

    folder = ct_checkpoint("NVFP4")
    model = _model(folder)
    before = _snapshot(model)
    with pytest.raises(UsageError, match="tp_rank and tp_size together"):
        apply_to_model(model, folder, tp_rank=0, kernel="reference")
    assert _unchanged(model, before)
    checkpoint = apply_to_model(model, folder, tp_rank=0, tp_size=1, kernel="reference")
    assert isinstance(checkpoint, ShardedCheckpoint) and checkpoint.tp_size == 1
    with torch.no_grad():
        logits = model(torch.tensor(TOKENS)).logits
    torch.testing.assert_close(logits, _single_process_logits(folder), rtol=0, atol=0)


def test_a_split_layer_without_a_process_group_says_how_to_start_one() -> None:
    from qscheme.parallel import apply_to_model_tp

    folder = ct_checkpoint("NVFP4")
    model = _model(folder)
    apply_to_model_tp(model, folder, 0, 2, kernel="reference")
    # inference: the first layer that communicates is o_proj (q/k/v keep their outputs sharded)
    with torch.no_grad(), pytest.raises(UsageError, match=r"o_proj: tensor parallelism over 2 ranks needs torch\.dist"):
        model(torch.tensor(TOKENS))
    # with gradients, q_proj already needs the group: its input's gradient is summed over the ranks
    with pytest.raises(UsageError, match=r"q_proj: tensor parallelism over 2 ranks needs torch\.distributed"):
        model(torch.tensor(TOKENS))


def test_bad_arguments_are_usage_errors_before_anything_is_read() -> None:
    from qscheme.parallel import apply_to_model_tp

    folder = ct_checkpoint("NVFP4")
    with pytest.raises(UsageError, match=r"tp_rank must be in 0\.\.1 for tp_size=2, not 2"):
        apply_to_model_tp(_model(folder), folder, 2, 2)
    with pytest.raises(UsageError, match=r"model must be a torch\.nn\.Module, not dict"):
        apply_to_model_tp({}, folder, 0, 2)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="tp_plan"):
        apply_to_model_tp(_model(folder), folder, 0, 2, tp_plan=["q_proj"])


def test_a_plan_that_pairs_layers_wrongly_is_refused_before_anything_is_read() -> None:
    from qscheme.parallel import apply_to_model_tp

    folder = ct_checkpoint("NVFP4")
    model = _model(folder)
    before = _snapshot(model)
    plan = {"q_proj": "column", "k_proj": "column", "v_proj": "column", "gate_proj": "column", "up_proj": "column"}
    with pytest.raises(UsageError) as caught:  # o_proj and down_proj replicated would take sharded inputs
        apply_to_model_tp(model, folder, 0, 2, plan, kernel="reference")
    assert str(caught.value) == (
        "tp_plan splits model.layers.0.self_attn inconsistently (q_proj column, k_proj column, v_proj column, "
        "o_proj replicate): q_proj/k_proj/v_proj column-parallel feed o_proj row-parallel (their outputs stay "
        "sharded, o_proj takes its slice of them), or all of them are replicated; give them styles that pair so"
    )
    assert _unchanged(model, before)


def test_a_model_that_disagrees_with_the_checkpoint_is_refused_and_left_as_it_was() -> None:
    from qscheme.errors import CheckpointError
    from qscheme.parallel import apply_to_model_tp

    folder = ct_checkpoint("NVFP4A16", attention_bias=True)
    model = _model(folder, attention_bias=False)
    before = _snapshot(model)
    with pytest.raises(
        CheckpointError, match=r"'model\.layers\.0\.self_attn\.[qkvo]_proj': the model's Linear has no bias"
    ):
        apply_to_model_tp(model, folder, 1, 2, kernel="reference")
    assert _unchanged(model, before)
    wider = _model(folder, intermediate_size=512, attention_bias=True)  # whole sizes are compared, not shards
    with pytest.raises(
        CheckpointError, match=r"'model\.layers\.0\.mlp\.down_proj': the model's Linear is \[128, 512\] but"
    ):
        apply_to_model_tp(wider, folder, 1, 2, kernel="reference")
