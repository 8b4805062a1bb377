"""A real text corpus that every machine already has: the Python standard library's source code.

The demo models it byte by byte (vocabulary 256), so there is no tokenizer and no download. Files are
read in sorted relative-path order, so the corpus is deterministic for a given Python installation.
The split is by file: every ``val_every``-th file is held out for validation, so validation text is
never seen in training.

Batches are drawn as a *global* batch of ``world_size * batch_size`` windows from a generator seeded
by ``(seed, step)``; each rank takes its own slice. All ranks therefore agree on the global batch
without communicating, and a world-1 run on the global batch sees exactly the same data.
"""

from __future__ import annotations

import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

VOCAB_SIZE = 256
"""Byte-level vocabulary."""

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"})


def stdlib_root() -> Path:
    """The directory holding the standard library's ``.py`` files."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Optional[os.PathLike] = None) -> list[Path]:
    """The ``.py`` files under ``root`` (default: the standard library), in sorted relative-path
    order, skipping installed packages and test suites."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a directory")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


@dataclass(frozen=True)
class Corpus:
    """Byte streams for training and validation.

    Attributes:
        train: ``uint8`` tensor of training bytes (files concatenated in order).
        val: ``uint8`` tensor of held-out bytes.
        train_files: how many files went into ``train``.
        val_files: how many files went into ``val``.
        source: where the text came from (a directory).
    """

    train: torch.Tensor
    val: torch.Tensor
    train_files: int
    val_files: int
    source: str

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE


def load_corpus(
    max_bytes: int = 4_000_000,
    val_every: int = 20,
    root: Optional[os.PathLike] = None,
    files: Optional[Sequence[os.PathLike]] = None,
) -> Corpus:
    """Read files in order until ``max_bytes`` (train + val) are collected.

    Every ``val_every``-th file (index ``val_every - 1``, ``2 * val_every - 1``, ...) goes to the
    validation split; the rest to training. Raises ``ValueError`` when either split comes out empty
    (too few or too small files: raise ``max_bytes`` or lower ``val_every``).
    """
    if val_every < 2:
        raise ValueError(f"val_every must be >= 2 (got {val_every})")
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive (got {max_bytes})")
    root_path = Path(root) if root is not None else stdlib_root()
    paths = [Path(f) for f in files] if files is not None else corpus_files(root_path)
    train_parts: list[bytes] = []
    val_parts: list[bytes] = []
    total = 0
    for i, path in enumerate(paths):
        if total >= max_bytes:
            break
        data = path.read_bytes()[: max_bytes - total]
        if not data:
            continue
        (val_parts if i % val_every == val_every - 1 else train_parts).append(data)
        total += len(data)
    if not train_parts or not val_parts:
        raise ValueError(
            f"corpus from {root_path} has {len(train_parts)} training and {len(val_parts)} validation "
            f"files after reading {total} bytes; raise max_bytes or lower val_every"
        )
    return Corpus(
        train=_to_tensor(b"".join(train_parts)),
        val=_to_tensor(b"".join(val_parts)),
        train_files=len(train_parts),
        val_files=len(val_parts),
        source=str(root_path) if files is None else "<files>",
    )


def _to_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _check_window(data: torch.Tensor, seq_len: int) -> None:
    if data.numel() < seq_len + 2:
        raise ValueError(f"a split of {data.numel()} bytes is too short for windows of {seq_len} + 1")


def _windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts.unsqueeze(1) + torch.arange(seq_len + 1).unsqueeze(0)
    win = data[idx].long()
    return win[:, :-1].contiguous(), win[:, 1:].contiguous()


def sample_batch(
    data: torch.Tensor,
    batch_size: int,
    seq_len: int,
    step: int,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch for ``step``: ``(inputs, targets)``, each
    ``(batch_size, seq_len)`` int64, targets shifted by one byte."""
    _check_window(data, seq_len)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - seq_len - 1, (world_size * batch_size,), generator=gen)
    return _windows(data, starts[rank * batch_size : (rank + 1) * batch_size], seq_len)


def eval_batches(
    data: torch.Tensor, batch_size: int, seq_len: int, n_batches: int, rank: int = 0, world_size: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed validation set of ``n_batches`` global batches (evenly spaced windows over ``data``),
    and this rank's slice of each. The same on every call."""
    _check_window(data, seq_len)
    total = n_batches * world_size * batch_size
    starts = torch.linspace(0, data.numel() - seq_len - 2, total).long()
    out = []
    for b in range(n_batches):
        lo = (b * world_size + rank) * batch_size
        out.append(_windows(data, starts[lo : lo + batch_size], seq_len))
    return out


def lm_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-byte cross-entropy of a causal LM (a Hugging Face model: ``.logits``) on one batch."""
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


def perplexity(model, data: torch.Tensor, batch_size: int, seq_len: int, n_batches: int,
               rank: int = 0, world_size: int = 1) -> float:
    """Perplexity of ``model`` over :func:`eval_batches` (the same on every call), averaged over
    the ranks (collective when ``world_size > 1``); the model is put back in training mode."""
    total = torch.zeros(2)
    model.eval()
    with torch.no_grad():
        for x, y in eval_batches(data, batch_size, seq_len, n_batches, rank, world_size):
            total += torch.tensor([lm_loss(model, x, y).item(), 1.0])
    model.train()
    if world_size > 1:
        torch.distributed.all_reduce(total)
    return math.exp(total[0] / total[1])

