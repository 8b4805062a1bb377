"""Binding the inner optimizer's state of disk chunks to the DiskStore's flats.

The optimizer creates its state lazily (``zeros_like`` on the first step) and loading replaces it
wholesale, so after either the state tensors of a disk chunk's fragments are ordinary tensors.
:func:`bind_state` moves each elementwise one into the chunk's flat for its key (a view of
``flat[lo:hi]`` replaces it in ``optimizer.state``), copied while the chunk is staged (views of
an offloaded flat cannot be made). Scalar state (``step``) stays in the optimizer as it is.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from elixir.offload.store import DiskStore

# One fragment of a chunk as the binding sees it: the optimizer's state dict of the fragment's
# tensor (None before the first step; entries are replaced in place) and its range [lo, hi) in the chunk.
FragmentState = tuple[Optional[dict], int, int]


def is_elementwise(value: object, numel: int) -> bool:
    """Whether an optimizer state entry holds one value per element of a ``numel``-element
    parameter (Adam's ``exp_avg``) rather than a scalar (``step``): only those are bound to the
    disk, sharded and sliced (the optimizer state dict and checkpoints ask this too)."""
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.numel() == numel


def is_bound(v: torch.Tensor, flat: torch.Tensor, lo: int, n: int) -> bool:
    """Whether ``v`` is already the view ``flat[lo : lo + n]``."""
    return (
        v.untyped_storage()._cdata == flat.untyped_storage()._cdata
        and v.storage_offset() == lo
        and v.numel() == n
        and v.is_contiguous()
    )


def bind_state(store: DiskStore, index: int, fragments: Sequence[FragmentState]) -> int:
    """Bind chunk ``index``'s elementwise optimizer state (``fragments``: the state of each of its
    fragments) to its flats; return how many state tensors were moved (0 when all were bound)."""
    rec = store.chunks[index]
    if not store.is_resident(index):
        raise RuntimeError(f"disk chunk {index} must be staged to bind its optimizer state")
    moved = 0
    for st, lo, hi in fragments:
        if not st:
            continue
        n = hi - lo
        for k, v in list(st.items()):
            if not is_elementwise(v, n):
                continue
            flat = rec.flats.get(k)
            if flat is None:
                flat = store.add_flat(index, k, v.dtype)
            elif flat.dtype != v.dtype:
                raise TypeError(
                    f"optimizer state {k!r} of a disk chunk changed dtype ({flat.dtype} -> {v.dtype}); "
                    "disk offload needs a fixed dtype per state key"
                )
            if is_bound(v, flat, lo, n):
                continue
            flat[lo:hi].copy_(v.detach().reshape(-1))
            st[k] = flat[lo:hi].view(v.shape)
            moved += 1
    return moved
