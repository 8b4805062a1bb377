"""torch's column- and row-parallel styles for Hugging Face's ``Conv1D`` (GPT-2's linear layers).

``Conv1D`` is a linear layer whose weight is stored transposed (``[in, out]``), so torch's
``ColwiseParallel`` / ``RowwiseParallel`` (which accept ``nn.Linear`` and ``nn.Embedding`` only)
shard the other weight dimension. Everything else, the input and output redistribution and the
DTensor compute, is torch's own.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


def _distribute(module: nn.Module, mesh: Any, placements: dict[str, Any], src: Any) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        dt = distribute_tensor(param, mesh, [placements[name]], src_data_rank=src)
        module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


class Conv1DColwise(ColwiseParallel):
    """``ColwiseParallel`` for ``Conv1D``: weight ``Shard(1)`` (its output columns), bias ``Shard(0)``."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not _is_conv1d(module):
            return super()._apply(module, device_mesh)
        return distribute_module(
            module, device_mesh,
            lambda n, m, mesh: _distribute(m, mesh, {"weight": Shard(1), "bias": Shard(0)}, self.src_data_rank),
            lambda m, inputs, mesh: self._prepare_input_fn(self.input_layouts, self.desired_input_layouts, m, inputs, mesh),
            lambda m, outputs, mesh: self._prepare_output_fn(self.output_layouts, self.use_local_output, m, outputs, mesh),
        )


class Conv1DRowwise(RowwiseParallel):
    """``RowwiseParallel`` for ``Conv1D``: weight ``Shard(0)`` (its input rows), bias replicated."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not _is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh,
            lambda n, m, mesh: _distribute(m, mesh, {"weight": Shard(0), "bias": Replicate()}, self.src_data_rank),
            lambda m, inputs, mesh: self._prepare_input_fn(self.input_layouts, self.desired_input_layouts, m, inputs, mesh),
            lambda m, outputs, mesh: self._prepare_output_fn(self.output_layouts, self.use_local_output, m, outputs, mesh),
        )
