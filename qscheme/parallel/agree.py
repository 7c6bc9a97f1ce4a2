"""Ranks agree on one plan before they communicate: a checksum of each rank's plan, all-gathered.

Ranks that split the model differently (another tp_plan, fuse or ignore list, another copy of
the checkpoint) would pair their all-reduces wrongly: rank 0's o_proj reduction meets rank 1's
down_proj, and every rank returns wrong logits without an error. So each rank hashes what
decides its communication (every layer's name, scheme, style, full and shard shapes, each
tensor's split, tp_size; the plain tensors; for a model, the plain Linear modules it splits)
and the ranks all-gather the hashes, one small tensor, over the process group. Ranks whose hash
differs from another's, or that failed before getting there, make every rank raise
PlanMismatchError naming them, before any layer runs.

A rank that fails while loading still takes part (it sends a failure flag, then raises its own
error), so that the others raise too instead of waiting for it until the group's timeout.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from qscheme.errors import CheckpointError

if TYPE_CHECKING:
    from qscheme.parallel.plan import LayerShard

DIGEST_WORDS = 4  # a sha256 digest as four int64 words
FAILED, AGREED = 1, 0


class PlanMismatchError(CheckpointError):
    """Tensor-parallel ranks hold different plans (or some failed to load): every rank refuses.

    ``groups`` maps each plan's short checksum (``"failed"`` for ranks that raised while
    loading) to the ranks holding it; ``differing`` lists the ranks outside the largest group.
    """

    def __init__(self, what: str, groups: dict[str, tuple[int, ...]], tp_rank: int) -> None:
        self.groups = groups
        ordered = sorted(groups.items(), key=lambda item: (item[0] == "failed", -len(item[1]), item[1]))
        majority = ordered[0][1] if ordered[0][0] != "failed" else ()
        self.differing = tuple(sorted(rank for _, ranks in ordered for rank in ranks if rank not in majority))
        parts = []
        for checksum, ranks in ordered:
            who = _ranks(ranks)
            verb = "failed while loading (see its own error)" if checksum == "failed" else f"holds plan {checksum}"
            if len(ranks) > 1:
                verb = verb.replace("holds", "hold").replace("its own", "their own")
            parts.append(f"{who} {verb}")
        differ = f"{_ranks(self.differing)} {'differs' if len(self.differing) == 1 else 'differ'}"
        super().__init__(
            f"{what}: the {sum(len(r) for r in groups.values())} tensor-parallel ranks do not hold the same plan "
            f"({'; '.join(parts)}; this is rank {tp_rank}); {differ}. "
            "Their all-reduces would pair different layers and give wrong outputs, so every rank refuses. Fix: "
            "load the same checkpoint files on every rank with the same tp_plan, fuse and fuse_policy, and build "
            "the same model"
        )


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def plan_digest(
    tp_size: int, shards: dict[str, LayerShard], plain: Sequence[str], extra: Sequence[object] = ()
) -> bytes:
    """A sha256 over what decides a rank's communication (not its rank, nor its slice's bytes)."""
    layers = [shard.as_json() for _, shard in sorted(shards.items())]
    record = {"tp_size": tp_size, "layers": layers, "plain": sorted(plain), "extra": list(extra)}
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).digest()


def group_matches(tp_rank: int, tp_size: int) -> bool:
    """Whether the default process group is this tensor-parallel group (the ranks can compare plans)."""
    if tp_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return False
    return (dist.get_rank(), dist.get_world_size()) == (tp_rank, tp_size)


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _exchange(digest: bytes | None, tp_size: int) -> list[tuple[int, bytes]]:
    """All-gather (flag, digest) of every rank."""
    words = torch.zeros(DIGEST_WORDS + 1, dtype=torch.int64)
    if digest is None:
        words[0] = FAILED
    else:
        words[1:] = torch.frombuffer(bytearray(digest), dtype=torch.int64)
    device = _device()
    gathered = [torch.empty_like(words, device=device) for _ in range(tp_size)]
    dist.all_gather(gathered, words.to(device))
    out = []
    for value in gathered:
        value = value.cpu()
        out.append((int(value[0]), value[1:].numpy().tobytes()))
    return out


def agree(what: str, digest: bytes | None, tp_rank: int, tp_size: int) -> None:
    """Exchange this rank's plan checksum (None: this rank failed) with the others; PlanMismatchError
    on every rank unless all hold the same plan. Nothing is exchanged outside a matching group."""
    if not group_matches(tp_rank, tp_size):
        return
    groups: dict[str, list[int]] = {}
    for rank, (flag, words) in enumerate(_exchange(digest, tp_size)):
        key = "failed" if flag == FAILED else words.hex()[:12]
        groups.setdefault(key, []).append(rank)
    if digest is None:
        return  # this rank raises its own error
    if len(groups) > 1:
        raise PlanMismatchError(what, {key: tuple(ranks) for key, ranks in groups.items()}, tp_rank)


@contextmanager
def failures_shared(what: str, tp_rank: int, tp_size: int, enabled: bool = True) -> Iterator[Callable[[bytes], None]]:
    """Run a rank's loading; yield ``done(digest)`` to call once its plan is known. An error raised
    before ``done`` is announced to the other ranks (so they raise instead of waiting), then re-raised."""
    state = {"agreed": False}

    def done(digest: bytes) -> None:
        state["agreed"] = True
        if enabled:
            agree(what, digest, tp_rank, tp_size)

    try:
        yield done
    except Exception:
        if enabled and not state["agreed"]:
            try:
                agree(what, None, tp_rank, tp_size)
            except Exception:  # the group itself fails: the rank's own error is the one to show
                pass
        raise
