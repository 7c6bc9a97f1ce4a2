"""Which layers split which way: a tensor-parallel plan of module-name patterns -> style.

The default is the Llama layout every decoder engine uses: the attention's q/k/v and the MLP's
gate/up are column-parallel (each rank computes a slice of the outputs: its heads, its part of
the intermediate size), o_proj and down_proj are row-parallel (each rank contracts its slice of
K and the partial sums are all-reduced). Modules fused by the loader (``fuse=``) are split per
member so that q, k and v rows stay aligned; a projection the checkpoint stores already fused
(``STORED_FUSED_NAMES``) cannot be, and a column split of it is refused. A layer no pattern matches is
replicated: every rank loads all of it.

A user mapping replaces the default. Patterns are fnmatch wildcards matched against the full
module name or any trailing part of it (``"q_proj"``, ``"layers.*.mlp.down_proj"``); the first
matching entry wins. Values are ``column``, ``row`` or ``replicate`` (transformers' ``colwise``
and ``rowwise`` are accepted too).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from qscheme.checkpoint.plan import Plan
from qscheme.errors import UsageError
from qscheme.parallel.rules import STYLES, ShardError, ShardLayout, SplitProblem, Style, checked_style, shard_layout

DEFAULT_TP_PLAN: Mapping[str, Style] = {
    "q_proj": "column",
    "k_proj": "column",
    "v_proj": "column",
    "qkv_proj": "column",
    "gate_proj": "column",
    "up_proj": "column",
    "gate_up_proj": "column",
    "o_proj": "row",
    "down_proj": "row",
}
# Module names under which checkpoints store projections already fused into one tensor (q, k and
# v, or gate and up, concatenated along N). Cut into contiguous runs of N, rank 0 would get only
# q (or gate) rows: their partition sizes are the model's, not the checkpoint's, so a column
# split of such a stored tensor is refused; load q/k/v apart and fuse with ``fuse=`` instead.
STORED_FUSED_NAMES: frozenset[str] = frozenset(
    {"qkv_proj", "gate_up_proj", "query_key_value", "c_attn", "W_pack", "wqkv", "Wqkv"}
)
STYLE_ALIASES: Mapping[str, Style] = {
    "column": "column",
    "colwise": "column",
    "row": "row",
    "rowwise": "row",
    "replicate": "replicate",
    "replicated": "replicate",
}


@dataclass(frozen=True)
class TPPlan:
    """Ordered (pattern, style) entries; ``style_for`` gives a module's style (first match wins)."""

    entries: tuple[tuple[str, Style], ...]
    default: bool = False

    def style_for(self, module: str) -> Style:
        """The style of a module (full checkpoint name); ``replicate`` when no pattern matches."""
        for pattern, style in self.entries:
            if _matches(module, pattern):
                return style
        return "replicate"

    def fused_style(self, name: str, members: Sequence[str]) -> Style:
        """The style of a fused module: its own name's pattern if any matches, else its members'
        (which must agree; UsageError naming them otherwise)."""
        for pattern, style in self.entries:
            if _matches(name, pattern):
                return style
        styles = {member: self.style_for(member) for member in members}
        if len(set(styles.values())) > 1:
            shown = ", ".join(f"{member}: {style}" for member, style in styles.items())
            raise UsageError(
                f"tp_plan: the members of fused module {name} get different styles ({shown}); a fused module splits "
                f"one way: give {name.rpartition('.')[2]!r} its own entry in tp_plan"
            )
        return next(iter(styles.values()), "replicate")

    def as_json(self) -> dict[str, str]:
        return dict(self.entries)


def _matches(module: str, pattern: str) -> bool:
    """``pattern`` matches the whole name or a trailing run of its dotted parts."""
    if fnmatch.fnmatchcase(module, pattern):
        return True
    parts = module.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[i:]), pattern) for i in range(1, len(parts)))


def checked_tp_plan(tp_plan: object) -> TPPlan:
    """``tp_plan=`` as a TPPlan: None (the Llama default), a TPPlan, or a mapping pattern -> style."""
    if tp_plan is None:
        return TPPlan(tuple(DEFAULT_TP_PLAN.items()), default=True)
    if isinstance(tp_plan, TPPlan):
        return tp_plan
    example = "tp_plan={'q_proj': 'column', 'o_proj': 'row', 'lm_head': 'replicate'}"
    if not isinstance(tp_plan, Mapping):
        raise UsageError(
            f"tp_plan must map module-name patterns to a style ({', '.join(STYLES)}), e.g. {example}; "
            f"got a {type(tp_plan).__name__}: {tp_plan!r}"
        )
    entries: list[tuple[str, Style]] = []
    for pattern, style in tp_plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise UsageError(f"tp_plan: pattern {pattern!r} must be a non-empty module-name pattern, e.g. 'q_proj'")
        alias = STYLE_ALIASES.get(style) if isinstance(style, str) else None
        entries.append((pattern, alias if alias is not None else checked_style(style, f"tp_plan[{pattern!r}]")))
    return TPPlan(tuple(entries))


@dataclass(frozen=True)
class LayerShard:
    """One layer a rank builds: its style and each member's split (one member unless fused).

    ``shard_n`` / ``shard_k`` are the rank's layer sizes (a fused layer's N is its members'
    shard N summed, in member order, so q, k and v slices stay together on every rank).
    """

    name: str
    style: Style
    members: tuple[ShardLayout, ...]

    @property
    def tp_size(self) -> int:
        return self.members[0].tp_size

    @property
    def n(self) -> int:
        return sum(member.n for member in self.members)

    @property
    def k(self) -> int:
        return self.members[0].k

    @property
    def shard_n(self) -> int:
        return sum(member.shard_n for member in self.members)

    @property
    def shard_k(self) -> int:
        return self.members[0].shard_k

    def as_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "style": self.style,
            "n": self.n,
            "k": self.k,
            "shard_n": self.shard_n,
            "shard_k": self.shard_k,
            "members": [member.as_json() for member in self.members],
        }


def shard_layers(plan: Plan, tp_plan: TPPlan, tp_size: int) -> tuple[dict[str, LayerShard], list[SplitProblem]]:
    """Every layer of a checkpoint plan split ``tp_size`` ways, and the layers that cannot be.

    Layers whose layout is broken (``plan.problems``) are left out: load refuses them already.
    """
    shards: dict[str, LayerShard] = {}
    problems: list[SplitProblem] = []
    for name, members in plan.layers():
        layouts = [plan.layouts[member] for member in members]
        if not all(layout.ok for layout in layouts):
            continue
        style = tp_plan.style_for(name) if len(members) == 1 else tp_plan.fused_style(name, members)
        stored_fused = len(members) == 1 and name.rsplit(".", 1)[-1] in STORED_FUSED_NAMES
        if stored_fused and style == "column" and tp_size > 1:
            layout = layouts[0]
            problems.append(
                SplitProblem(
                    layout.module,
                    layout.scheme.name,
                    style,
                    "N",
                    layout.n,
                    tp_size,
                    "the checkpoint stores this projection already fused (its partitions concatenated along N), "
                    "and a contiguous split would give each rank other partitions' rows; store q/k/v (gate/up) "
                    "apart and fuse them with fuse=, or map the layer to 'replicate' in tp_plan",
                    (1,),
                )
            )
            continue
        split: list[ShardLayout] = []
        for layout in layouts:
            stored = {short: info.shape for short, info in layout.declared.items()}
            try:
                split.append(
                    shard_layout(
                        layout.scheme, layout.n, layout.k, style, tp_size, layer=layout.module, stored_shapes=stored
                    )
                )
            except ShardError as error:
                problems.extend(error.problems)
        if len(split) == len(layouts):
            shards[name] = LayerShard(name, style, tuple(split))
    return shards, problems
