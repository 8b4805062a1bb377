"""The plan: plain, typed data that a search produces and the runtime executes.

A plan never holds tensors and is never tied to a device. It is saved and loaded as JSON, so a plan
made on a laptop for a cluster can be inspected, edited and shipped.

Vocabulary:
- a **chunk** is a flat buffer holding several trainable parameters, packed in order; every chunk of
  a plan has the same capacity ``chunk_size`` (elements), a multiple of the world size;
- a chunk's **sharding** (:class:`Sharding`) says what of it is split across the ranks: a
  **sharded** chunk (ZeRO-3) is split evenly, each rank keeping ``chunk_size // world_size``
  elements of everything; a **replicated** chunk (tied, shared or tiny parameters) is kept whole
  on every rank; a **zero2** / **zero1** chunk keeps its parameters whole on every rank but splits
  its fp32 master and optimizer state (ZeRO-2 reduce-scatters its gradient, ZeRO-1 all-reduces it),
  and all-gathers the updated parameters after each step. One plan may mix them;
- the **rCache** is a pool of ``cache_blocks`` full-size blocks into which sharded chunks are gathered
  for compute, and released after;
- a chunk's **shard placement** says where its compute-dtype shard lives between uses, and its
  **optimizer placement** where its fp32 master shard and optimizer state live;
- a **frozen chunk** packs parameters with ``requires_grad=False`` only (never mixed with trainable
  ones): it holds the compute-dtype weights and nothing else (no gradient buffer, no fp32 master,
  no optimizer state), is gathered before use and released after like any sharded chunk, and is
  never reduced; on disk its shard is read for each gather and never written back. Frozen chunks are listed apart (``SearchResult.frozen_chunks``); their
  ``optim_placement`` holds nothing (device, or disk beside a disk shard, as every chunk plan must).
"""

from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from elixir.fileio import atomic_write_json, read_json, require_version
from elixir.plan.mesh import MeshLayout
from elixir.plan.state_format import check_frozen_format, check_state_formats

PLAN_FORMAT_VERSION = 1
"""The version of the plan's JSON format that `SearchResult.save` writes and `load` reads."""


class Placement(str, enum.Enum):
    """Where a piece of chunk state lives between uses."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


# dtypes a chunk (trainable or frozen) can hold
CHUNKABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The parameter dtypes a chunk may hold."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the spelling plans use)."""
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported chunk dtype {dtype}; use one of {sorted(_DTYPES)}")


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype a plan names (``"bfloat16"`` -> ``torch.bfloat16``); ``ValueError`` for others."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} in plan; expected one of {sorted(_DTYPES)}") from None


class Sharding(str, enum.Enum):
    """What of a chunk is split across the data-parallel ranks, and so which collectives it costs.

    ========== ============ =============== ======================= =============================
    sharding   parameters   gradient        fp32 master + optimizer  collectives per step
    ========== ============ =============== ======================= =============================
    sharded    split        reduce-scatter  split                   all-gather per use, RS
    zero2      whole        reduce-scatter  split                   RS, all-gather after the step
    zero1      whole        all-reduce      split                   AR, all-gather after the step
    replicated whole        all-reduce      whole                   AR
    ========== ============ =============== ======================= =============================

    ``sharded`` is ZeRO-3 (the rCache gathers it for compute and releases it after); the others
    keep their compute-dtype parameters resident on the device, so they are never gathered for
    use. ``zero2`` and ``zero1`` differ only in how the gradient is reduced: a reduce-scatter
    moves half the bytes of an all-reduce on a ring, but some backends (gloo) all-reduce faster.
    """

    SHARDED = "sharded"
    ZERO2 = "zero2"
    ZERO1 = "zero1"
    REPLICATED = "replicated"

    @property
    def params_sharded(self) -> bool:
        """The compute-dtype parameters are split (gathered for each use): ZeRO-3."""
        return self is Sharding.SHARDED

    @property
    def state_sharded(self) -> bool:
        """The fp32 master, the reduced gradient and the optimizer state are split."""
        return self is not Sharding.REPLICATED

    @property
    def reduce_scatters(self) -> bool:
        """The gradient is reduce-scattered (else all-reduced)."""
        return self in (Sharding.SHARDED, Sharding.ZERO2)

    @property
    def stage(self) -> int:
        """The ZeRO stage (0 for replicated: plain data parallel)."""
        return {Sharding.SHARDED: 3, Sharding.ZERO2: 2, Sharding.ZERO1: 1, Sharding.REPLICATED: 0}[self]

    @classmethod
    def of(cls, value: Sharding | str | bool) -> Sharding:
        """A sharding from its name, or from the older boolean ``sharded`` (True: sharded, False: replicated)."""
        if isinstance(value, bool):
            return cls.SHARDED if value else cls.REPLICATED
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown chunk sharding {value!r}; expected one of {[k.value for k in cls]}") from None


def placement_problem(sharding: Sharding, shard: Placement, optim: Placement, frozen: bool = False) -> Optional[str]:
    """What is wrong with a chunk placed so, or None: the one rule the plan, the runtime's chunk
    spec and the search's candidates share.

    - a compute shard on disk is read for each gather and rewritten by each step, which needs the
      fp32 master staged beside it: only a sharded chunk with its optimizer state on disk too (or
      a frozen one, read-only and never rewritten) can have one;
    - a chunk whose parameters are whole (ZeRO-1/2, replicated) keeps them on the device, so its
      shard placement is the device.
    """
    if shard is Placement.DISK and not (sharding.params_sharded and (optim is Placement.DISK or frozen)):
        return (f"a disk shard_placement needs a sharded chunk with optim_placement 'disk' (got sharding "
                f"{sharding.value!r}, optim_placement {optim.value!r}); put the optimizer state on disk too, "
                "or the shard on the host")
    if not sharding.params_sharded and shard is not Placement.DEVICE:
        return (f"a {sharding.value} chunk keeps its parameters whole on the device: shard_placement must be "
                f"'device', got {shard.value!r} (use sharding 'sharded' to place parameter shards on the host)")
    return None


class ShardedBy:
    """The shorthands of a chunk that has a ``sharding`` (a plan's :class:`ChunkPlan`, the
    runtime's ``ChunkSpec``): one definition of what each sharding splits."""

    sharding: Sharding

    @property
    def sharded(self) -> bool:
        """The compute-dtype parameters are split across ranks and gathered for each use (ZeRO-3)."""
        return self.sharding.params_sharded

    @property
    def state_sharded(self) -> bool:
        """The fp32 master, the reduced gradient and the optimizer state are this rank's part only."""
        return self.sharding.state_sharded


@dataclass(frozen=True)
class ChunkPlan(ShardedBy):
    """One chunk: which parameters it packs, in order, and where its state lives.

    Attributes:
        params: parameter names (``module.named_parameters()`` paths) in packing order.
        shapes: the shape of each parameter, for validation against the model.
        chunk_size: capacity in elements (padding included); a multiple of the world size when
            any of its state is split (every sharding but replicated).
        dtype: compute dtype of the chunk (``"float32"``, ``"bfloat16"``, ``"float16"``).
        sharding: what is split across ranks (:class:`Sharding`); the older boolean ``sharded``
            (True: ``SHARDED``, False: ``REPLICATED``) and the sharding's name are accepted too.
        shard_placement: where this rank's compute-dtype shard lives between uses (a sharded
            chunk's; the others keep their parameters whole on the device). ``DISK`` (read for
            each gather, rewritten by each step) needs a sharded chunk whose optimizer state is
            on disk too: the step that rewrites the shard then has its master staged.
        optim_placement: where the fp32 master (this rank's part) and optimizer state live.
    """

    params: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    chunk_size: int
    dtype: str = "float32"
    sharding: Sharding = Sharding.SHARDED
    shard_placement: Placement = Placement.DEVICE
    optim_placement: Placement = Placement.DEVICE

    def __post_init__(self) -> None:
        object.__setattr__(self, "sharding", Sharding.of(self.sharding))
        # a replicated chunk's parameters are whole on the device whatever a plan says (plans made
        # before per-chunk sharding carried the sharded chunks' placement on every chunk)
        shard = Placement.DEVICE if self.sharding is Sharding.REPLICATED else Placement(self.shard_placement)
        object.__setattr__(self, "shard_placement", shard)
        object.__setattr__(self, "optim_placement", Placement(self.optim_placement))
        problem = placement_problem(self.sharding, self.shard_placement, self.optim_placement)
        if problem:
            raise ValueError(f"chunk of {self.params[:1]}...: {problem}")

    @property
    def numels(self) -> tuple[int, ...]:
        out = []
        for s in self.shapes:
            n = 1
            for d in s:
                n *= d
            out.append(n)
        return tuple(out)

    @property
    def used(self) -> int:
        """Elements holding parameters (the rest is padding)."""
        return sum(self.numels)

    def shard_size(self, world_size: int) -> int:
        """Elements of this rank's compute-dtype parameters (a shard, or the whole chunk)."""
        return self.chunk_size // world_size if self.sharded else self.chunk_size

    def state_size(self, world_size: int) -> int:
        """Elements of this rank's fp32 master, gradient and optimizer state."""
        return self.chunk_size // world_size if self.state_sharded else self.chunk_size

    def with_sharding(self, sharding: Sharding | str, world_size: int) -> ChunkPlan:
        """This chunk with ``sharding``: capacity rounded up to a multiple of ``world_size`` when
        it splits state, the shard placement reset to the device when it keeps parameters whole."""
        sharding = Sharding.of(sharding)
        size = self.chunk_size
        if sharding.state_sharded and size % world_size:
            size += world_size - size % world_size
        place = self.shard_placement if sharding.params_sharded else Placement.DEVICE
        return dataclasses.replace(self, sharding=sharding, chunk_size=size, shard_placement=place)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["sharding"] = self.sharding.value
        d["sharded"] = self.sharded  # for readers of plans written before per-chunk sharding
        d["shard_placement"] = self.shard_placement.value
        d["optim_placement"] = self.optim_placement.value
        d["params"] = list(self.params)
        d["shapes"] = [list(s) for s in self.shapes]
        return d

    @classmethod
    def from_json(cls, d: dict) -> ChunkPlan:
        return cls(
            params=tuple(d["params"]),
            shapes=tuple(tuple(int(x) for x in s) for s in d["shapes"]),
            chunk_size=int(d["chunk_size"]),
            dtype=d.get("dtype", "float32"),
            sharding=Sharding.of(d["sharding"] if "sharding" in d else bool(d.get("sharded", True))),
            shard_placement=Placement(d.get("shard_placement", "device")),
            optim_placement=Placement(d.get("optim_placement", "device")),
        )


@dataclass(frozen=True)
class Prediction:
    """What a search predicts for its plan (bytes per rank; seconds per training step)."""

    peak_device_bytes: int = 0
    peak_host_bytes: int = 0
    peak_disk_bytes: int = 0
    step_time_s: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class SearchResult:
    """A complete plan for one model on one mesh layout.

    Attributes:
        chunks: the ordered chunks of trainable parameters.
        frozen_chunks: the chunks of frozen parameters (``requires_grad=False``), packed apart
            (see the module docstring); they share the rCache with the sharded trainable chunks.
        world_size: the ranks each chunk is sharded over: the ``dp_shard`` axis of ``layout``
            (the whole world for plain data parallelism).
        layout: the mesh layout the plan is for (:class:`~elixir.plan.mesh.MeshLayout`); when not
            given, plain data parallelism over ``world_size`` ranks. The runtime refuses the plan
            on another layout.
        cache_blocks: number of full-size blocks in the rCache (the redundancy).
        prefetch_depth: how many chunks ahead the runtime may gather (0: on demand).
        frozen_params: parameters with ``requires_grad=False`` kept out of chunks and left as they are
            (whole on every rank): those of dtypes chunks cannot hold, or every frozen parameter
            in a plan made without frozen chunks.
        param_order: traced per-step parameter-name sets (tracer's ``params_per_step``), or None.
        search: which search produced the plan.
        prediction: the search's predictions, if it made any.
        info: free-form extra data (waste statistics, search time, the traced setting, ...).
        grad_dtype: dtype of the reduced shard gradients kept until the optimizer steps
            (``"float32"``, or ``"bfloat16"``/``"float16"`` for half the bytes).
        fused_step: step each chunk's optimizer as soon as its gradient is reduced, during
            backward, and free the gradient then (so the shard gradients of all chunks never
            exist at once); the optimizer falls back to a separate step, with its reason, where
            something needs every gradient first (clipping, fp16 overflow checks).
        master_format, moments_format: the optimizer-state formats the plan was searched with
            (:mod:`elixir.plan.state_format`), or None when the plan records none: the runtime then
            takes the formats of the ``MixedPrecisionPolicy`` it is given.
        frozen_format: the format the frozen chunks' shards were priced in (``"nf4"``, ``"int8"``,
            :mod:`elixir.chunk.quant`), or None when the plan records none: the runtime then takes
            the policy's ``frozen``.
    """

    chunks: tuple[ChunkPlan, ...]
    world_size: int
    cache_blocks: int
    prefetch_depth: int = 0
    frozen_params: tuple[str, ...] = ()
    frozen_chunks: tuple[ChunkPlan, ...] = ()
    param_order: Optional[tuple[tuple[str, ...], ...]] = None
    search: str = "manual"
    prediction: Optional[Prediction] = None
    info: dict[str, Any] = field(default_factory=dict)
    grad_dtype: str = "float32"
    fused_step: bool = False
    layout: Optional[MeshLayout] = None
    master_format: Optional[str] = None
    moments_format: Optional[str] = None
    frozen_format: Optional[str] = None

    def __post_init__(self) -> None:
        if self.layout is None:
            object.__setattr__(self, "layout", MeshLayout.data_parallel(self.world_size))
        elif self.layout.dp_shard != self.world_size:
            raise ValueError(
                f"plan world_size {self.world_size} is not the dp_shard axis of its layout ({self.layout.describe()}): "
                "world_size counts the ranks a chunk is sharded over"
            )
        if self.grad_dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"plan grad_dtype must be float32, float16 or bfloat16, got {self.grad_dtype!r}")
        if (self.master_format is None) != (self.moments_format is None):
            raise ValueError("a plan records both master_format and moments_format, or neither")
        if self.master_format is not None:
            check_state_formats(self.master_format, self.moments_format, where="plan")
        check_frozen_format(self.frozen_format, where="plan")

    # ---- derived views (pure functions of the data) ----

    @property
    def chunk_size(self) -> int:
        """Capacity of the sharded trainable chunks (0 when every chunk is replicated)."""
        sizes = {c.chunk_size for c in self.chunks if c.sharded}
        return max(sizes) if sizes else 0

    @property
    def all_chunks(self) -> tuple[ChunkPlan, ...]:
        """Trainable then frozen chunks (the runtime's chunk indices)."""
        return (*self.chunks, *self.frozen_chunks)

    @property
    def block_size(self) -> int:
        """Elements of one rCache block: the largest sharded chunk, trainable or frozen."""
        return max((c.chunk_size for c in self.all_chunks if c.sharded), default=0)

    @property
    def sharding_counts(self) -> dict[str, int]:
        """How many chunks of each sharding (``{"sharded": 5, "zero2": 3}``), for reports."""
        out: dict[str, int] = {}
        for c in self.chunks:
            out[c.sharding.value] = out.get(c.sharding.value, 0) + 1
        return out

    @property
    def param_names(self) -> list[str]:
        return [n for c in self.chunks for n in c.params]

    def waste(self) -> float:
        """Padding as a fraction of all chunk capacity (sharded and replicated)."""
        cap = sum(c.chunk_size for c in self.chunks)
        return 0.0 if cap == 0 else 1.0 - sum(c.used for c in self.chunks) / cap

    def shard_bytes_per_rank(self, element_size: int) -> int:
        """Bytes of this rank's compute-dtype shards, trainable and frozen (chunks whose parameters
        are whole count whole)."""
        return sum(c.shard_size(self.world_size) for c in self.all_chunks) * element_size

    def frozen_shard_bytes_per_rank(self, element_size: int) -> int:
        """Bytes of this rank's frozen-chunk shards (all a frozen chunk costs between uses)."""
        return sum(c.shard_size(self.world_size) for c in self.frozen_chunks) * element_size

    def cache_bytes(self, element_size: int) -> int:
        """Bytes of the rCache: ``cache_blocks`` blocks of :attr:`block_size`."""
        return self.cache_blocks * self.block_size * element_size

    # ---- JSON ----

    def to_json(self) -> dict:
        return {
            "format_version": PLAN_FORMAT_VERSION,
            "world_size": self.world_size,
            "layout": self.layout.to_json(),
            "cache_blocks": self.cache_blocks,
            "prefetch_depth": self.prefetch_depth,
            "search": self.search,
            "chunks": [c.to_json() for c in self.chunks],
            "frozen_params": list(self.frozen_params),
            "frozen_chunks": [c.to_json() for c in self.frozen_chunks],
            "param_order": None if self.param_order is None else [sorted(s) for s in self.param_order],
            "prediction": None if self.prediction is None else dataclasses.asdict(self.prediction),
            "info": self.info,
            "grad_dtype": self.grad_dtype,
            "fused_step": self.fused_step,
            **({} if self.master_format is None else
               {"master_format": self.master_format, "moments_format": self.moments_format}),
            **({} if self.frozen_format is None else {"frozen_format": self.frozen_format}),
        }

    @classmethod
    def from_json(cls, d: dict) -> SearchResult:
        require_version(d.get("format_version"), PLAN_FORMAT_VERSION, "plan format", "re-run the search with this version")
        pred = d.get("prediction")
        order = d.get("param_order")
        return cls(
            chunks=tuple(ChunkPlan.from_json(c) for c in d["chunks"]),
            world_size=int(d["world_size"]),
            cache_blocks=int(d["cache_blocks"]),
            prefetch_depth=int(d.get("prefetch_depth", 0)),
            frozen_params=tuple(d.get("frozen_params", ())),
            frozen_chunks=tuple(ChunkPlan.from_json(c) for c in d.get("frozen_chunks", ())),
            param_order=None if order is None else tuple(tuple(s) for s in order),
            search=d.get("search", "manual"),
            prediction=None if pred is None else Prediction(**pred),
            info=dict(d.get("info", {})),
            grad_dtype=d.get("grad_dtype", "float32"),
            fused_step=bool(d.get("fused_step", False)),
            master_format=d.get("master_format"),
            moments_format=d.get("moments_format"),
            frozen_format=d.get("frozen_format"),
            layout=MeshLayout.from_json(d["layout"]) if "layout" in d else None,  # plans before layouts: data parallel
        )

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON, atomically (a crash leaves any previous file intact)."""
        atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> SearchResult:
        return cls.from_json(read_json(path, "plan"))
