"""Install what a load read and every rank agreed on: master slices, frozen pieces, buffers, the
optimizer's state and groups, the loss scaler (the one write phase of every checkpoint load)."""

from __future__ import annotations

from typing import Optional

import torch

from elixir.checkpoint import layout
from elixir.wrapper import lowbit_state, optim_state
from elixir.wrapper.module import ElixirModule
from elixir.wrapper.optimizer import ElixirOptimizer


def commit_load(em: ElixirModule, eo: Optional[ElixirOptimizer], plan: dict, mapped: dict[int, torch.Tensor]) -> None:
    """Install what every rank read; ``mapped``: the masters of disk chunks, mapped from the offload
    file. The optimizer state is cut into fragments first, so writing a bf16-kahan master takes
    the compensation saved with it (:func:`~elixir.wrapper.lowbit_state.load_values`)."""
    loading = None
    if eo is not None and plan["opt"] is not None:
        if "full" in plan["opt"]:
            loading = optim_state.fragment_states_of_full(eo, plan["opt"]["full"])
            groups = plan["opt"]["full"]["param_groups"]
        else:
            loading = {
                f.tensor: {k: (v.to(f.tensor.device) if isinstance(v, torch.Tensor) and v.dim() >= 1 else v) for k, v in st.items()}
                for f, st in plan["opt"]["state"]
            }
            groups = plan["opt"]["groups"]
    with torch.no_grad():
        em.cache.release_all()
        em.streams.synchronize()  # no side-stream copy still reads what the host overwrites
        by_chunk: dict[int, list] = {}
        for f, v in plan["values"]:
            by_chunk.setdefault(f.chunk, []).append((f, v))
        for index, values in sorted(by_chunk.items()):
            c = em.chunks[index]
            master = mapped.get(c.index, c.master)
            with c.shard_access(write=True):  # a disk shard: one chunk's staged at a time
                for f, v in values:
                    state = None if loading is None else loading.get(f.tensor, {})
                    lowbit_state.load_values(em, c, f.lo, f.hi, v.reshape(-1), master, state)
        by_chunk: dict[int, list] = {}
        for fp, v in plan["frozen"]:
            by_chunk.setdefault(fp.chunk, []).append((fp, v))
        for ci, items in by_chunk.items():
            with em.all_chunks[ci].shard_access(write=True) as shard:  # a disk shard: staged, written back
                for fp, v in items:
                    shard[fp.lo : fp.hi].copy_(v)  # converts (a bf16 save into an fp32 chunk and back)
        tensors = layout.module_tensors(em)
        for k, v in plan["module"].items():
            tensors[k].data.copy_(v)
        em.publish_updates()  # ZeRO-1/2 chunks: every rank wrote its slice of the payload
    if loading is not None:
        optim_state.install_state(eo, loading, groups)
        if eo.scaler is not None and plan["scaler"] is not None:
            eo.scaler.load_state_dict(plan["scaler"])
        eo.forget_torn_step()  # a step a disk fault left partly applied is behind us
        eo.zero_grad()
