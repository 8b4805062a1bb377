"""ColossalAI's ``launch`` and ``launch_from_torch`` on elixir: initialise the default process
group and seed every generator, so ColossalAI programs start unchanged (``import elixir.booster
as colossalai`` in place of ``import colossalai``)."""

from __future__ import annotations

import os
import random
from typing import Optional

import torch

from elixir import distributed as edist


def _seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np  # optional dependency: seeded when installed, as ColossalAI does

        np.random.seed(seed)
    except ImportError:
        pass


def launch_from_torch(backend: Optional[str] = None, seed: int = 1024, verbose: bool = True) -> edist.DistInfo:
    """The process group from torchrun's environment (one process without it), then every random
    generator seeded with ``seed``, as ColossalAI does. ``backend``: as ColossalAI, the device's
    own (gloo on CPU, nccl on CUDA) whatever is passed. Safe to call when already initialised."""
    info = edist.init_distributed()
    _seed(seed)
    if verbose and info.rank == 0:
        print(f"elixir: distributed environment initialised, world size {info.world_size}")
    return info


def launch(rank: int, world_size: int, host: str, port: int, backend: Optional[str] = None,
           local_rank: Optional[int] = None, seed: int = 1024, verbose: bool = True) -> edist.DistInfo:
    """Join a ``world_size``-rank group as ``rank`` through ``host:port`` (ColossalAI's
    ``launch``), then seed as :func:`launch_from_torch`. Safe to call when already initialised
    (the existing group is kept)."""
    if not edist.is_initialized():
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=str(host), MASTER_PORT=str(port),
                          LOCAL_RANK=str(rank if local_rank is None else local_rank))
    return launch_from_torch(backend, seed, verbose)
