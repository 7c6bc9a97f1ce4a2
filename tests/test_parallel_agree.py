"""Ranks that hold different plans refuse together (2 gloo ranks under torchrun, CPU).

Without the check, rank 0 splitting the attention while rank 1 replicates it pairs rank 0's
o_proj all-reduce with rank 1's down_proj one: both ranks return wrong logits and no error.
Here each run gives the ranks different arguments (tp_plan, fuse) or makes one rank fail; every
rank must raise (PlanMismatchError naming the rank that differs, or its own error for the rank
that failed) and none may return logits. A run with equal arguments still loads and agrees.
torchrun runs this file under a deadline; a run past it is killed and fails its test only.
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
GLOO_TIMEOUT_S = 60  # a rank that never reached the exchange would stall the others this long
TOKENS = [[3, 17, 42, 5]]


def _rank_main(out: str, spec: str) -> None:
    """One torchrun worker: for each run, this rank's arguments from ``spec``; writes what happened."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, LlamaForCausalLM

    from qscheme.parallel import apply_to_model_tp, load_checkpoint_tp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, object] = {}
    try:
        for run, options in json.loads(Path(spec).read_text()).items():
            mine = options["ranks"][rank]
            folder = options["folder"]
            try:
                if options["api"] == "model":
                    config = AutoConfig.from_pretrained(folder)
                    del config.quantization_config
                    torch.manual_seed(0)
                    model = LlamaForCausalLM(config).eval()
                    apply_to_model_tp(model, folder, rank, world, mine.get("tp_plan"), kernel="reference")
                    with torch.no_grad():
                        logits = model(torch.tensor(TOKENS)).logits
                    results[run] = {"logits": logits.shape[-1]}
                else:
                    checkpoint = load_checkpoint_tp(
                        folder, rank, world, mine.get("tp_plan"), kernel="reference", fuse=mine.get("fuse")
                    )
                    results[run] = {"layers": sorted(checkpoint)}
            except Exception as error:  # the test inspects the type
                results[run] = {"error": type(error).__name__, "message": str(error)}
    finally:
        Path(out).with_suffix(f".rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2])
    sys.exit(0)


import pytest  # noqa: E402
from checkpoint_cache import ct_checkpoint  # noqa: E402

MLP_ONLY = {"gate_proj": "column", "up_proj": "column", "down_proj": "row"}
QKV = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}


def _torchrun(out: Path, runs: dict[str, dict[str, object]], world: int = 2) -> dict[int, dict[str, dict[str, str]]]:
    spec = out.with_suffix(".runs.json")
    spec.write_text(json.dumps(runs))
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
        pytest.fail(f"torchrun did not finish within {DEADLINE_S} s:\n{output.decode(errors='replace')[-4000:]}")
    if process.returncode != 0:
        pytest.fail(f"torchrun failed ({process.returncode}):\n{output.decode(errors='replace')[-4000:]}")
    return {rank: json.loads(out.with_suffix(f".rank{rank}.json").read_text()) for rank in range(world)}


@pytest.mark.distributed
def test_ranks_with_different_plans_all_refuse(tmp_path: Path) -> None:
    nvfp4, fp8_block = str(ct_checkpoint("NVFP4")), str(ct_checkpoint("FP8_BLOCK"))
    runs: dict[str, dict[str, object]] = {
        "same_plan": {"api": "model", "folder": nvfp4, "ranks": [{}, {}]},
        "tp_plan_differs": {"api": "model", "folder": nvfp4, "ranks": [{}, {"tp_plan": MLP_ONLY}]},
        "fuse_differs": {"api": "load", "folder": nvfp4, "ranks": [{"fuse": QKV}, {}]},
        # rank 1's default plan cuts FP8's 128-row blocks of k/v: it fails, rank 0 must not wait for it
        "one_rank_fails": {"api": "load", "folder": fp8_block, "ranks": [{"tp_plan": MLP_ONLY}, {}]},
    }
    ranks = _torchrun(tmp_path / "agree", runs)

    for rank in (0, 1):
        assert ranks[rank]["same_plan"] == {"logits": 256}, ranks[rank]["same_plan"]

    for run in ("tp_plan_differs", "fuse_differs"):
        for rank in (0, 1):
            found = ranks[rank][run]
            assert found.get("error") == "PlanMismatchError", (run, rank, found)
            message = found["message"]
            assert "the 2 tensor-parallel ranks do not hold the same plan" in message
            assert "rank 0 holds plan" in message and "rank 1 holds plan" in message
            assert f"this is rank {rank}" in message and "; rank 1 differs." in message
            assert "with the same tp_plan, fuse and fuse_policy" in message

    failed, waiting = ranks[1]["one_rank_fails"], ranks[0]["one_rank_fails"]
    assert failed.get("error") == "ShardError", failed
    assert waiting.get("error") == "PlanMismatchError", waiting
    assert "rank 1 failed while loading (see its own error)" in waiting["message"]


def test_plan_checksums_depend_on_the_split_not_the_rank() -> None:
    from qscheme.parallel import load_checkpoint_tp

    folder = ct_checkpoint("NVFP4")
    rank0, rank1 = (load_checkpoint_tp(folder, rank, 2, kernel="reference") for rank in (0, 1))
    assert rank0.digest() == rank1.digest()
    mlp_only = load_checkpoint_tp(folder, 1, 2, MLP_ONLY, kernel="reference")
    fused = load_checkpoint_tp(folder, 1, 2, kernel="reference", fuse=QKV)
    four = load_checkpoint_tp(folder, 1, 4, kernel="reference")
    digests = {rank0.digest(), mlp_only.digest(), fused.digest(), four.digest(), rank0.digest(["extra"])}
    assert len(digests) == 5


def test_mismatch_message_names_the_differing_ranks() -> None:
    from qscheme.errors import CheckpointError
    from qscheme.parallel.agree import PlanMismatchError

    error = PlanMismatchError("load", {"aaaa": (0, 1, 3), "bbbb": (2,), "failed": (4,)}, 3)
    assert isinstance(error, CheckpointError)
    assert error.differing == (2, 4)
    assert "ranks 0, 1, 3 hold plan aaaa; rank 2 holds plan bbbb; rank 4 failed while loading" in str(error)
    assert "ranks 2, 4 differ." in str(error)


def test_verify_ranks_takes_a_bool() -> None:
    from qscheme.errors import UsageError
    from qscheme.parallel import load_checkpoint_tp

    with pytest.raises(UsageError, match="verify_ranks must be True or False, not 'no'"):
        load_checkpoint_tp(ct_checkpoint("NVFP4"), 0, 2, verify_ranks="no")  # type: ignore[arg-type]
