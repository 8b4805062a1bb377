"""Shared by the mesh tests (tensor and pipeline parallel): the one-process full-batch reference,
the torch DDP run beside it, the tiny LLaMA they train and the plugin's training loop."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from elixir import distributed as edist
from elixir.testing.reference import shard_batch


def sgd_reference(model: nn.Module, batches: list[dict], loss: Callable[[nn.Module, dict], torch.Tensor], lr: float,
                  max_norm: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain torch on the full batch: SGD with global-norm clipping; the losses and final weights."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for batch in batches:
        out = loss(model, batch)
        out.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(out.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def ddp_reference(model: nn.Module, batches: list[dict], loss: Callable[[nn.Module, dict], torch.Tensor], lr: float,
                  max_norm: float, dp_group, dp_rank: int, dp: int, micro: int = 1) -> dict[str, torch.Tensor]:
    """torch DDP over the dp ranks on each one's slice of every batch, in ``micro`` microbatches
    (gradients accumulated under ``no_sync`` but for the last, each loss divided by ``micro``), SGD
    with global-norm clipping; the final weights. The error every mesh test is held to twice of."""
    ddp = DistributedDataParallel(model, process_group=dp_group)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    for batch in batches:
        mine = shard_batch(batch, dp_rank, dp)
        for k in range(micro):
            sync = ddp.no_sync() if k < micro - 1 else contextlib.nullcontext()
            with sync:
                (loss(ddp, shard_batch(mine, k, micro)) / micro).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}


def cache_use(em) -> dict:
    """How an ElixirModule's rCache was used so far: its peak of gathered chunks, the plan's blocks,
    and the parameters gathered on access (read while released, so held to the end of backward)."""
    return {"peak": em.cache.peak_resident, "blocks": em.cache.capacity, "on_access": sorted(em._access.names)[:3]}


def check_cache_use(use: dict, what) -> None:
    """The run kept to its plan's rCache, and no parameter was gathered outside its module's step
    (under tensor parallelism, DTensor's ``from_local`` of a released shard once did: every chunk
    stayed gathered to the end of backward)."""
    assert not use["on_access"] and use["peak"] <= use["blocks"], (what, use)


def tiny_llama(layers: int = 2, tie: bool = False) -> nn.Module:
    """A LLaMA-style decoder small enough for 4 CPU ranks: 2 heads and 2 key/value heads (tp 2
    divides both), vocabulary 128 (the zoo's batches), seeded."""
    # optional dependency: transformers (the hf extra)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=tie))


class Rows(torch.utils.data.Dataset):
    """One batch's rows as a dataset of ``{"input_ids", "labels"}`` (what a plugin's dataloader reads)."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def plugin_steps(booster, plugin, model, opt, batches: list[dict],
                 loss: Callable[[nn.Module, dict], torch.Tensor]) -> list[float]:
    """Train a HybridParallelPlugin-boosted model one step per batch (``execute_pipeline`` when
    pipelined, ``model(...)`` / ``booster.backward`` otherwise, each dp rank on its rows); the
    whole batch's mean loss of each step, the same on every rank."""
    out = []
    for batch in batches:
        if plugin.pp_size > 1:
            loader = plugin.prepare_dataloader(Rows(batch["input_ids"]), batch_size=len(batch["input_ids"]) // plugin.dp_size)
            value = booster.execute_pipeline(iter(loader), model, lambda outputs, inputs: outputs.loss, opt)["loss"]
        else:
            value = loss(model, shard_batch(batch, plugin.mesh.get_local_rank("dp_shard"), plugin.dp_size))
            booster.backward(value, opt)
        opt.step()
        opt.zero_grad()
        held = torch.tensor([0.0 if value is None else value.item(), float(value is not None)], dtype=torch.float64)
        edist.all_reduce(held)
        out.append(held[0].item() / held[1].item())
    return out
