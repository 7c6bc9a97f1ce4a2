"""`qscheme kernels [--device D] [--json]`: every declared kernel and whether it can run here.

A kernel is "available" only when everything else admits it and its implementation imports
(with ``prepare`` and ``apply``): the implementations of such kernels are imported here, once,
and a failure is shown as the reason, exactly as `resolve` and `run` then reject the kernel.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from qscheme.cli.output import print_json, table
from qscheme.kernels import registry
from qscheme.kernels.declaration import KernelDeclaration
from qscheme.kernels.devices import DEVICE_CHOICES, DeviceFacts
from qscheme.kernels.resolver import check_device


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "kernels",
        help="list the declared kernels and whether each can run on a device",
        description="List the declared kernels and whether each can run on a device. QSCHEME_KERNEL forces "
        "one kernel and QSCHEME_DISABLED_KERNELS disables some, for `resolve` and `run`.",
    )
    parser.add_argument(
        "--device",
        choices=DEVICE_CHOICES,
        default=None,
        help="the device to judge against: cpu, cuda (the real GPU) or a simulated smXY (default: probe); "
        "only declarations are judged, so any GPU can be simulated",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.set_defaults(handler=run)


def kernel_record(declaration: KernelDeclaration, device: DeviceFacts, unavailable: dict[str, str]) -> dict[str, Any]:
    reason = check_device(declaration, device, unavailable)
    return {**declaration.as_json(), "available": not reason, "reason": reason or None}


def _details(record: dict[str, Any]) -> list[str]:
    needs = [f"module {m}" for m in record["requires_modules"]]
    needs += list(record.get("requires_versions") or ())
    needs += [f"torch.{f}" for f in record["torch_features"]]
    needs += record["checks"]
    lines = [f"{record['name']} ({record['provider']}, priority {record['priority']}, plugin {record['plugin']})"]
    if record["description"]:
        lines.append(f"  {record['description']}")
    for index, supports in enumerate(record["supports"]):
        lines.append(f"  {'implements:' if index == 0 else '           '} {supports}")
    lines.append(f"  runs on:    {'; '.join(record['devices'])}")
    if needs:
        lines.append(f"  needs:      {'; '.join(needs)}")
    lines.append(f"  code:       {record['implementation'] or 'declared only (no implementation yet)'}")
    for index, note in enumerate(record.get("notes") or ()):
        lines.append(f"  {'notes:' if index == 0 else '      '}      {note}")
    return lines


def run(args: argparse.Namespace) -> int:
    device = registry.device_for(args.device)
    declarations = registry.declarations()
    unavailable = registry.verified_failures(declarations, device)
    records = [kernel_record(d, device, unavailable) for d in declarations]
    failures = registry.plugin_failures()
    if args.json:
        print_json(records)
        return 0
    out = [f"device: {device.describe()}"]
    out.extend(f"note: {note}" for note in device.notes)
    rows = [
        [
            r["name"],
            r["provider"],
            str(r["priority"]),
            r["plugin"],
            "yes" if r["available"] else "no",
            r["reason"] or "-",
        ]
        for r in records
    ]
    out.extend(["", table(rows, ["kernel", "provider", "priority", "plugin", "available", "why not"]), ""])
    for record in records:
        out.extend([*_details(record), ""])
    out.append(f"{len(records)} kernels")
    if failures:
        out.append(f"{len(failures)} plugin failure(s): see `qscheme plugins`")
    sys.stdout.write("\n".join(out) + "\n")
    return 0
