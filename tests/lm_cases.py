"""The causal-LM training loop several tests share: one step per batch of token ids (the ids are
their own labels), the losses returned."""

from __future__ import annotations

from typing import Iterable

import torch


def lm_steps(em, opt, batches: Iterable[torch.Tensor]) -> list[float]:
    losses = []
    for ids in batches:
        loss = em(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
