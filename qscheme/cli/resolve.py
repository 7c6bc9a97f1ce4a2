"""`qscheme resolve TARGET [--device D] [--kernel K] [--shape N,K] [--dtype T] [--m M,...] [--m-split S] [--tp N|auto]
[--engine vllm] [--json]`.

Which kernel would run a layer of the scheme (a catalog name or a descriptor file), and why
every other kernel would not. Exit 0 when a kernel is chosen, 1 when none can run it, 2 when the
name or file is not found or an option is bad.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from qscheme.catalog import load_scheme
from qscheme.cli.output import print_json
from qscheme.errors import UsageError
from qscheme.kernels import registry
from qscheme.kernels.devices import DEVICE_CHOICES
from qscheme.kernels.problem import Problem
from qscheme.kernels.render import render_resolution, resolution_json
from qscheme.producers.gguf.config import is_gguf_file

DEFAULT_SHAPE = (4096, 4096)


def register(sub: Any) -> None:
    parser = sub.add_parser("resolve", help="show which kernel runs a scheme on a device, and why the others do not")
    parser.add_argument(
        "target",
        metavar="NAME|FILE|CHECKPOINT",
        help="a scheme name (see `qscheme schemes`), a descriptor file, a checkpoint folder or a .gguf file",
    )
    parser.add_argument(
        "--device",
        choices=DEVICE_CHOICES,
        default=None,
        help="cpu, cuda (the real GPU) or a simulated smXY (default: probe this machine); resolving only "
        "judges declarations, so any GPU can be simulated (`qscheme run` needs a real device instead)",
    )
    parser.add_argument(
        "--kernel", default=None, help="force this kernel (fails if it cannot run; overrides QSCHEME_KERNEL)"
    )
    parser.add_argument(
        "--shape",
        default=None,
        metavar="N,K",
        help=f"output and input features of the layer, as N,K or NxK (default {DEFAULT_SHAPE[0]},{DEFAULT_SHAPE[1]}; "
        "not for a checkpoint, whose layers have their own)",
    )
    parser.add_argument("--dtype", default="bf16", help="activation dtype: bf16, fp16 or fp32 (default bf16)")
    parser.add_argument(
        "--partitions", type=int, default=1, help="fused partitions forming the layer (default 1; not for a checkpoint)"
    )
    parser.add_argument(
        "--scales-differ",
        action="store_true",
        help="the fused partitions have different global scales (not for a checkpoint)",
    )
    parser.add_argument(
        "--tp",
        default=None,
        metavar="N|auto",
        help="for a checkpoint: split every layer N ways (tensor parallel) and resolve each shard; "
        "'auto' lists the degrees at which every layer splits and has a kernel",
    )
    parser.add_argument(
        "--m",
        default=None,
        metavar="M,...",
        help="batch sizes (rows of the input, x.numel() // K) to show the plan's kernel for, e.g. 1,16,256",
    )
    parser.add_argument(
        "--m-split",
        default=None,
        metavar="SPEC",
        help="override the kernels' declared batch ranges (overrides QSCHEME_M_SPLIT): a boundary M such as 32, "
        "'off', or kernel=RANGE pairs such as dequant_gemm=32-",
    )
    parser.add_argument(
        "--engine",
        default=None,
        metavar="ENGINE",
        help=f"for a checkpoint: the layers a serving engine builds ({', '.join(ENGINES)}): vLLM's fused names, "
        "qscheme's kernel for each, its shard with --tp N, and the engine's own method",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(handler=run)


ENGINES: tuple[str, ...] = ("vllm",)


def parse_engine(text: str | None) -> str | None:
    """``--engine``: one of ENGINES (case-insensitive); UsageError naming the value otherwise."""
    if text is None:
        return None
    value = text.strip().lower()
    if value not in ENGINES:
        raise UsageError(
            f"--engine {text!r}: not an engine qscheme explains; allowed: {', '.join(ENGINES)} "
            "(e.g. qscheme resolve PATH --engine vllm --tp 2)"
        )
    return value


MAX_BATCH_SIZES = 64  # batch sizes one --m may list


def parse_batch_sizes(text: str | None) -> tuple[int, ...]:
    """``--m 1,16,256`` -> (1, 16, 256); UsageError naming the value otherwise."""
    if text is None:
        return ()
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts) or len(parts) > MAX_BATCH_SIZES:
        raise UsageError(
            f"--m {text!r}: expected batch sizes M >= 0 separated by commas (at most {MAX_BATCH_SIZES}), such as "
            "1,16,256; M is the input's rows, x.numel() // K"
        )
    return tuple(int(p) for p in parts)


def parse_tp(text: str) -> int | None:
    """``--tp``: a degree >= 1, or None for ``auto``; UsageError otherwise."""
    if text.strip().lower() == "auto":
        return None
    if not text.strip().isdigit() or not 1 <= int(text) <= MAX_TP:
        raise UsageError(f"--tp {text!r}: expected a tensor-parallel degree in 1..{MAX_TP}, or 'auto'")
    return int(text)


def run_tp(args: argparse.Namespace, target: str) -> int:
    """``--tp N`` / ``--tp auto`` on a checkpoint folder (resolve and inspect share it)."""
    from qscheme.parallel.report import auto_json, render_auto, render_tp, tp_json
    from qscheme.parallel.resolve import auto_degrees, resolve_tp

    degree = parse_tp(args.tp)
    device = registry.device_for(args.device)
    dtype = getattr(args, "dtype", None) or "bf16"
    kernel = getattr(args, "kernel", None)
    if degree is None:
        _, verdicts = auto_degrees(target, device=device, kernel=kernel, activation_dtype=dtype)
        if args.json:
            print_json(auto_json(target, verdicts, device.describe()))
        else:
            sys.stdout.write(render_auto(target, verdicts, device.describe()) + "\n")
        return 0 if any(v.ok and v.tp_size > 1 for v in verdicts) else 1
    _, decisions = resolve_tp(target, degree, device=device, kernel=kernel, activation_dtype=dtype)
    if args.json:
        print_json(tp_json(target, degree, decisions, device.describe()))
    else:
        sys.stdout.write(render_tp(target, degree, decisions, device.describe()) + "\n")
    return 0 if all(d.ok for d in decisions) else 1


MAX_TP = 1024  # larger than any tensor-parallel group
MAX_FEATURES = 1 << 24  # 16M: larger than any linear layer; bounds what a typo can ask for
_SHAPE = re.compile(r"\s*([0-9]+)\s*[,xX]\s*([0-9]+)\s*")


def parse_shape(text: str | None) -> tuple[int, int]:
    if text is None:
        return DEFAULT_SHAPE
    match = _SHAPE.fullmatch(text)
    if match is None:
        raise UsageError(f"--shape {text!r}: expected N,K (or NxK), two positive integers such as 4096,11008")
    n, k = int(match[1]), int(match[2])
    if not (1 <= n <= MAX_FEATURES and 1 <= k <= MAX_FEATURES):
        raise UsageError(f"--shape {text!r}: N and K must lie in 1..{MAX_FEATURES}")
    return n, k


def run(args: argparse.Namespace) -> int:
    gguf = is_gguf_file(args.target)  # one GGUF file is a checkpoint too (a scheme name never ends in .gguf)
    if args.engine is not None and not (Path(args.target).is_dir() or gguf):
        parse_engine(args.engine)
        raise UsageError(
            f"--engine {args.engine}: for a checkpoint folder, whose layers the engine builds; {args.target!r} is not "
            "one (resolve the checkpoint's folder, or drop --engine)"
        )
    if args.tp is not None and gguf:
        raise UsageError(f"--tp: tensor parallelism is not offered for GGUF files ({args.target}); drop --tp")
    if args.tp is not None and not Path(args.target).is_dir():
        raise UsageError(
            f"--tp: for a checkpoint folder, whose layers it splits; {args.target!r} is not a folder "
            "(for one scheme, resolve the shard's shape with --shape N,K instead)"
        )
    if Path(args.target).is_dir() or gguf:  # a checkpoint: one decision per layer
        from qscheme.checkpoint.resolve import resolve_command

        given = [
            flag
            for flag, value in (
                ("--shape", args.shape is not None),
                ("--partitions", args.partitions != 1),
                ("--scales-differ", args.scales_differ),
            )
            if value
        ]
        if given:
            raise UsageError(
                f"{' and '.join(given)}: not for a checkpoint folder ({args.target}), whose layers have their own "
                "shapes and partitions; drop them, or resolve a scheme name or descriptor file instead"
            )
        args.batch_sizes = parse_batch_sizes(args.m)
        args.m_split_override = registry.m_split_override(args.m_split, origin="--m-split")
        engine = parse_engine(args.engine)
        if engine is not None:
            from qscheme.cli.resolve_vllm import run_vllm

            return run_vllm(args, gguf)
        if args.tp is not None:
            if args.batch_sizes or args.m_split is not None:
                raise UsageError(
                    "--m and --m-split: not with --tp, whose report is per shard; resolve without --tp for the plans, "
                    "or with --engine vllm --tp N for vLLM's layers and their plans"
                )
            return run_tp(args, args.target)
        return resolve_command(args)
    batch_sizes = parse_batch_sizes(args.m)
    n, k = parse_shape(args.shape)
    if args.scales_differ and args.partitions < 2:
        raise UsageError("--scales-differ needs --partitions 2 or more: one partition has one scale")
    try:
        problem = Problem(
            n,
            k,
            args.dtype,
            partitions=args.partitions,
            partition_scales_differ=args.scales_differ,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    scheme = load_scheme(args.target)
    device = registry.device_for(args.device)
    m_split = registry.m_split_override(args.m_split, origin="--m-split")
    resolution = registry.resolve_layer(scheme, problem, device, args.kernel, m_split=m_split)
    failures = registry.plugin_failures()
    hint = registry.hint_for(resolution)
    declarations = registry.declarations()
    if args.json:
        print_json(resolution_json(resolution, failures, hint, declarations, batch_sizes))
    else:
        sys.stdout.write(render_resolution(resolution, failures, hint, declarations, batch_sizes) + "\n")
    return 0 if resolution.resolved else 1
