"""Binding the inner optimizer's state of disk chunks to the DiskStore's flats.

The optimizer creates its state lazily (``zeros_like`` on the first step) and loading replaces it
wholesale, so after either the state tensors of a disk chunk's fragments are ordinary tensors.
:func:`bind_state` moves each elementwise one into the chunk's flat for its key (a view of
``flat[lo:hi]`` replaces it in ``optimizer.state``), copied while the chunk is staged (views of
an offloaded flat cannot be made). Scalar state (``step``) stays in the optimizer as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from elixir.offload.store import DiskStore
from elixir.wrapper.optim_state import _elementwise

if TYPE_CHECKING:
    from elixir.wrapper.optimizer import ElixirOptimizer


def _is_bound(v: torch.Tensor, flat: torch.Tensor, lo: int, n: int) -> bool:
    return (
        v.untyped_storage()._cdata == flat.untyped_storage()._cdata
        and v.storage_offset() == lo
        and v.numel() == n
        and v.is_contiguous()
    )


def bind_state(store: DiskStore, eo: ElixirOptimizer, index: int) -> int:
    """Bind chunk ``index``'s elementwise optimizer state to its flats; return how many state
    tensors were moved (0 when everything was already bound)."""
    rec = store.chunks[index]
    if not store.is_resident(index):
        raise RuntimeError(f"disk chunk {index} must be staged to bind its optimizer state")
    state = eo.optim.state
    moved = 0
    for f in eo.chunk_fragments(index):
        st = state.get(f.tensor)
        if not st:
            continue
        n = f.hi - f.lo
        for k, v in list(st.items()):
            if not _elementwise(v, n):
                continue
            flat = rec.flats.get(k)
            if flat is None:
                flat = store.add_flat(index, k, v.dtype)
            elif flat.dtype != v.dtype:
                raise TypeError(
                    f"optimizer state {k!r} of a disk chunk changed dtype ({flat.dtype} -> {v.dtype}); "
                    "disk offload needs a fixed dtype per state key"
                )
            if _is_bound(v, flat, f.lo, n):
                continue
            flat[f.lo : f.hi].copy_(v.detach().reshape(-1))
            st[k] = flat[f.lo : f.hi].view(v.shape)
            moved += 1
    return moved
