"""Materialise a model built on the meta device, one initialisation unit at a time.

A model built under ``with torch.device("meta"):`` has shapes but no values. :class:`Materializer`
gives each meta tensor real values, on the CPU, using the model's own initialisers, while keeping
only a small staging area alive: :class:`~elixir.wrapper.ElixirModule` asks it for the parameters
of one chunk at a time, copies them into the chunk and forgets them.

**Units.** A unit is a module that directly owns meta parameters or buffers, together with every
module sharing one of those tensors (tied weights: the embedding and the LM head are one unit).
Materialising a unit allocates its direct tensors (filled with NaN, or a sentinel for integers),
runs the initialisers of its modules and then those of their ancestors, and hands the values over.
Every other tensor of the model is on the meta device meanwhile, where an initialiser's writes do
nothing; so a unit's values depend only on the model's structure and the seed, never on the plan,
the world size or the order in which chunks ask for them.

**Initialisers**, in the order an eager build runs them (children before parents):

- ``reset_parameters()`` (or ``_reset_parameters()``) of the module, as its constructor does;
- for Hugging Face models, ``_init_weights(module)`` of the nearest enclosing ``PreTrainedModel``
  (what ``post_init`` / ``init_weights`` runs; it also recomputes non-persistent buffers such as
  rotary ``inv_freq`` and ``position_ids``);
- for PEFT LoRA layers (``peft.get_peft_model`` on a meta model), ``reset_lora_parameters`` of
  each adapter with the ``init_lora_weights`` of the model's ``peft_config`` (so ``lora_B`` starts at
  zero, as PEFT builds it, whatever the enclosing ``_init_weights`` wrote);
- then the same initialisers of the unit's ancestors, innermost first (an ancestor may initialise
  its children's tensors: GPT-2's attention rescales its ``c_proj`` weight).

**Seeds.** Each initialiser call runs under its own seed, a hash of (``seed``, the unit's module
name, the initialising module's name), with the global RNG forked and restored around it. Every
rank therefore computes identical values with no broadcast, and the caller's RNG is untouched.
The values are *not* those of an eager build under the same ``torch.manual_seed``: an eager build
draws every tensor from one random stream in construction order, and each draw depends on all
before it, which a chunk-at-a-time build cannot reproduce without building everything. The
distributions are the same (the same initialisers run); the draws differ.

**Checks.** A tensor that no initialiser wrote (still NaN, or still the integer sentinel) raises
:class:`MaterializeError` naming it and the fix, since the value its constructor computed is lost.
Parameters must be all on meta or none: a half-built model would have its real parameters
overwritten by ancestor initialisers.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn

from elixir import distributed as edist

_INT_SENTINEL = -(2**31) + 7  # fills integer tensors before init; a value still equal was never written


class MaterializeError(RuntimeError):
    """A meta-device model cannot be materialised as asked; the message names the fix."""


def has_meta_tensors(module: nn.Module) -> bool:
    """True when some parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def agreed_seed(seed: Optional[int], group=None) -> int:
    """The initialisation seed every rank uses: ``seed``, or one drawn from the global torch RNG
    (so ``torch.manual_seed`` makes builds reproducible) and taken from rank 0. Collective when
    the group has more than one rank."""
    value = int(seed) if seed is not None else int(torch.randint(0, 2**62, ()).item())
    if edist.get_world_size(group) > 1:
        t = torch.tensor([value], dtype=torch.int64)
        edist.broadcast(t, 0, group)
        value = int(t.item())
    return value


def _derive(seed: int, *names: str) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(str(seed).encode())
    for n in names:
        h.update(b"\0" + n.encode())
    return int.from_bytes(h.digest(), "little") & (2**63 - 1)


def _is_hf_model(m: nn.Module) -> bool:
    return callable(getattr(m, "_init_weights", None)) and hasattr(m, "config")


def _fill_sentinel(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(_INT_SENTINEL)


def _unwritten(t: torch.Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool:
        return False
    return bool((t == _INT_SENTINEL).any())


def _swap(t: torch.Tensor, new: torch.Tensor) -> None:
    """Give ``t`` the contents of ``new``, keeping ``t``'s identity and its Python attributes."""
    attrs = dict(t.__dict__)
    torch.utils.swap_tensors(t, new)
    t.__dict__.clear()
    t.__dict__.update(attrs)


def assign(t: torch.Tensor, value: torch.Tensor) -> None:
    """Make the meta tensor ``t`` (a parameter or buffer) hold ``value``'s storage, in place:
    every module that holds ``t`` sees it, and ``t`` keeps its identity and attributes. A
    ``value`` that is already a parameter is swapped in as it is (no new view is made, so its
    storage may already be released)."""
    if isinstance(t, nn.Parameter) and isinstance(value, nn.Parameter):
        new = value
    elif isinstance(t, nn.Parameter):
        new = nn.Parameter(value, requires_grad=t.requires_grad)
    else:
        new = value.detach()
        new.requires_grad_(t.requires_grad)
    _swap(t, new)


class Materializer:
    """Materialises ``root``'s meta tensors unit by unit (see the module docstring).

    Args:
        root: the model; its parameters are all on meta or none are.
        seed: the base seed (identical on every rank; see :func:`agreed_seed`).
        init_frozen: run the initialisers of units whose tensors are all frozen parameters
            (``requires_grad=False``); ``False`` gives them zeros instead, for a frozen base that
            a checkpoint overwrites. Other units' values do not change (each has its own seed).
    """

    def __init__(self, root: nn.Module, seed: int, init_frozen: bool = True) -> None:
        self.root = root
        self.seed = int(seed)
        self.init_frozen = bool(init_frozen)
        # PEFT adapters: how each adapter's LoRA weights are initialised (duck-typed: no peft import)
        self._lora_init = {name: getattr(cfg, "init_lora_weights", True)
                           for name, cfg in (getattr(root, "peft_config", None) or {}).items()}
        real = [n for n, p in root.named_parameters() if not p.is_meta]
        meta = [n for n, p in root.named_parameters() if p.is_meta]
        if real and meta:
            raise MaterializeError(
                f"the model has parameters both on the meta device ({meta[0]!r}, ...) and off it "
                f"({real[0]!r}, ...); build all of its parameters under torch.device('meta'), or none"
            )
        self.names: dict[nn.Module, str] = {m: n for n, m in root.named_modules()}
        self._parent: dict[nn.Module, Optional[nn.Module]] = {root: None}
        self._depth: dict[nn.Module, int] = {root: 0}
        self._hf_owner: dict[nn.Module, Optional[nn.Module]] = {}
        self._walk(root, None)
        # unit of every meta tensor: union of the modules holding it directly
        owners: dict[int, list[nn.Module]] = {}
        self._tensor: dict[int, torch.Tensor] = {}
        for m in self.names:
            for t in self._direct(m):
                owners.setdefault(id(t), []).append(m)
                self._tensor[id(t)] = t
        parent = {m: m for m in self.names}

        def find(m):
            while parent[m] is not m:
                parent[m] = parent[parent[m]]
                m = parent[m]
            return m

        for mods in owners.values():
            for other in mods[1:]:
                parent[find(other)] = find(mods[0])
        order = list(self.names)  # named_modules order: parents before children
        groups: dict[nn.Module, list[nn.Module]] = {}
        for m in order:
            if any(True for _ in self._direct(m)):
                groups.setdefault(find(m), []).append(m)
        self._unit_of: dict[int, tuple[nn.Module, ...]] = {}
        for mods in groups.values():
            unit = tuple(mods)
            for m in unit:
                for t in self._direct(m):
                    self._unit_of[id(t)] = unit
        self._done: set[tuple] = set()
        self._values: dict[int, torch.Tensor] = {}  # staged: materialised, not yet taken
        self._real_buffers = {id(b): b.detach().clone() for b in root.buffers() if not b.is_meta}
        self.staged_bytes = 0
        self.peak_staged_bytes = 0

    # ---- structure -----------------------------------------------------------------------------

    def _walk(self, m: nn.Module, hf: Optional[nn.Module]) -> None:
        if _is_hf_model(m):
            hf = m
        self._hf_owner[m] = hf
        for child in m.children():
            if child not in self._parent:
                self._parent[child] = m
                self._depth[child] = self._depth[m] + 1
                self._walk(child, hf)

    @staticmethod
    def _direct(m: nn.Module) -> Iterator[torch.Tensor]:
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None and t.is_meta:
                yield t

    def _ancestors(self, unit: tuple) -> list[nn.Module]:
        """Ancestors of the unit's modules, innermost first, without the unit's own modules."""
        inside, found = set(unit), {}
        for m in unit:
            a = self._parent.get(m)
            while a is not None:
                if a not in inside:
                    found[a] = None
                a = self._parent.get(a)
        return sorted(found, key=lambda a: -self._depth[a])

    # ---- initialisation ------------------------------------------------------------------------

    def _initialisers(self, m: nn.Module) -> list[Callable[[], None]]:
        fns: list[Callable[[], None]] = []
        reset = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
        if callable(reset):
            fns.append(reset)
        hf = self._hf_owner.get(m)
        if hf is not None:
            fns.append(lambda: hf._init_weights(m))
        lora = getattr(m, "reset_lora_parameters", None)
        if callable(lora) and isinstance(getattr(m, "lora_A", None), nn.ModuleDict):
            for name in m.lora_A:
                fns.append(lambda name=name: lora(name, self._lora_init.get(name, True)))
        return fns

    def _run(self, m: nn.Module, seed: int) -> None:
        fns = self._initialisers(m)
        if not fns:
            return
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            for fn in fns:
                fn()

    def _materialise(self, unit: tuple) -> None:
        key = tuple(id(m) for m in unit)
        if key in self._done:
            return
        tensors: dict[int, torch.Tensor] = {}
        for m in unit:
            for t in self._direct(m):
                tensors[id(t)] = t
        if not self.init_frozen and all(isinstance(t, nn.Parameter) and not t.requires_grad for t in tensors.values()):
            for i, t in tensors.items():  # a checkpoint will overwrite them: no initialiser runs
                self._values[i] = torch.zeros(t.shape, dtype=t.dtype)
                self.staged_bytes += t.numel() * t.element_size()
            self.peak_staged_bytes = max(self.peak_staged_bytes, self.staged_bytes)
            self._done.add(key)
            return
        holders: dict[int, torch.Tensor] = {}
        for i, t in tensors.items():
            real = torch.empty(t.shape, dtype=t.dtype)
            _fill_sentinel(real)
            holder = nn.Parameter(real, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else real
            torch.utils.swap_tensors(t, holder)  # t is real now; holder holds t's meta contents
            holders[i] = holder
        try:
            unit_name = self.names[unit[0]]
            for m in sorted(unit, key=lambda x: -self._depth[x]):  # children before parents
                self._run(m, _derive(self.seed, unit_name, self.names[m]))
            for a in self._ancestors(unit):
                self._run(a, _derive(self.seed, unit_name, self.names[a]))
        finally:
            for i, t in tensors.items():
                torch.utils.swap_tensors(t, holders[i])  # t back on meta; holder holds the values
        for m in unit:
            for name, t in list(m._parameters.items()) + list(m._buffers.items()):
                if t is not None and id(t) in holders and _unwritten(holders[id(t)]):
                    what = "parameter" if name in m._parameters else "buffer"
                    raise MaterializeError(
                        f"{what} {self._qual(m, name)!r} ({type(m).__name__}) is on the meta device and none of the "
                        f"model's initialisers wrote it (reset_parameters(), or _init_weights() of a Hugging Face "
                        f"model), so the value its constructor computed is lost. Give {type(m).__name__} a "
                        "reset_parameters() that computes it, or build the model off the meta device"
                    )
        for i, h in holders.items():
            self._values[i] = h.detach()
            self.staged_bytes += h.numel() * h.element_size()
        self.peak_staged_bytes = max(self.peak_staged_bytes, self.staged_bytes)
        self._done.add(key)

    def _qual(self, m: nn.Module, attr: str) -> str:
        prefix = self.names.get(m, "")
        return f"{prefix}.{attr}" if prefix else attr

    # ---- public --------------------------------------------------------------------------------

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The values of meta tensor ``t`` (on the CPU, in ``t``'s dtype); they leave the staging
        area. ``t`` itself stays on meta until :meth:`assign` or :meth:`finish`."""
        unit = self._unit_of.get(id(t))
        if unit is None:
            raise MaterializeError(f"tensor of shape {tuple(t.shape)} is not a meta tensor of this model")
        if id(t) not in self._values:
            self._materialise(unit)
        v = self._values.pop(id(t))
        self.staged_bytes -= v.numel() * v.element_size()
        return v

    def finish(self, device: torch.device, skip: set[int]) -> None:
        """Materialise every tensor not yet taken, except ids in ``skip`` (the chunked parameters,
        assigned by the caller), and put each into the model on ``device``."""
        for i, t in self._tensor.items():
            if i in skip or not t.is_meta:
                continue
            assign(t, self.take(t).to(device))
        with torch.no_grad():  # real buffers in a meta model: their constructor values stand
            for b in self.root.buffers():
                saved = self._real_buffers.get(id(b))
                if saved is not None:
                    b.copy_(saved)


def materialize(module: nn.Module, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """Materialise every meta tensor of ``module`` in place, with exactly the values
    :class:`~elixir.wrapper.ElixirModule` gives them for ``init_seed=seed`` (a plain-torch twin of
    a meta-built wrapped model). Returns ``module``."""
    if has_meta_tensors(module):
        Materializer(module, seed).finish(torch.device(device), skip=set())
    return module
