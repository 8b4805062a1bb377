"""Parameter-use hooks at the one granularity shared by the tracer and the runtime.

**Granularity (the definition of a "step").** A *param-owning module* is a module with at least
one direct parameter (``module.parameters(recurse=False)`` is not empty). A step is one of:

- ``FORWARD``: a call of a param-owning module's ``forward``, fired by a forward pre-hook before
  the forward body runs. It touches the module's direct parameters. A call that happens while the
  autograd engine runs a backward pass (gradient-checkpoint recomputation, reentrant or not) is
  reported as ``RECOMPUTE``.
- ``BACKWARD``: the start of the backward of one such call, fired (once per call) by a
  ``register_multi_grad_hook(mode="any")`` on that call's outputs that require grad, i.e. when the
  first gradient with respect to any of those outputs has been computed and before the module's
  own backward nodes run. A call whose outputs do not require grad has no backward step.

A parameter is named by its canonical name: the first name ``model.named_parameters()`` gives it,
so a tied parameter has one name wherever it is used. Frozen parameters count too: a module whose
direct parameters are all frozen still makes steps (a runtime that keeps frozen parameters out of
its chunks sees those steps as empty and can skip them, as ``elixir.chunk.Schedule`` does).

The runtime fires its gather/prefetch logic through :func:`install_step_hooks`, so a traced order
(``elixir.tracer.param_tracer.generate_tf_order``) indexes exactly the steps the runtime sees.
Parameters used outside their owner's ``forward`` are not covered by this granularity; the tracer
reports them as ``external_params``.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional

import torch
import torch.nn as nn

__all__ = [
    "StepKind",
    "current_phase",
    "recomputing",
    "param_owning_modules",
    "canonical_param_names",
    "tensors_in",
    "map_tensors",
    "install_step_hooks",
    "StepHooks",
]


class StepKind(str, enum.Enum):
    """Which hook produced a step (also the phase an op runs in)."""

    FORWARD = "forward"
    RECOMPUTE = "recompute"
    BACKWARD = "backward"


_state = threading.local()


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Mark code as recomputation even under ``no_grad`` (a reentrant checkpoint nested in a
    recomputed region runs its forward under ``no_grad``)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def current_phase() -> StepKind:
    """The phase the calling code runs in.

    Inside the autograd engine with grad mode enabled (or inside :func:`recomputing`) means
    recomputation (both reentrant and non-reentrant checkpointing recompute under ``enable_grad``);
    inside the engine otherwise means backward; outside it, forward. (A ``create_graph=True``
    backward would read as recompute.)
    """
    if torch._C._current_graph_task_id() == -1:
        return StepKind.FORWARD
    if torch.is_grad_enabled() or getattr(_state, "depth", 0) > 0:
        return StepKind.RECOMPUTE
    return StepKind.BACKWARD


def canonical_param_names(model: nn.Module) -> dict[int, str]:
    """``id(param) -> canonical name`` (first name in ``named_parameters()``)."""
    return {id(p): n for n, p in model.named_parameters()}


# Modules whose forward reads a child's parameters functionally, never calling the child: the
# child's parameters are used while the parent runs, so they belong to the parent's step.
FUNCTIONAL_CHILDREN: dict[type, tuple[str, ...]] = {nn.MultiheadAttention: ("out_proj",)}


def borrowed_children(model: nn.Module) -> set[int]:
    """ids of modules whose parameters their parent uses functionally (see ``FUNCTIONAL_CHILDREN``)."""
    out = set()
    for mod in model.modules():
        for cls, names in FUNCTIONAL_CHILDREN.items():
            if isinstance(mod, cls):
                out.update(id(getattr(mod, n)) for n in names if isinstance(getattr(mod, n, None), nn.Module))
    return out


def step_params(mod: nn.Module, borrowed: set[int]) -> list[nn.Parameter]:
    """The parameters ``mod``'s step uses: its direct ones, plus those of children it reads
    functionally; none for a borrowed child itself (its parent's step covers them)."""
    if id(mod) in borrowed:
        return []
    out = [p for p in mod._parameters.values() if p is not None]
    for child in mod.children():
        if id(child) in borrowed:
            out.extend(p for p in child.parameters() if p is not None)
    return out


def param_owning_modules(model: nn.Module) -> list[tuple[str, nn.Module, tuple[str, ...]]]:
    """``(module_name, module, canonical names of its step's params)`` for each module whose step
    uses parameters (:func:`step_params`).

    A module object reachable under several names is listed once (first name).
    """
    names = canonical_param_names(model)
    borrowed = borrowed_children(model)
    out = []
    for mname, mod in model.named_modules():
        direct = tuple(dict.fromkeys(names[id(p)] for p in step_params(mod, borrowed)))
        if direct:
            out.append((mname, mod, direct))
    return out


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested tuples, lists and dicts (including ``ModelOutput``)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tensors_in(x)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with every tensor inside nested tuples (named ones rebuilt as such), lists and dicts
    replaced by ``fn(tensor)``; dicts (``ModelOutput`` included) are updated in place."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(x, fn) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        for k in list(obj.keys()):
            obj[k] = map_tensors(obj[k], fn)
        return obj
    return obj


StepCallback = Callable[[StepKind, str, nn.Module], None]


@dataclass
class StepHooks:
    """Handles of the hooks installed by :func:`install_step_hooks`; call :meth:`remove`."""

    handles: List[Any]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def install_step_hooks(
    model: nn.Module,
    on_forward: Optional[StepCallback] = None,
    on_backward: Optional[StepCallback] = None,
    on_forward_end: Optional[StepCallback] = None,
) -> StepHooks:
    """Install the step hooks on every param-owning module of ``model``.

    ``on_forward(kind, module_name, module)`` runs before each forward call, with ``kind``
    ``FORWARD`` or ``RECOMPUTE``; ``on_backward(StepKind.BACKWARD, module_name, module)`` runs at the
    start of each call's backward (see the module docstring). ``on_forward_end(kind, name, module)``
    (optional, not a step) runs when that forward call returns, e.g. to release its parameters.
    Hooks run in module registration order; returns the handles to remove them.
    """
    handles: list = []
    for mname, mod, _ in param_owning_modules(model):
        if on_forward is not None:
            def pre(m, args, _name=mname):
                # a module forward inside a backward pass is a recomputation, whatever the grad mode
                in_bwd = torch._C._current_graph_task_id() != -1
                on_forward(StepKind.RECOMPUTE if in_bwd else StepKind.FORWARD, _name, m)

            handles.append(mod.register_forward_pre_hook(pre))
        if on_backward is not None or on_forward_end is not None:
            def post(m, args, output, _name=mname):
                if on_forward_end is not None:
                    on_forward_end(current_phase(), _name, m)
                if on_backward is None:
                    return None
                outs = [t for t in tensors_in(output) if t.requires_grad]
                if not outs:
                    return None

                def fire(_grad, _m=m):
                    on_backward(StepKind.BACKWARD, _name, _m)

                torch.autograd.graph.register_multi_grad_hook(outs, fire, mode="any")
                return None

            handles.append(mod.register_forward_hook(post))
    return StepHooks(handles)
