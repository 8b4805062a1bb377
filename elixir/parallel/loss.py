"""Loss parallelism: the causal-LM loss on logits left split over the vocabulary.

A head planned with ``loss_parallel=True`` (:func:`elixir.parallel.tensor.tensor_parallel`) returns
its logits as a ``DTensor`` sharded on the last (vocabulary) dim: no rank ever holds the whole
``[batch, seq, vocab]`` logits. torch computes the cross-entropy on them under
``torch.distributed.tensor.parallel.loss_parallel()`` (a max, a sum of exponentials and the
target's logit reduced over tp), and that context must also be active when the backward runs
through the loss. :func:`vocab_parallel_lm_loss` returns a plain tensor (``.full_tensor()`` of the
replicated DTensor loss, so it can be all-reduced, logged, scaled) whose backward enters the
context when it starts and leaves it when the gradient reaches the logits: ``loss.backward()``
(or the Booster's) needs nothing more.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """Token ``t`` predicts ``labels[t + 1]``; the last position predicts nothing (-100)."""
    return nn.functional.pad(labels[:, 1:], (0, 1), value=-100).reshape(-1)


def vocab_parallel_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``labels=`` causal-LM loss (mean over the tokens, ``-100`` ignored, fp32) of
    ``logits`` ``[batch, seq, vocab]``: a DTensor split over the vocabulary (loss parallelism) or a
    plain tensor (then plain cross-entropy). Returns a plain scalar tensor, the same on every tp rank."""
    split = isinstance(logits, DTensor)
    with loss_parallel() if split else contextlib.nullcontext():
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), _shifted(labels), ignore_index=-100)
    if not split:
        return loss
    loss = loss.full_tensor()
    if loss.requires_grad:
        _backward_under_loss_parallel(loss, logits)
    return loss


def _backward_under_loss_parallel(loss: torch.Tensor, logits: torch.Tensor) -> None:
    """Enter ``loss_parallel()`` when the backward starts at ``loss``, leave it when the gradient
    reaches ``logits`` (torch requires the context around the cross-entropy's backward)."""
    ctx = loss_parallel()

    def enter(grad: torch.Tensor) -> torch.Tensor:
        ctx.__enter__()
        return grad

    def leave(grad: torch.Tensor) -> torch.Tensor:
        ctx.__exit__(None, None, None)
        return grad

    loss.register_hook(enter)
    logits.register_hook(leave)


__all__ = ["vocab_parallel_lm_loss"]
