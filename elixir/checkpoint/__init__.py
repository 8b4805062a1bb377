"""Checkpoints of an ElixirModule and its ElixirOptimizer: sharded or full, atomic, reshardable.

``save(path, model, optimizer, extra=None, shard=True)`` and ``load(path, model, optimizer)``
(collective: call both on every rank; ``path`` must be on a file system every rank sees).

**Sharded** (``shard=True``): every rank writes ``rank{r:05d}-of-{W:05d}.safetensors`` (rank 0 of 2:
``rank00000-of-00002.safetensors``) holding its fp32
master slices and the matching elementwise optimizer state, each under a key naming the parameter
and the *global* ``[start, end)`` range it covers in the flattened parameter; replicated chunks,
frozen parameters and buffers are written once, by rank 0. Rank 0 writes ``index.json``: every
tensor's file, key, range and dtype, file sizes, a fingerprint of the model (names and shapes), the
optimizer's param groups by parameter name with its scalar state (``step``), the loss scaler, and
whether ``extra.pt`` exists. Loading reassembles whatever ranges the current plan needs, so a
checkpoint saved at world size N (or with another plan) loads at world size M.

**Full** (``shard=False``): rank 0 writes ``model.safetensors`` (Hugging Face compatible: tied
weights once, under the first name, as ``save_pretrained`` does; ``config.json`` too when the
model has a HF config), ``optimizer.pt`` (a torch optimizer state dict that loads into a plain
torch optimizer on the unwrapped model) and ``index.json``.

**Atomic**: everything goes into a temporary directory beside ``path``; files and directory are
fsynced, then the directory is renamed into place (an older checkpoint at ``path`` is first
renamed aside and removed after). A crash at any moment leaves the previous checkpoint loadable:
if it falls between the two renames, :func:`load` finds the renamed-aside copy.

**Damage**: the index records every file's CRC-32 (:mod:`elixir.checkpoint.checksum`); ``load``
checks each file before reading it and before changing anything, and names a damaged file.
``verify(path)`` (also ``elixir checkpoint verify PATH``) checks a checkpoint without loading it.
Checkpoints written before checksums load unchecked (``verify`` says it cannot check them).

**Bad input** (missing or truncated files, another model's checkpoint, a dtype that is not the
saved one, mismatched optimizer groups) raises :class:`CheckpointError` on every rank before
anything in the model or optimizer is modified.

**Where each part lives**: ``format.py`` (safetensors files, on the ``safetensors`` library),
``index.py`` (``index.json``, typed), ``atomic.py`` (the whole-directory commit), ``layout.py``
(what of the model and optimizer a checkpoint holds), ``save.py``, ``load.py``, ``consolidate.py``,
``checksum.py``, ``verify.py``, ``errors.py`` (:class:`CheckpointError` and the one rule for raising it on every rank),
``mesh.py`` / ``mesh_source.py`` (checkpoints of tensor- and pipeline-parallel models that load
at another mesh layout: :func:`save_mesh`, :func:`load_mesh`; ``mesh_pretrained.py``: their
Hugging Face files, no rank gathering the whole model: :func:`save_pretrained_mesh`), ``pretrained.py`` (Hugging Face directories: :func:`load_pretrained` reads only each rank's rows,
:func:`save_pretrained` writes the sharded HF layout one gathered chunk at a time).
"""

from elixir.checkpoint.consolidate import consolidate
from elixir.checkpoint.errors import CheckpointError
from elixir.checkpoint.index import FORMAT, VERSION, Entry, Index
from elixir.checkpoint.latest import latest, step_path
from elixir.checkpoint.load import load
from elixir.checkpoint.mesh import load_mesh, save_mesh
from elixir.checkpoint.mesh_pretrained import save_pretrained_mesh
from elixir.checkpoint.pretrained import (
           LoadReport,
           load_pretrained,
           read_pretrained,
           save_pretrained,
           save_state_dict_pretrained,
)
from elixir.checkpoint.save import save
from elixir.checkpoint.verify import Verified, verify

__all__ = ["CheckpointError", "save", "load", "save_mesh", "load_mesh", "save_pretrained_mesh", "consolidate", "verify", "Verified", "latest", "step_path", "load_pretrained", "save_pretrained", "read_pretrained",
           "save_state_dict_pretrained", "LoadReport", "FORMAT", "VERSION", "Index", "Entry"]
