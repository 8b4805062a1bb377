"""Where one chunk of a candidate plan keeps its state: a typed placement, priced by the cost model.

A :class:`ChunkPlacement` pairs the two :class:`~elixir.plan.Placement` values of a
:class:`~elixir.plan.ChunkPlan` (its compute shard's and its optimizer state's) with
whether the chunk is replicated or a ZeRO-1/2 chunk. Reports and ``info["runner_ups"]`` spell it as
a two-letter code, shard then optimizer state, with D for device, H for host, K for disk, R for a
replicated chunk's payload and 1 / 2 for a ZeRO-1 / ZeRO-2 chunk's (whole parameters, always on
the device): ``DD``, ``DH``, ``HH``, ``DK``, ``HK``, ``HD``, ``RD``, ``RH``, ``2D``, ``1H``, and
``KK`` (the whole chunk on disk: its shard is read for every gather and rewritten by every step).
The code is only a spelling: code that decides reads the fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from elixir.plan.plan import ChunkPlan, Placement, Sharding, placement_problem

_LETTER = {Placement.DEVICE: "D", Placement.HOST: "H", Placement.DISK: "K"}
_FROM_LETTER = {v: k for k, v in _LETTER.items()}


@dataclass(frozen=True)
class ChunkPlacement:
    """Where one chunk keeps its state between uses.

    Attributes:
        shard: where this rank's compute-dtype shard lives (a replicated chunk's whole payload:
            always :attr:`Placement.DEVICE`).
        optim: where the fp32 master and the optimizer state live.
        replicated: the chunk is whole on every rank (its gradient all-reduced), not sharded.
        zero: 1 or 2 for a ZeRO-1/2 chunk (parameters whole on every rank, master and optimizer
            state split: :class:`~elixir.plan.Sharding`), 0 otherwise.
    """

    shard: Placement
    optim: Placement
    replicated: bool = False
    zero: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "shard", Placement(self.shard))
        object.__setattr__(self, "optim", Placement(self.optim))
        if self.zero not in (0, 1, 2) or (self.zero and self.replicated):
            raise ValueError(f"zero must be 0, 1 or 2 and excludes replicated, got zero={self.zero!r}")
        problem = placement_problem(self.sharding, self.shard, self.optim)
        if problem:
            raise ValueError(problem)

    @property
    def sharded(self) -> bool:
        """The parameters are split and gathered for use (ZeRO-3)."""
        return not self.replicated and not self.zero

    @property
    def sharding(self) -> Sharding:
        """The plan's :class:`~elixir.plan.Sharding` of a chunk so placed."""
        if self.replicated:
            return Sharding.REPLICATED
        return {0: Sharding.SHARDED, 1: Sharding.ZERO1, 2: Sharding.ZERO2}[self.zero]

    @property
    def code(self) -> str:
        """The two-letter spelling used in reports (``"DK"``, ``"RH"``, ``"2D"``)."""
        head = "R" if self.replicated else (str(self.zero) if self.zero else _LETTER[self.shard])
        return head + _LETTER[self.optim]

    @property
    def shard_on_disk(self) -> bool:
        """The compute shard lives on disk too (read for every gather)."""
        return self.shard is Placement.DISK

    @property
    def on_disk(self) -> bool:
        """The master and optimizer state live on disk."""
        return self.optim is Placement.DISK

    def __str__(self) -> str:
        return self.code

    @classmethod
    def from_code(cls, code: str) -> ChunkPlacement:
        """The placement a two-letter code spells (see the module docstring)."""
        if len(code) != 2 or code[0] not in "DHKR12" or code[1] not in _FROM_LETTER:
            raise ValueError(f"unknown chunk placement code {code!r}; expected e.g. 'DD', 'HK', 'RH' or '2D'")
        if code[0] == "R":
            return cls(Placement.DEVICE, _FROM_LETTER[code[1]], replicated=True)
        if code[0] in "12":
            return cls(Placement.DEVICE, _FROM_LETTER[code[1]], zero=int(code[0]))
        return cls(_FROM_LETTER[code[0]], _FROM_LETTER[code[1]])

    @classmethod
    def of(cls, chunk: ChunkPlan) -> ChunkPlacement:
        """The placement of a plan's chunk."""
        if chunk.sharding in (Sharding.ZERO1, Sharding.ZERO2):
            return cls(Placement.DEVICE, chunk.optim_placement, zero=chunk.sharding.stage)
        if not chunk.sharded:
            return cls(Placement.DEVICE, chunk.optim_placement, replicated=True)
        return cls(chunk.shard_placement, chunk.optim_placement)


DD = ChunkPlacement(Placement.DEVICE, Placement.DEVICE)
DH = ChunkPlacement(Placement.DEVICE, Placement.HOST)
HH = ChunkPlacement(Placement.HOST, Placement.HOST)
DK = ChunkPlacement(Placement.DEVICE, Placement.DISK)
HK = ChunkPlacement(Placement.HOST, Placement.DISK)
KK = ChunkPlacement(Placement.DISK, Placement.DISK)
HD = ChunkPlacement(Placement.HOST, Placement.DEVICE)  # only priced for given plans
RD = ChunkPlacement(Placement.DEVICE, Placement.DEVICE, replicated=True)
RH = ChunkPlacement(Placement.DEVICE, Placement.HOST, replicated=True)

SHARDED_PLACEMENTS = (DD, DH, HH, DK, HK, KK)  # what the search chooses from for a sharded chunk
