"""Where a model runs: its device, its precision and its parallel layout, checked in one place.

The trainer, `trainer.eval`, `python -m ckpt reshape` / `import-hf` and the process-group setup
all ask these functions (torch alone, no megatron-core), so a layout or device is refused with the
same words wherever it comes from. Problems come back as lists of one-line messages; each caller
raises them as its own error type (`UserError` in the trainer, `ReshapeError` in ckpt).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "bf16", "fp32")


class PlacementError(ValueError):
    """A device, precision or layout that cannot be used; the message names the setting."""


@dataclass(frozen=True)
class Layout:
    """How a model's ranks are laid out: tensor (tp), context (cp) and pipeline (pp) parallel
    sizes, model chunks per pipeline stage (vpp, 1: no interleaving), the data-parallel replicas
    that take the remaining ranks (dp), and whether the optimizer state is sharded over them.

    Ranks follow megatron's order, TP fastest and PP slowest:
    rank = tp_rank + tp x (cp_rank + cp x (dp_rank + dp x pp_rank)).
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    distributed_optimizer: bool = False

    @property
    def model_parallel(self) -> int:
        """Ranks holding one copy of the model (every rank of one data-parallel replica)."""
        return self.tp * self.cp * self.pp

    @property
    def world_size(self) -> int:
        return self.model_parallel * self.dp

    def ranks(self, tp_rank: int, pp_rank: int) -> list[int]:
        """Every rank holding TP rank `tp_rank` of stage `pp_rank` (its CP and DP replicas)."""
        return [tp_rank + self.tp * (c + self.cp * (d + self.dp * pp_rank))
                for d in range(self.dp) for c in range(self.cp)]

    def describe(self) -> str:
        extra = "".join(f" {n.upper()}={v}" for n, v in (("vpp", self.vpp), ("cp", self.cp),
                                                         ("dp", self.dp)) if v > 1)
        return (f"TP={self.tp} PP={self.pp}{extra} distributed_optimizer="
                f"{str(self.distributed_optimizer).lower()}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> Layout:
        """A saved layout; keys it lacks take their defaults (`vpp: None` is 1)."""
        known = {k: v for k, v in saved.items() if k in cls.__dataclass_fields__}
        known["vpp"] = known.get("vpp") or 1
        return cls(**known)


def layout_problems(tp: int, cp: int = 1, pp: int = 1, vpp: int | None = 1, *,
                    num_layers: int | None = None, seq_length: int | None = None,
                    world_size: int | None = None,
                    name: Callable[[str], str] = "parallel.{}".format) -> list[str]:
    """What keeps a model of `num_layers` layers from running at these sizes on `world_size`
    ranks with sequences of `seq_length` (each None: not checked); empty when it fits. `name`
    spells a setting as the caller's user typed it (`--target-pp`)."""
    vpp = vpp or 1
    low = [f"{name(k)}={v} must be at least 1" for k, v in (("tp", tp), ("cp", cp), ("pp", pp),
                                                            ("vpp", vpp)) if v < 1]
    if low:
        return low
    problems = []
    if vpp > 1 and pp == 1:
        problems.append(f"{name('vpp')}={vpp} interleaves pipeline stages: it needs {name('pp')}"
                        f" > 1 (or set {name('vpp')}=null)")
    stages = f"{name('pp')} ({pp})" if vpp == 1 else \
        f"{name('pp')} x {name('vpp')} ({pp} x {vpp})"
    if num_layers is not None and num_layers % (pp * vpp):
        problems.append(f"model.num_layers ({num_layers}) is not divisible by {stages}: every "
                        "pipeline stage holds as many layers")
    # Only context parallelism cares about parity: each CP rank holds pieces r and 2N-1-r of
    # every sequence (load balance for causal attention). Without CP any length works.
    if cp > 1 and seq_length is not None and seq_length % (2 * cp):
        problems.append(f"trainer.seq_length ({seq_length}) must be divisible by 2 x "
                        f"{name('cp')} ({cp}): each CP rank holds two of the 2 x cp pieces of "
                        "a sequence")
    if world_size is not None and world_size % (tp * cp * pp):
        problems.append(f"the number of processes ({world_size}) must be a multiple of "
                        f"{name('tp')} x {name('cp')} x {name('pp')} ({tp} x {cp} x {pp}); the "
                        "rest is data parallelism: change them or torchrun's --nproc-per-node")
    return problems


def resolve_device(choice: str) -> torch.device:
    """`auto` picks CUDA when present; `cuda` without a GPU is an error, not a silent fallback."""
    if choice not in DEVICES:
        raise PlacementError(f"trainer.device={choice!r}: choose auto, cpu or cuda")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise PlacementError("trainer.device=cuda but no CUDA device is visible; use "
                             "trainer.device=cpu")
    return torch.device(choice)


def uses_bf16(precision: str, device: torch.device) -> bool:
    """`trainer.precision`: `auto` is bf16 on a GPU and fp32 on the CPU."""
    if precision not in PRECISIONS:
        raise PlacementError(f"trainer.precision={precision!r}: choose auto, bf16 or fp32")
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")
