"""``index.json``: what a checkpoint holds, where, and for which model (typed).

The JSON layout is the one elixir has always written (format ``elixir-checkpoint``, version 1);
:meth:`Index.to_json` and :meth:`Index.from_json` are exact inverses on it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from elixir.checkpoint.checksum import check_file
from elixir.checkpoint.errors import CheckpointError
from elixir.checkpoint.format import dtype_name, dtype_of
from elixir.fileio import atomic_write_json

FORMAT = "elixir-checkpoint"
"""The format name every checkpoint index records."""
VERSION = 1
"""The version of the checkpoint format this elixir writes."""
INDEX = "index.json"


@dataclass
class Entry:
    """One tensor in a sharded checkpoint's files.

    ``kind`` is ``"param"`` (an fp32 master slice), ``"frozen"`` (a slice of a frozen chunk's
    shard, in its own dtype), ``"state"`` (a slice of the elementwise optimizer state
    ``state_key``) or ``"module"`` (a buffer or a frozen parameter kept out of chunks, whole, of
    ``shape``).
    ``[start, end)`` is the slice's range in the *flattened* parameter ``name``.
    """

    kind: str
    name: str
    key: str
    dtype: str
    file: str = ""
    start: Optional[int] = None
    end: Optional[int] = None
    state_key: Optional[str] = None
    shape: Optional[list[int]] = None

    def to_json(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, d: dict) -> Entry:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class Index:
    """A checkpoint's index.

    Attributes:
        kind: ``"sharded"`` (one file per rank, ``entries`` list them) or ``"full"``
            (``model.safetensors`` + ``optimizer.pt``; ``aliases`` maps tied names to the saved one).
        world_size: the world size it was saved at.
        model: the model's fingerprint, ``{"params": {name: shape}, "tensors": {name: shape}}``.
        files: every file's size in bytes (checked on load: a truncated copy is refused).
        checksums: every file's checksum (:mod:`elixir.checkpoint.checksum`), checked before a
            file is read; empty for checkpoints written before elixir stored them (those load
            unchecked).
        optimizer: param groups by parameter name (with JSON-encoded hyper-parameters), the
            optimizer's class, and for sharded checkpoints its non-elementwise state (``scalars``).
        loss_scaler: the loss scaler's state dict, if any.
        extra: whether ``extra.pt`` holds the caller's ``extra``.
    """

    kind: str
    world_size: int
    model: dict
    files: dict[str, int]
    optimizer: Optional[dict] = None
    loss_scaler: Optional[dict] = None
    extra: bool = False
    entries: list[Entry] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    checksums: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        d: dict[str, Any] = {"format": FORMAT, "version": VERSION, "kind": self.kind, "world_size": self.world_size,
                             "model": self.model, "files": self.files}
        if self.checksums:
            d["checksums"] = self.checksums
        if self.kind == "sharded":
            d["entries"] = [e.to_json() for e in self.entries]
        else:
            d["aliases"] = self.aliases
        d.update(optimizer=self.optimizer, loss_scaler=self.loss_scaler, extra=self.extra)
        return d

    @classmethod
    def from_json(cls, d: dict) -> Index:
        return cls(
            kind=d["kind"], world_size=d["world_size"], model=d["model"], files=d["files"],
            optimizer=d.get("optimizer"), loss_scaler=d.get("loss_scaler"), extra=bool(d.get("extra")),
            entries=[Entry.from_json(e) for e in d.get("entries", [])], aliases=d.get("aliases", {}),
            checksums=d.get("checksums", {}),
        )

    def write(self, root: str) -> None:
        atomic_write_json(os.path.join(root, INDEX), self.to_json())

    @classmethod
    def read(cls, root: str, check_files: bool = True) -> Index:
        """The index of the checkpoint directory ``root``; with ``check_files``, after checking that
        every file it lists is there with the recorded size (:meth:`check_present`)."""
        ipath = os.path.join(root, INDEX)
        try:
            with open(ipath) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise CheckpointError(f"{root} has no {INDEX}: not an elixir checkpoint, or an incomplete one") from None
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{ipath} is unreadable or truncated ({e})") from None
        if d.get("format") != FORMAT:
            raise CheckpointError(f"{ipath} is not an elixir checkpoint index")
        if d.get("version") != VERSION:
            raise CheckpointError(f"{ipath} has format version {d.get('version')}; this elixir reads version {VERSION}")
        index = cls.from_json(d)
        if check_files:
            index.check_present(root)
        return index

    def check_present(self, root: str) -> None:
        """Raise :class:`CheckpointError` naming the first listed file that is missing or whose size
        is not the recorded one."""
        for fname, size in self.files.items():
            fp = os.path.join(root, fname)
            if not os.path.isfile(fp):
                raise CheckpointError(f"checkpoint file {fname} is missing from {root} (an incomplete copy?)")
            actual = os.path.getsize(fp)
            if actual != size:
                raise CheckpointError(f"checkpoint file {fname} has {actual} bytes, the index says {size}: truncated or replaced")

    def check(self, root: str, fname: str) -> None:
        """Raise :class:`CheckpointError` naming ``fname`` if its checksum is not the recorded one
        (nothing to check when the index predates checksums)."""
        expected = self.checksums.get(fname)
        if expected is not None:
            check_file(root, fname, expected)

    def pieces(self) -> dict[tuple[str, str], list[Entry]]:
        """Sharded entries by ``("param", name)``, ``("frozen", name)`` or ``(state_key, name)``."""
        out: dict[tuple[str, str], list[Entry]] = {}
        for e in self.entries:
            if e.kind in ("param", "frozen"):
                out.setdefault((e.kind, e.name), []).append(e)
            elif e.kind == "state":
                out.setdefault((e.state_key, e.name), []).append(e)
        return out


def encode(v: Any, what: str) -> Any:
    """JSON form of a hyper-parameter or scalar state value."""
    if isinstance(v, torch.Tensor):
        return {"__tensor__": v.detach().cpu().tolist(), "dtype": dtype_name(v.dtype)}
    if isinstance(v, tuple):
        return {"__tuple__": [encode(x, what) for x in v]}
    if isinstance(v, list):
        return [encode(x, what) for x in v]
    if isinstance(v, dict):
        return {"__dict__": [[encode(k, what), encode(x, what)] for k, x in v.items()]}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise CheckpointError(f"cannot store {what} of type {type(v).__name__} in a checkpoint index")


def decode(v: Any) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(v, dict):
        if "__tensor__" in v:
            return torch.tensor(v["__tensor__"], dtype=dtype_of(v["dtype"]))
        if "__tuple__" in v:
            return tuple(decode(x) for x in v["__tuple__"])
        if "__dict__" in v:
            return {decode(k): decode(x) for k, x in v["__dict__"]}
    if isinstance(v, list):
        return [decode(x) for x in v]
    return v
