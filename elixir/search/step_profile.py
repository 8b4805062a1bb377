"""What the search needs to know about one training step, as plain data.

A :class:`StepProfile` holds the trainable parameters (canonical names and shapes, in definition
order), which of them are shared between modules (tied), the traced per-op parameter order with each
step's phase, and the tracer's activation and buffer bytes. It is built:

- :func:`profile_step` — from the tracer (``elixir.tracer``), on meta tensors;
- :func:`profile_by_layers` — from traces of the same model cut to 2 and 3 layers, extrapolated by
  layer repetition to the full depth (exact for stacks of identical layers; see its docstring). This
  is how ``elixir plan`` profiles OPT-175B in well under a second;
- :func:`profile_from_module` — definition order only, with given activation bytes (no tracer).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn

from elixir.plan import CHUNKABLE_DTYPES, dtype_name
from elixir.tracer.hooks import param_owning_modules
from elixir.tracer.memory_tracer import memory_profiling
from elixir.tracer.op_costs import OpCosts

FORWARD, RECOMPUTE, BACKWARD = "forward", "recompute", "backward"


@dataclass(frozen=True)
class StepProfile:
    """One training step, as the search sees it (per rank).

    Attributes:
        params: ``(name, shape)`` of each trainable parameter (canonical names, definition order).
        shared: canonical names of parameters registered under more than one module (tied).
        frozen: parameters with ``requires_grad=False``.
        frozen_shapes: ``(name, shape)`` of the frozen parameters a frozen chunk can hold (float32,
            float16, bfloat16), definition order: the search packs them into frozen chunks.
        steps: per hooked op, the canonical names of the trainable parameters it touches.
        step_kinds: per step, ``"forward"``, ``"recompute"`` or ``"backward"``.
        activation_bytes: peak bytes of activations and temporaries (the tracer's ``activation_occ``).
        buffer_bytes: module buffers.
        matmul_param_numel: elements of parameters used as matmul weights (2-D, not embeddings).
        tokens: tokens in this rank's batch (for the matmul FLOP estimate).
        dtype: the compute dtype name.
        op_costs: the tracer's per-op FLOP/byte/op-count histograms (None without the tracer);
            the cost model's compute time comes from these when present.
        info: how it was made (traced layers, checkpointing, ...).
        step_activations: per step, the most activation bytes live from the op before its hook
            fired to the op before the next step's (the tracer's per-op timeline, so the peak of
            each stretch of the step); empty when unknown (then every step is priced at
            ``activation_bytes``). The cost model's timeline (:func:`~elixir.search.cost_model.
            timeline_peak`) uses it to tell which activations are still live while disk chunks
            stage during backward.
    """

    params: tuple[tuple[str, tuple[int, ...]], ...]
    shared: frozenset = frozenset()
    frozen: tuple[str, ...] = ()
    frozen_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    steps: tuple[tuple[str, ...], ...] = ()
    step_kinds: tuple[str, ...] = ()
    activation_bytes: int = 0
    buffer_bytes: int = 0
    matmul_param_numel: int = 0
    tokens: int = 0
    dtype: str = "float32"
    op_costs: Optional[OpCosts] = None
    info: dict[str, Any] = field(default_factory=dict)
    step_activations: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.steps) != len(self.step_kinds):
            raise ValueError("steps and step_kinds must have the same length")
        if self.step_activations and len(self.step_activations) != len(self.steps):
            raise ValueError("step_activations must have one entry per step (or none)")

    @property
    def numel(self) -> dict[str, int]:
        out = {}
        for n, s in self.params:
            k = 1
            for d in s:
                k *= d
            out[n] = k
        return out

    @property
    def total_numel(self) -> int:
        return sum(self.numel.values())

    def flops(self) -> float:
        """Matmul FLOPs of the step: 2 per weight element per token for each forward or recompute
        pass, 4 for backward (input and weight gradients). Attention score products and elementwise
        ops are not counted (the standard ``6 N D`` estimate, plus ``2 N D`` per recompute)."""
        passes = 3.0 + (1.0 if RECOMPUTE in self.step_kinds else 0.0)
        return 2.0 * passes * self.matmul_param_numel * self.tokens

    def backward_share(self) -> float:
        """The part of the step's compute that runs in backward, by the pass counts of
        :meth:`flops` (not fitted): backward costs two forward passes (input and weight
        gradients), so 2/3 of the compute; with gradient checkpointing the recompute pass runs
        inside backward too, 3/4."""
        recompute = 1.0 if RECOMPUTE in self.step_kinds else 0.0
        return (2.0 + recompute) / (3.0 + recompute)

    def frozen_use_order(self) -> list[tuple[str, int]]:
        """Chunkable frozen parameters by first use in the traced steps (unused ones after, in
        definition order), with their element counts."""
        numel = {n: math.prod(s) for n, s in self.frozen_shapes}
        seen: dict[str, None] = {}
        for s in self.steps:
            for n in s:
                if n in numel:
                    seen.setdefault(n, None)
        for n in numel:
            seen.setdefault(n, None)
        return [(n, numel[n]) for n in seen]

    def use_order(self) -> list[str]:
        """Parameter names by first use in the traced steps; unused ones after, in definition order."""
        seen: dict[str, None] = {}
        for s in self.steps:
            for n in s:
                seen.setdefault(n, None)
        for n, _ in self.params:
            seen.setdefault(n, None)
        names = {n for n, _ in self.params}
        return [n for n in seen if n in names]


# ---------------------------------------------------------------------------------------------
# from a module


def _frozen_shapes(model: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``(name, shape)`` of the frozen parameters a frozen chunk can hold, definition order."""
    return tuple((n, tuple(p.shape)) for n, p in model.named_parameters()
                 if not p.requires_grad and p.dtype in CHUNKABLE_DTYPES)


def _canonical(model: nn.Module) -> tuple[list[tuple[str, tuple[int, ...]]], set, list[str], dict[str, str]]:
    """Trainable (name, shape) in definition order, shared names, frozen names, alias -> canonical."""
    first: dict[int, str] = {}
    alias: dict[str, str] = {}
    params, frozen, shared = [], [], set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            alias[name] = first[id(p)]
            shared.add(first[id(p)])
            continue
        first[id(p)] = name
        alias[name] = name
        if p.requires_grad:
            params.append((name, tuple(p.shape)))
        else:
            frozen.append(name)
    return params, shared, frozen, alias


def _matmul_numel(model: nn.Module, alias: dict[str, str]) -> int:
    """Elements of weights that multiply activations: 2-D+ parameters outside embedding tables,
    plus embedding tables that are also used as output projections (tied)."""
    emb = set()
    for mname, m in model.named_modules():
        if isinstance(m, nn.Embedding):
            emb.add(alias.get(f"{mname}.weight" if mname else "weight"))
    counted, total = set(), 0
    for name, p in model.named_parameters(remove_duplicate=False):
        c = alias[name]
        if not p.requires_grad or p.dim() < 2 or c in counted:
            continue
        if name in emb or (c in emb and name == c):
            continue  # a lookup table, not a matmul (unless used elsewhere under an alias)
        counted.add(c)
        total += p.numel()
    return total


def _tokens(inp: Optional[dict]) -> int:
    if not inp:
        return 0
    for k in ("input_ids", "inputs_embeds", "x", "input"):
        v = inp.get(k)
        if isinstance(v, torch.Tensor):
            return int(v.shape[0] * v.shape[1]) if v.dim() >= 2 else int(v.numel())
    v = next((t for t in inp.values() if isinstance(t, torch.Tensor)), None)
    return int(v.shape[0]) if v is not None and v.dim() else 1


def profile_from_module(
    model: nn.Module, activation_bytes: int = 0, dtype: torch.dtype = torch.float32, tokens: int = 0
) -> StepProfile:
    """A profile without the tracer: forward visits modules in registration order, backward in
    reverse, each touching its own direct parameters."""
    params, shared, frozen, alias = _canonical(model)
    trainable = {n for n, _ in params}
    fwd = []
    for _mname, _m, owned in param_owning_modules(model):  # the steps the runtime's hooks take
        names = tuple(alias.get(n, n) for n in owned if alias.get(n, n) in trainable)
        if names:
            fwd.append(names)
    steps = fwd + fwd[::-1]
    kinds = [FORWARD] * len(fwd) + [BACKWARD] * len(fwd)
    return StepProfile(
        params=tuple(params), shared=frozenset(shared), frozen=tuple(frozen), frozen_shapes=_frozen_shapes(model),
        steps=tuple(steps), step_kinds=tuple(kinds), activation_bytes=int(activation_bytes),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        matmul_param_numel=_matmul_numel(model, alias), tokens=tokens, dtype=dtype_name(dtype),
        info={"source": "module definition order (no tracer)"},
    )


# ---------------------------------------------------------------------------------------------
# from the tracer


def profile_step(
    model: nn.Module, inp: dict, step_fn: Callable[[nn.Module, dict], Any], dtype: torch.dtype = torch.float32,
    target: str = "meta",
) -> StepProfile:
    """Trace ``step_fn(model, inp)`` on meta (``elixir.tracer``) into a :class:`StepProfile`.

    ``target="real"`` runs the step on real CPU copies of the model and batch instead (it needs
    the model's weights and the step's memory on this machine): the way to profile a step whose
    library code branches on values that depend on the weights, which a meta trace cannot know.
    Pass the profile to :func:`elixir.search.optimal.search_profile`."""
    prof = memory_profiling(model, inp, step_fn, dtype, target)
    occ = prof.occ_dict()
    params, shared, frozen, alias = _canonical(model)
    steps = [tuple(dict.fromkeys(alias.get(n, n) for n in s.params)) for s in prof.order.steps]
    kinds = [s.kind.value for s in prof.order.steps]
    return StepProfile(
        params=tuple(params), shared=frozenset(shared), frozen=tuple(frozen), frozen_shapes=_frozen_shapes(model),
        steps=tuple(steps), step_kinds=tuple(kinds), activation_bytes=int(occ["activation_occ"]),
        buffer_bytes=int(occ["buffer_occ"]), matmul_param_numel=_matmul_numel(model, alias),
        tokens=_tokens(inp), dtype=dtype_name(dtype), op_costs=prof.op_costs,
        info={"source": "tracer" if target == "meta" else "tracer (real tensors)",
              "phase_peaks": occ.get("phase_peaks", {})},
        step_activations=_step_activations([s.op_index for s in prof.order.steps], prof.timeline_activation),
    )


def _step_activations(starts: Sequence[int], act: Sequence[int]) -> tuple[int, ...]:
    """Per step (its hook fired before op ``starts[t]``), the most activation bytes of the ops
    from the one before the hook to the one before the next step's hook (the last step runs to the
    end of the timeline; the ops before the first hook count with the first step)."""
    if not starts or not act:
        return ()
    n, out = len(act), []
    for t, lo in enumerate(starts):
        lo = 0 if t == 0 else max(0, min(lo, n) - 1)
        hi = n if t + 1 == len(starts) else min(max(starts[t + 1], lo + 1), n)
        out.append(int(max(act[lo:hi], default=0)))
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# by layer repetition


def find_layer_stack(model: nn.Module) -> tuple[str, int]:
    """The longest ``nn.ModuleList`` of the model (its repeated layers): (path, length)."""
    best = ("", 0)
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > best[1]:
            best = (name, len(m))
    if not best[1]:
        raise ValueError("the model has no nn.ModuleList of layers to extrapolate over; trace it whole")
    return best


def _rename(name: str, prefix: str, mapping: Callable[[int], int]) -> str:
    if not name.startswith(prefix):
        return name
    rest = name[len(prefix):]
    idx, _, tail = rest.partition(".")
    return f"{prefix}{mapping(int(idx))}.{tail}"


def expand_layers(profile: StepProfile, stack: str, traced: int, layers: int,
                  full_params: Optional[Sequence[tuple[str, tuple[int, ...]]]] = None) -> StepProfile:
    """Grow a profile traced with ``traced`` (= 3) layers under ``stack`` to ``layers`` layers.

    Steps of layer 1 (the middle one) are the template: every run of them is repeated for layers
    1 .. layers-2, ascending when the run follows layer 0 (forward) and descending otherwise
    (backward, recompute); layer 2 becomes layer ``layers - 1``. Activations are not touched here.
    """
    if traced != 3:
        raise ValueError("expand_layers needs a 3-layer trace")
    if layers < 3:
        raise ValueError("trace the model whole when it has fewer than 3 layers")
    prefix = f"{stack}." if stack else ""
    pat = re.compile(re.escape(prefix) + r"(\d+)\.")

    def layer_of(step: tuple[str, ...]) -> Optional[int]:
        idx = {int(m.group(1)) for n in step for m in [pat.match(n)] if m}
        if len(idx) == 1 and all(pat.match(n) for n in step):
            return idx.pop()
        return None

    last = layers - 1

    def _top(i: int) -> int:
        return last if i == 2 else i

    runs: list[tuple[Optional[int], list[int]]] = []
    for i, s in enumerate(profile.steps):
        lab = layer_of(s)
        if runs and runs[-1][0] == lab:
            runs[-1][1].append(i)
        else:
            runs.append((lab, [i]))
    steps: list[tuple[str, ...]] = []
    kinds: list[str] = []
    for r, (lab, idxs) in enumerate(runs):
        if lab == 1:
            prev = runs[r - 1][0] if r > 0 else None
            order = range(1, last) if prev == 0 else range(last - 1, 0, -1)
            for k in order:
                for i in idxs:
                    steps.append(tuple(_rename(n, prefix, lambda _i, k=k: k) for n in profile.steps[i]))
                    kinds.append(profile.step_kinds[i])
        else:
            for i in idxs:
                steps.append(tuple(_rename(n, prefix, _top) for n in profile.steps[i]))
                kinds.append(profile.step_kinds[i])
    if full_params is None:
        full_params = _repeat_layers(list(profile.params), pat, prefix, last, _top)
    shared = frozenset(_rename(n, prefix, _top) for n in profile.shared)
    return StepProfile(
        params=tuple(full_params), shared=shared, frozen=profile.frozen,
        frozen_shapes=tuple(_repeat_layers(list(profile.frozen_shapes), pat, prefix, last, _top)), steps=tuple(steps),
        step_kinds=tuple(kinds), activation_bytes=profile.activation_bytes, buffer_bytes=profile.buffer_bytes,
        matmul_param_numel=profile.matmul_param_numel + (layers - 3) * _layer_matmul(profile, pat),
        tokens=profile.tokens, dtype=profile.dtype, op_costs=profile.op_costs, info=dict(profile.info),
    )


def _repeat_layers(params: list, pat: re.Pattern, prefix: str, last: int, top: Callable[[int], int]) -> list:
    """``(name, shape)`` of a 3-layer trace grown to ``last + 1`` layers: layer 1's repeated for
    layers 1 .. last - 1, layer 2 renamed ``last``."""
    block = [(n, s) for n, s in params if (m := pat.match(n)) and int(m.group(1)) == 1]
    out: list = []
    for n, s in params:
        m = pat.match(n)
        if m and int(m.group(1)) == 1:
            if (n, s) == block[0]:
                for k in range(1, last):
                    out.extend((_rename(bn, prefix, lambda _i, k=k: k), bs) for bn, bs in block)
        else:
            out.append((_rename(n, prefix, top), s))
    return out


def _layer_matmul(profile: StepProfile, pat: re.Pattern) -> int:
    """Matmul elements of one layer: its 2-D+ parameters."""
    total = 0
    for n, s in profile.params:
        m = pat.match(n)
        if m and int(m.group(1)) == 1 and len(s) >= 2:
            total += math.prod(s)
    return total


def profile_by_layers(
    build: Callable[[int], nn.Module],
    layers: int,
    make_inp: Callable[[nn.Module], dict],
    step_fn: Callable[[nn.Module, dict], Any],
    dtype: torch.dtype = torch.float32,
) -> StepProfile:
    """Profile a stack of ``layers`` identical layers from traces of the same model built with 2
    and 3 layers (``build(n)``).

    Order and parameters come from the 3-layer trace, repeated (:func:`expand_layers`). Activation
    and buffer bytes are extrapolated linearly: ``a(L) = a(3) + (L - 3) (a(3) - a(2))``, which is
    exact when each extra layer adds the same saved activations and the peak stays at the same
    relative place (true for uniform transformer stacks, with or without checkpointing).
    """
    if layers <= 3:
        m = build(layers)
        return profile_step(m, make_inp(m), step_fn, dtype)
    m2, m3 = build(2), build(3)
    p2 = profile_step(m2, make_inp(m2), step_fn, dtype)
    p3 = profile_step(m3, make_inp(m3), step_fn, dtype)
    stack, n = find_layer_stack(m3)
    if n != 3:
        raise ValueError(f"build(3) made a layer stack {stack!r} of {n} layers, expected 3")
    full = expand_layers(p3, stack, 3, layers)
    extra = layers - 3

    def lin(a3: int, a2: int) -> int:
        return int(a3 + extra * (a3 - a2))

    peaks3, peaks2 = p3.info.get("phase_peaks", {}), p2.info.get("phase_peaks", {})
    info = dict(full.info, source="tracer, 2- and 3-layer traces extrapolated by layer repetition",
                traced_layers=(2, 3), layers=layers,
                phase_peaks={k: lin(v, peaks2.get(k, v)) for k, v in peaks3.items()})
    return StepProfile(
        params=full.params, shared=full.shared, frozen=full.frozen, frozen_shapes=full.frozen_shapes, steps=full.steps,
        step_kinds=full.step_kinds,
        activation_bytes=lin(p3.activation_bytes, p2.activation_bytes),
        buffer_bytes=lin(p3.buffer_bytes, p2.buffer_bytes), matmul_param_numel=full.matmul_param_numel,
        tokens=full.tokens, dtype=full.dtype, info=info,
        op_costs=(p3.op_costs.combine(p2.op_costs, 1.0 + extra, -float(extra))
                  if p3.op_costs is not None and p2.op_costs is not None else None),
    )
