"""`qscheme resolve/inspect CHECKPOINT --tp N|auto`: golden outputs, and one test per failure
mode of the issue (a kernel tile the shard's K no longer fills, an NVFP4 group cut at TP8,
W4A16 scales that must split along K, fused q/k/v whose members must split each).

Goldens live in tests/snapshots/parallel/; regenerate with QSCHEME_UPDATE_SNAPSHOTS=1.
A test-local kernel (`tile_aligned`) has the tile checks Marlin declared before it learnt to
pad (N % 64 and K % 128, or N % 128 and K % 64), on the reference implementation, so that a
problem-stage rejection at one degree shows on a CPU.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from kernel_fakes import isolated_plugins
from parallel_checkpoints import write_checkpoint
from qscheme_plugins.reference import REFERENCE

from qscheme.cli.main import main
from qscheme.kernels.declaration import ShapeAlignment
from qscheme.plugins import hookimpl
from qscheme.plugins.manager import register_plugin

GOLDEN = Path(__file__).parent / "snapshots" / "parallel"
UPDATE = os.environ.get("QSCHEME_UPDATE_SNAPSHOTS") == "1"
# priority 46: above cpu_gemv (45), which would take every NVFP4 layer on the CPU
TILE_ALIGNED = replace(
    REFERENCE, name="tile_aligned", provider="test", priority=46, checks=(ShapeAlignment(((64, 128), (128, 64))),)
)
SHAPES = {  # o_proj: N = 64, K = 384: whole tiles at tp 1, K = 192 per rank at tp 2
    "self_attn.q_proj": (256, 256),
    "self_attn.k_proj": (128, 256),
    "self_attn.o_proj": (64, 384),
}


class TilePlugin:
    @hookimpl
    def qscheme_kernels(self) -> list[object]:
        return [TILE_ALIGNED]


@pytest.fixture(autouse=True)
def plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.startswith(("QSCHEME_", "TRITON_")) and name != "QSCHEME_UPDATE_SNAPSHOTS":
            monkeypatch.delenv(name)
    with isolated_plugins():
        assert register_plugin(TilePlugin(), "tile-test")
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("cli") / "ck", "compressed-tensors/NVFP4A16", SHAPES)


def run(args: list[str], capsys: pytest.CaptureFixture[str], folder: Path) -> tuple[int, str]:
    code = main(args)
    out = capsys.readouterr().out.replace(str(folder), "CHECKPOINT")
    kept = [line.rstrip() for line in out.splitlines() if not line.startswith(("device:", "note:"))]
    return code, "\n".join(kept) + "\n"


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / f"{name}.txt"
    if UPDATE or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs; review, then regenerate with QSCHEME_UPDATE_SNAPSHOTS=1"


@pytest.mark.parametrize(
    ("name", "args", "code"),
    [
        ("resolve_tp2", ["resolve", "{ck}", "--tp", "2", "--device", "cpu"], 0),
        ("resolve_tp_auto", ["resolve", "{ck}", "--tp", "auto", "--device", "cpu"], 0),
        ("inspect_tp2", ["inspect", "{ck}", "--tp", "2", "--device", "cpu"], 0),
    ],
)
def test_golden(name: str, args: list[str], code: int, checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    got, text = run([a.format(ck=checkpoint) for a in args], capsys, checkpoint)
    assert got == code
    check_golden(name, text)


def test_a_kernel_tile_the_shard_no_longer_fills(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, text = run(["resolve", str(checkpoint), "--tp", "1", "--device", "cpu"], capsys, checkpoint)
    assert code == 0 and "64x384       1      tile_aligned" in text
    code, text = run(["resolve", str(checkpoint), "--tp", "2", "--device", "cpu", "--json"], capsys, checkpoint)
    layer = next(x for x in json.loads(text)["layers"] if x["layer"].endswith("o_proj"))
    assert (layer["shard_n"], layer["shard_k"], layer["kernel"]) == (64, 192, "cpu_gemv")  # the next in rank
    assert {"kernel": "tile_aligned", "stage": "problem"}.items() <= layer["rejections"][0].items()
    assert "192" in layer["rejections"][0]["reason"]


def test_an_nvfp4_group_cut_at_tp8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_checkpoint(tmp_path / "ck", "compressed-tensors/NVFP4", {"mlp.down_proj": (128, 1856)})
    code, text = run(["resolve", str(folder), "--tp", "8", "--device", "cpu"], capsys, folder)
    assert code == 1 and "CANNOT SPLIT" in text
    assert "tp_size 8 splits K = 1856 into 232 per rank, which cuts a scale group of 16" in text
    assert "K = 1856 splits whole at tp_size 1, 2, 4, 29, 58" in text
    code, text = run(["resolve", str(folder), "--tp", "auto", "--device", "cpu", "--json"], capsys, folder)
    assert json.loads(text)["working"] == [1, 2, 4, 29, 58]


def test_w4a16_scales_split_along_k(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_checkpoint(tmp_path / "ck", "compressed-tensors/W4A16", {"mlp.down_proj": (128, 512)})
    code, text = run(["inspect", str(folder), "--tp", "2", "--device", "cpu"], capsys, folder)
    assert code == 0 and "weight_scale [128, 4] -> [128, 2] (dim 1)" in text
    code, text = run(["inspect", str(folder), "--tp", "8", "--device", "cpu"], capsys, folder)
    assert code == 1 and "which cuts a scale group of 128 (weight_scale [N, ceil(K/128)]): 64 % 128 = 64" in text


def test_fused_qkv_members_split_each(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shapes = {"self_attn.q_proj": (256, 256), "self_attn.k_proj": (128, 256), "self_attn.v_proj": (128, 256)}
    folder = write_checkpoint(tmp_path / "ck", "compressed-tensors/FP8_BLOCK", shapes)
    code, text = run(["resolve", str(folder), "--tp", "2", "--device", "cpu"], capsys, folder)
    assert code == 1  # k and v (N = 128, one block) cannot split: named, with the degrees that work
    assert "layer model.layers.0.self_attn.k_proj (compressed-tensors/FP8_BLOCK, column-parallel)" in text
    assert "N = 128 splits whole only at tp_size 1" in text


def test_tp_needs_a_checkpoint_and_a_degree(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["resolve", "compressed-tensors/NVFP4", "--tp", "2"]) == 2
    assert "--tp: for a checkpoint folder" in capsys.readouterr().err
    assert main(["resolve", str(checkpoint), "--tp", "0"]) == 2
    assert "expected a tensor-parallel degree" in capsys.readouterr().err
    assert main(["inspect", str(checkpoint), "--device", "cpu"]) == 2
    assert "only with --tp" in capsys.readouterr().err


def _with_heads(folder: Path, query: int, key_value: int | None, nested: str | None = None) -> Path:
    """Add head counts to the checkpoint's config.json (top level, or in a nested text config)."""
    config = json.loads((folder / "config.json").read_text())
    counts = {"num_attention_heads": query} | ({"num_key_value_heads": key_value} if key_value is not None else {})
    if nested is None:
        config.update(counts)
    else:
        config[nested] = counts
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_tp_auto_leaves_out_degrees_the_key_value_heads_rule_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = write_checkpoint(tmp_path / "ck", "compressed-tensors/NVFP4A16")
    code, text = run(["resolve", str(folder), "--tp", "auto", "--device", "cpu", "--json"], capsys, folder)
    assert code == 0 and json.loads(text)["working"][:4] == [1, 2, 4, 8]  # the layers alone allow 4 and 8
    _with_heads(folder, 8, 2)
    code, text = run(["resolve", str(folder), "--tp", "auto", "--device", "cpu", "--json"], capsys, folder)
    verdicts = json.loads(text)
    assert code == 0 and verdicts["working"] == [1, 2]
    four = verdicts["degrees"][3]
    assert four["tp_size"] == 4 and not four["ok"]
    assert "8 query, 2 key/value heads; 2 key/value heads do not divide by 4" in four["first_failure"]
    code, text = run(["resolve", str(folder), "--tp", "4", "--device", "cpu"], capsys, folder)
    assert code == 1
    for projection in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.*.self_attn.{projection}  compressed-tensors/NVFP4A16  column" in text
    assert text.count("CANNOT SPLIT") == 3 and "key/value heads = 2 splits whole at tp_size 1, 2 " in text


@pytest.mark.parametrize(
    ("query", "key_value", "nested", "working"),
    [
        (8, 8, None, [1, 2, 4, 8]),  # multi-head attention: the layers' own limit (N = 256 per q/k/v)
        (8, None, None, [1, 2, 4, 8]),  # num_key_value_heads defaults to num_attention_heads
        (12, 4, None, [1, 2, 4]),  # 4 key/value heads; the query heads (12) allow 4 too
        (6, 6, None, [1, 2]),  # the query heads rule out 4 and 8
        (8, 1, "text_config", [1]),  # multi-query attention, counts in a nested config
    ],
)
def test_tp_auto_takes_the_head_counts_from_config(
    tmp_path: Path, query: int, key_value: int | None, nested: str | None, working: list[int]
) -> None:
    from qscheme.parallel.resolve import auto_degrees

    folder = _with_heads(write_checkpoint(tmp_path / "ck", "compressed-tensors/NVFP4A16"), query, key_value, nested)
    _, verdicts = auto_degrees(folder, max_degree=8, device="cpu")
    assert [v.tp_size for v in verdicts if v.ok] == working


def test_tp_auto_checks_heads_of_an_attention_the_checkpoint_leaves_unquantized(tmp_path: Path) -> None:
    """apply_to_model_tp splits plain q/k/v by the plan too, so their heads still bound the degree;
    a plan that replicates the attention lifts the bound."""
    from qscheme.parallel.resolve import auto_degrees

    folder = write_checkpoint(tmp_path / "ck", "compressed-tensors/NVFP4A16", {"mlp.down_proj": (128, 512)})
    _with_heads(folder, 4, 2)
    _, verdicts = auto_degrees(folder, max_degree=8, device="cpu")
    assert [v.tp_size for v in verdicts if v.ok] == [1, 2]
    assert verdicts[3].first_failure.startswith("attention (q/k/v split by the plan): 4 ranks cannot share")
    mlp_only = {"gate_proj": "column", "up_proj": "column", "down_proj": "row"}
    _, verdicts = auto_degrees(folder, max_degree=8, device="cpu", tp_plan=mlp_only)
    assert [v.tp_size for v in verdicts if v.ok] == [1, 2, 4, 8]


@pytest.mark.parametrize(
    ("counts", "message"),
    [
        ({"num_attention_heads": "8"}, "num_attention_heads is '8'; a head count is a positive integer"),
        ({"num_attention_heads": 8, "num_key_value_heads": 0}, "num_key_value_heads is 0"),
        ({"num_attention_heads": 8, "num_key_value_heads": 3}, "num_attention_heads = 8 is not a multiple of"),
    ],
)
def test_bad_head_counts_are_named(
    tmp_path: Path, counts: dict[str, object], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = write_checkpoint(tmp_path / "ck", "compressed-tensors/NVFP4A16", {"mlp.down_proj": (128, 512)})
    config = json.loads((folder / "config.json").read_text()) | counts
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["resolve", str(folder), "--tp", "auto", "--device", "cpu"]) == 1
    error = capsys.readouterr().err
    assert "config.json" in error and message in error


def test_the_head_rule_is_apply_to_models(tmp_path: Path) -> None:
    """For a transformers Llama of 12 query and 4 key/value heads, apply_to_model_tp's head check
    refuses exactly the degrees the config's counts rule out."""
    transformers = pytest.importorskip("transformers")
    from qscheme.errors import UsageError
    from qscheme.parallel.heads import head_counts
    from qscheme.parallel.model import check_heads
    from qscheme.parallel.plan import checked_tp_plan

    folder = _with_heads(write_checkpoint(tmp_path / "ck", "compressed-tensors/NVFP4A16", {}), 12, 4)
    config = transformers.LlamaConfig(
        hidden_size=96, intermediate_size=64, num_hidden_layers=1, num_attention_heads=12, num_key_value_heads=4
    )
    model = transformers.LlamaForCausalLM(config)
    heads = head_counts(folder)
    assert heads is not None
    for tp_size in range(1, 13):
        try:
            check_heads(model, checked_tp_plan(None), tp_size)
            refused = False
        except UsageError:
            refused = True
        assert refused == (heads.reason(tp_size) is not None), tp_size
