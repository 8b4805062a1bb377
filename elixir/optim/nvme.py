"""NVMe offload of an optimizer's own state: Adam's moments in files, stepped through a pipeline.

``CPUAdam(params, nvme_offload_fraction=f, nvme_offload_dir=d)`` keeps the moments
(``exp_avg``, ``exp_avg_sq``) of its first CPU-resident parameters (group order) that make up at
least ``f`` of their elements in a file under ``d`` instead of host memory. This module is that piece:

- **Layout.** Built on the first step from the optimizer's param groups at that time (so an
  optimizer whose groups were re-targeted, as :class:`~elixir.wrapper.ElixirOptimizer` does with
  its fragments, offloads what it actually steps). The offloaded elements are cut into
  *segments* (a parameter, or a piece of one: pieces start at multiples of :data:`PIECE_ALIGN`
  elements, so the SIMD kernel computes every element exactly as it would on the whole tensor)
  and packed in order into *buckets* of at most ``bucket_numel`` elements. Each bucket is one
  record of a :class:`~elixir.offload.store.DiskStore` with one flat per moment.
- **Step.** Resident parameters step first in one call; then the buckets go through
  :func:`~elixir.offload.pipeline.run_pipelined`: bucket ``i+1`` is read while bucket ``i``
  steps and bucket ``i`` is written while ``i+1`` is awaited, so at most two buckets' moments are
  in host memory. The step returns after the last write (the file is consistent).
- **State dicts.** ``self.state[p]`` of an offloaded parameter holds only ``step``. Code that
  needs torch's format calls :meth:`NvmeOffload.materialized` (full moments put into
  ``state[p]`` for the block, read one bucket at a time) or, after installing loaded moments,
  :meth:`NvmeOffload.absorb` (moved into the file one bucket at a time, then dropped).

The file is private to the process and unlinked once open (:mod:`elixir.offload.directory`):
the kernel frees it at exit, even after a kill. Its whole size is reserved up front, so a full
disk is reported at construction, before any state exists, rather than mid-step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional

import torch

from elixir.offload.store import DiskStore
from elixir.offload.stream import release_staging, run_pipelined, staged

MOMENTS = ("exp_avg", "exp_avg_sq")
PIECE_ALIGN = 16  # the kernel's SIMD width in fp32 elements: pieces cut here step bitwise as the whole
DEFAULT_BUCKET_NUMEL = 4 << 20  # 16 MiB per moment in fp32: two buckets staged = 128 MiB at most


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, end)`` of parameter ``param`` (flattened), at ``offset`` in its bucket."""

    param: torch.Tensor
    start: int
    end: int
    offset: int


@dataclass
class Bucket:
    index: int
    dtype: torch.dtype
    numel: int = 0
    segments: list[Segment] = field(default_factory=list)


def offloadable(p: torch.Tensor) -> bool:
    """Whether ``p``'s moments can live on disk: a contiguous floating CPU tensor."""
    return p.device.type == "cpu" and p.is_floating_point() and p.is_contiguous() and p.numel() > 0


def plan_segments(params: Iterable[torch.Tensor], fraction: float, bucket_numel: int) -> list[Bucket]:
    """Buckets holding the moments of the first offloadable ``params`` (in order) whose elements
    make up at least ``fraction`` of all offloadable elements (whole parameters: a parameter's
    moments are on disk entirely or not at all). A parameter larger than a bucket is cut into
    pieces at multiples of :data:`PIECE_ALIGN` elements."""
    params = [p for p in params if offloadable(p)]
    budget = fraction * sum(p.numel() for p in params)
    buckets: list[Bucket] = []
    taken = 0
    for p in params:
        if taken >= budget:
            break
        start = 0
        while start < p.numel():
            if not buckets or buckets[-1].dtype != p.dtype or buckets[-1].numel >= bucket_numel:
                buckets.append(Bucket(len(buckets), p.dtype))
            b = buckets[-1]
            end = min(p.numel(), start + bucket_numel - b.numel)
            if end < p.numel():  # a cut inside the tensor: at a whole piece, at least one piece
                end = min(p.numel(), max(start + PIECE_ALIGN, end - (end - start) % PIECE_ALIGN))
            b.segments.append(Segment(p, start, end, b.numel))
            b.numel += end - start
            start = end
        taken += p.numel()
    return buckets


class NvmeOffload:
    """The disk-resident moments of one optimizer (see the module docstring).

    Args:
        fraction: share of the CPU-resident elements whose moments live on disk, in [0, 1].
        directory: where the file goes; None: a fresh private directory under the system temp dir.
        reserve_bytes: bytes to reserve now (an upper bound of what the layout will need), so a bad
            directory or a full disk fails at construction.
        bucket_numel: elements per bucket (two buckets are staged at most).
    """

    def __init__(self, fraction: float, directory: Optional[str], reserve_bytes: int, bucket_numel: int = DEFAULT_BUCKET_NUMEL) -> None:
        if bucket_numel < PIECE_ALIGN:
            raise ValueError(f"bucket_numel must be >= {PIECE_ALIGN}, got {bucket_numel}")
        self.fraction = fraction
        self.bucket_numel = bucket_numel
        self.store = DiskStore(None, directory, reserve_bytes)
        self.buckets: Optional[list[Bucket]] = None
        self._segments_of: dict[int, list[tuple[Bucket, Segment]]] = {}

    # ---- layout --------------------------------------------------------------------------------

    def ensure_layout(self, params: Iterable[torch.Tensor], state: dict) -> None:
        """Lay out the buckets for ``params`` (once), write their zero moments to the file, and
        move moments already in ``state`` (loaded before the layout existed) there."""
        if self.buckets is not None:
            return
        self.buckets = plan_segments(params, self.fraction, self.bucket_numel)
        for b in self.buckets:
            self.store.add_record(b.index, b.numel)
            for key in MOMENTS:
                self.store.add_flat(b.index, key, b.dtype).zero_()
            self.store.start_write(b.index)
            self.store.finish(b.index)
            release_staging()
            for s in b.segments:
                self._segments_of.setdefault(id(s.param), []).append((b, s))
        self.absorb(state)

    def reset_layout(self) -> None:
        """Forget the layout (the optimizer's params were replaced, and no moments exist yet);
        the next step lays it out on the new params."""
        self.store.reset_layout()
        self.buckets = None
        self._segments_of = {}

    def is_offloaded(self, p: torch.Tensor) -> bool:
        return id(p) in self._segments_of

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of moments kept on disk."""
        return sum(b.numel * torch.empty((), dtype=b.dtype).element_size() * len(MOMENTS) for b in self.buckets or [])

    # ---- stepping ------------------------------------------------------------------------------

    def step(self, params: set[int], step_bucket: Callable[[list[Segment], dict[str, torch.Tensor]], None]) -> None:
        """For each bucket holding a segment of a parameter in ``params`` (ids), staged in turn
        through the pipeline: ``step_bucket(segments, flats)`` with that bucket's segments and its
        moment flats, then the bucket is written back."""
        todo = [b for b in self.buckets or [] if any(id(s.param) in params for s in b.segments)]
        by_index = {b.index: b for b in todo}

        def work(i: int) -> None:
            b = by_index[i]
            step_bucket([s for s in b.segments if id(s.param) in params], self.store.chunks[i].flats)

        run_pipelined(self.store, [b.index for b in todo], work)

    # ---- torch-format state ----------------------------------------------------------------------

    @contextlib.contextmanager
    def materialized(self, state: dict) -> Iterator[None]:
        """Put full ``exp_avg``/``exp_avg_sq`` tensors into ``state[p]`` of every offloaded
        parameter that has state, for the block (read one bucket at a time; the file is not
        changed). On exit they are removed again: changes made to them inside are dropped."""
        added: list[dict] = []
        try:
            full: dict[int, dict[str, torch.Tensor]] = {}
            for b in self.buckets or []:
                with staged(self.store, [b.index], write_back=False):
                    flats = self.store.chunks[b.index].flats
                    for s in b.segments:
                        st = state.get(s.param)
                        if not st or "exp_avg" in st and id(s.param) not in full:
                            continue  # no state yet, or moments already present (not ours)
                        mine = full.setdefault(id(s.param), {k: torch.empty_like(s.param) for k in MOMENTS})
                        for k in MOMENTS:
                            mine[k].view(-1)[s.start : s.end].copy_(flats[k][s.offset : s.offset + s.end - s.start])
            for b in self.buckets or []:
                for s in b.segments:
                    mine = full.pop(id(s.param), None)
                    if mine is not None:
                        state[s.param].update(mine)
                        added.append(state[s.param])
            yield
        finally:
            for st in added:
                for k in MOMENTS:
                    st.pop(k, None)

    def absorb(self, state: dict) -> None:
        """Move moments found in ``state[p]`` of offloaded parameters (installed by a load) into
        the file, one bucket at a time, and drop them from ``state``."""
        found = {
            id(s.param) for b in self.buckets or [] for s in b.segments if any(k in (state.get(s.param) or {}) for k in MOMENTS)
        }
        if not found:
            return
        for b in self.buckets or []:
            if not any(id(s.param) in found for s in b.segments):
                continue
            with staged(self.store, [b.index], write_back=True):
                flats = self.store.chunks[b.index].flats
                for s in b.segments:
                    st = state.get(s.param)
                    if id(s.param) not in found:
                        continue
                    for k in MOMENTS:
                        v = st.get(k)
                        if v is None:
                            flats[k][s.offset : s.offset + s.end - s.start].zero_()
                            continue
                        if v.numel() != s.param.numel():
                            raise ValueError(f"loaded optimizer state {k!r} has {v.numel()} elements, its parameter {s.param.numel()}")
                        flats[k][s.offset : s.offset + s.end - s.start].copy_(v.detach().reshape(-1)[s.start : s.end])
        for pid in found:
            param = self._segments_of[pid][0][1].param
            for k in MOMENTS:
                state[param].pop(k, None)

    def close(self) -> None:
        self.store.close()


def _laid_out(optimizer: torch.optim.Optimizer) -> Optional[NvmeOffload]:
    nvme = getattr(optimizer, "nvme", None)
    if isinstance(nvme, NvmeOffload):
        nvme.ensure_layout([p for g in optimizer.param_groups for p in g["params"]], optimizer.state)
        return nvme
    return None


def materialized(optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
    """The block sees ``optimizer.state`` in torch's format (a no-op without NVMe offload)."""
    nvme = _laid_out(optimizer)
    return nvme.materialized(optimizer.state) if nvme is not None else contextlib.nullcontext()


def absorb(optimizer: torch.optim.Optimizer) -> None:
    """Move freshly installed moments of offloaded parameters to the disk (a no-op without it)."""
    nvme = _laid_out(optimizer)
    if nvme is not None:
        nvme.absorb(optimizer.state)
