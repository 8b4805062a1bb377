"""The forward and backward hooks of an ElixirModule: which chunks each step gathers, pins and
prefetches (FSDP2's ``FSDPState`` hooks role).

A "step" is one call of a module that directly owns chunked parameters. :class:`StepHooks` installs
the tracer's step hooks (so the runtime fires exactly the steps the plan was traced with) and, per
step, gathers (or finds in the rCache) and pins that module's sharded chunks, prefetching what the
schedule says follows. Forward pins are dropped at the step's end; backward pins when a call that
does not enclose the next one is done. Invariant: a pinned chunk is never evicted, and every pin
taken here is dropped by the end of backward (:meth:`release_pins`) or the next forward
(:meth:`unwind_forward`).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn

from elixir.chunk import BlockCache, Chunk, Schedule, learned_schedule
from elixir.tracer.hooks import StepKind, borrowed_children, install_step_hooks, step_params
from elixir.wrapper.backward_tracker import BackwardTracker
from elixir.wrapper.param_map import ParamMap


@dataclass(frozen=True)
class _ModInfo:
    """Precomputed per hooked module: its sharded chunks and its direct trainable params."""

    chunks: tuple  # sharded Chunk objects, plan order
    chunk_set: frozenset
    params: tuple  # parameter indices
    ancestors: frozenset  # ids of the hooked modules that contain this one
    key: int  # id of the module


class StepHooks:
    """Gathers, pins and prefetches the chunks of each step of ``module``.

    ``enter_backward`` is the owner's callback for the first hook of a backward (the training
    state's move); ``schedule`` the prefetch schedule (None: gather on demand, LRU eviction)."""

    def __init__(self, module: nn.Module, all_chunks: list[Chunk], param_map: ParamMap, frozen_map: ParamMap,
                 cache: BlockCache, tracker: BackwardTracker, enter_backward: Callable[[], None],
                 schedule: Optional[Schedule]) -> None:
        self.module, self.all_chunks, self.cache, self.tracker = module, all_chunks, cache, tracker
        self._param_map, self._frozen_map = param_map, frozen_map
        self._enter_backward = enter_backward
        self.schedule = schedule  # untraced plan with prefetch: learned in the first backward
        self.observed_order: list[frozenset] = []  # sharded chunk sets of the last iteration
        self._drift_warned = False
        self._fwd_stack: list[tuple] = []
        self._bwd_stack: list[_ModInfo] = []  # hooked calls whose backward may still be running
        self._mod_info: dict[nn.Module, _ModInfo] = {}
        self.handles: list = []

    def _chunked(self, p: nn.Parameter) -> bool:
        return p in self._param_map or p in self._frozen_map

    def install(self) -> None:
        """Find the hooked modules and their chunks, and install the tracer's step hooks."""
        borrowed = borrowed_children(self.module)
        uses = {id(m): [p for p in step_params(m, borrowed) if self._chunked(p)] for m in self.module.modules()}
        owners = {m for m in self.module.modules() if uses[id(m)]}
        ancestors: dict[int, set] = {}

        def walk(m: nn.Module, above: frozenset) -> None:
            ancestors.setdefault(id(m), set()).update(above)
            for child in m.children():
                walk(child, above | {id(m)} if m in owners else above)

        walk(self.module, frozenset())
        slot_of = self._param_map.by_param
        for m in self.module.modules():
            if m in self._mod_info or m not in owners:
                continue
            idx = tuple(dict.fromkeys(slot_of[p].index for p in uses[id(m)] if p in slot_of))
            chunk_ids = list(dict.fromkeys((slot_of.get(p) or self._frozen_map.slot_of(p)).chunk for p in uses[id(m)]))
            every = self.all_chunks
            sharded = tuple(every[c] for c in sorted(chunk_ids) if every[c].spec.sharded)
            info = _ModInfo(sharded, frozenset(c.index for c in sharded), idx, frozenset(ancestors[id(m)]), id(m))
            self._mod_info[m] = info
        # the tracer's step hooks, so the runtime fires exactly the steps the plan was traced with
        hooks = install_step_hooks(
            self.module, on_forward=self._step_forward, on_backward=self._step_backward, on_forward_end=self._step_forward_end
        )
        self.handles.extend(hooks.handles)

    def start_iteration(self) -> None:
        """A training forward begins: record its order afresh and restart the schedule."""
        self.observed_order = []
        if self.schedule is not None:
            self.schedule.restart()

    def learn_schedule(self, depth: int) -> None:
        """An untraced plan with prefetch: follow the order this iteration took (once)."""
        if self.schedule is None:
            self.schedule = learned_schedule(self.observed_order, depth)

    def _use(self, info: _ModInfo) -> None:
        """Gather (or find in the rCache) and pin ``info``'s chunks; prefetch what follows."""
        sched = self.schedule
        self.observed_order.append(info.chunk_set)
        next_use = None
        if sched is not None and sched.active:
            if sched.observe(info.chunk_set):
                next_use = self._next_use
            elif not self._drift_warned:
                self._drift_warned = True
                warnings.warn(
                    "elixir: the execution order drifted from the plan's traced order (different "
                    "control flow?); gathering on demand with LRU eviction for the rest of this "
                    "iteration",
                    stacklevel=4,
                )
        for c in info.chunks:
            self.cache.acquire(c, next_use, info.chunk_set)
            c.pin()
        if next_use is not None:
            upcoming = sched.upcoming()
            protect = set(info.chunk_set) | set(upcoming)
            every = self.all_chunks
            for ci in upcoming:
                if not self.cache.prefetch(every[ci], next_use, protect):
                    break

    def _next_use(self, chunk: Chunk) -> float:
        return self.schedule.next_use(chunk.index)

    def _pre_forward(self, info: _ModInfo, module: nn.Module, args: Any) -> None:
        if info.chunks:
            self._use(info)
        self._fwd_stack.append(info.chunks)
        if torch.is_grad_enabled():
            for i in info.params:
                self.tracker.expect(i)

    def _step_forward(self, kind: StepKind, name: str, module: nn.Module) -> None:
        info = self._mod_info.get(module)
        if info is not None:  # else a module whose parameters are all frozen
            self._pre_forward(info, module, None)

    def _step_forward_end(self, kind: StepKind, name: str, module: nn.Module) -> None:
        if module not in self._mod_info:
            return
        chunks = self._fwd_stack.pop() if self._fwd_stack else ()
        for c in chunks:
            c.unpin()

    def _step_backward(self, kind: StepKind, name: str, module: nn.Module) -> None:
        info = self._mod_info.get(module)
        if info is not None and info.chunks:
            self._pre_backward(info, None)

    def _pre_backward(self, info: _ModInfo, grad: Any) -> None:
        self._enter_backward()
        self.unwind_forward()
        # Backward runs in reverse creation order, so a call whose backward is still running when
        # this one starts encloses it; the others are done: unpin them.
        stack = self._bwd_stack
        while stack and stack[-1].key not in info.ancestors:
            for c in stack.pop().chunks:
                c.unpin()
        self._use(info)
        stack.append(info)

    def unwind_forward(self) -> None:
        """Drop pins of forwards that never finished (recomputation stopped early)."""
        while self._fwd_stack:
            for c in self._fwd_stack.pop():
                c.unpin()

    def release_pins(self) -> None:
        """End of backward: drop the backward pins, then those of unfinished forwards."""
        while self._bwd_stack:
            for c in self._bwd_stack.pop().chunks:
                c.unpin()
        self.unwind_forward()

    @contextlib.contextmanager
    def hold(self, chunks: list[Chunk]) -> Iterator[None]:
        """Gather (one all-gather each, issued here) and pin every sharded chunk of ``chunks`` for
        the block (``no_sync``: gradients accumulate over whole payloads); unpin after."""
        held = []
        try:
            for c in chunks:
                if c.spec.sharded:
                    if c not in self.cache:
                        c.gather()
                        self.cache.admit(c)
                    c.pin()
                    held.append(c)
            yield
        finally:
            for c in held:
                c.unpin()

    def abandon(self) -> None:
        """An abandoned backward: forget the stacks and drop every pin of every chunk."""
        self._bwd_stack.clear()
        self._fwd_stack.clear()
        for c in self.all_chunks:
            c.unpin(all_pins=True)
