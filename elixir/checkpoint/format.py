"""Tensor files of a checkpoint: safetensors, written and read with the ``safetensors`` library.

Writing goes straight from the tensors' memory (views of a chunk's buffer included: the library
writes from each tensor's pointer, no staging copy); reading opens a file lazily and reads only the
slices asked for, checking each tensor's dtype against the one expected.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from elixir.checkpoint.errors import CheckpointError
from elixir.fileio import fsync_file

# safetensors' dtype codes, as ``safe_open(...).get_slice(k).get_dtype()`` reports them
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def dtype_name(dt: torch.dtype) -> str:
    """The name the index stores for ``dt`` ("float32")."""
    return str(dt).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype an index name stands for."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint index")
    return dt


def write_tensors(path: str, tensors: dict[str, torch.Tensor]) -> int:
    """Write ``tensors`` as a safetensors file, fsync it, and return its size in bytes."""
    flat = {}
    for name, t in tensors.items():
        t = t.detach()
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.to("cpu").contiguous()
        flat[name] = t
    try:
        save_file(flat, path, metadata={"format": "pt"})
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"cannot store the tensors of {os.path.basename(path)} in safetensors: {e}") from None
    fsync_file(path)
    return os.path.getsize(path)


class Reader:
    """The safetensors files under one checkpoint directory, opened lazily; slices read with dtype checks.

    ``check(fname)``, when given, runs before a file is first opened (the index's checksum check),
    so every file read is verified before any of it is used.

    At most ``max_open`` files are open at once (least recently used closed first): safetensors
    maps each file into memory, and every page a read touches stays resident, counted in the
    process's RSS, until the file is closed. With every file kept open, loading a 6.7B bf16
    checkpoint into chunks that live on disk peaked at 11.2 GiB of RSS, most of it the mapped
    checkpoint.
    """

    def __init__(self, root: str, check: Optional[Callable[[str], None]] = None, max_open: int = 2):
        self.root = root
        self._check = check
        self._checked: set[str] = set()
        self._max_open = max(1, max_open)
        self._files: OrderedDict[str, Any] = OrderedDict()

    def handle(self, fname: str) -> Any:
        h = self._files.get(fname)
        if h is not None:
            self._files.move_to_end(fname)
            return h
        if self._check is not None and fname not in self._checked:
            self._check(fname)
            self._checked.add(fname)
        try:
            h = safe_open(os.path.join(self.root, fname), framework="pt")
        except Exception as e:
            raise CheckpointError(f"checkpoint file {fname} is corrupt or truncated: {e}") from None
        self._files[fname] = h
        while len(self._files) > self._max_open:
            _, old = self._files.popitem(last=False)
            close = getattr(old, "__exit__", None)
            if close is not None:
                close(None, None, None)  # unmaps the file (its pages stop counting in RSS)
        return h

    def read(self, fname: str, key: str, expect: torch.dtype, lo: Optional[int] = None, hi: Optional[int] = None) -> torch.Tensor:
        """Tensor ``key`` of ``fname`` (rows ``[lo, hi)`` when given), which must have dtype ``expect``."""
        h = self.handle(fname)
        try:
            sl = h.get_slice(key)
        except Exception:
            raise CheckpointError(f"tensor {key!r} is missing from {fname}") from None
        got = _DTYPES.get(sl.get_dtype())
        if got != expect:
            raise CheckpointError(
                f"tensor {key!r} in {fname} has dtype {sl.get_dtype()}, expected {dtype_name(expect)}: mismatched "
                "dtype (convert the checkpoint explicitly, or load the matching one)"
            )
        return sl[lo:hi] if lo is not None else sl[:]

    def dtype(self, fname: str, key: str) -> torch.dtype:
        """The dtype tensor ``key`` of ``fname`` is saved in."""
        code = self.handle(fname).get_slice(key).get_dtype()
        if code not in _DTYPES:
            raise CheckpointError(f"tensor {key!r} in {fname} has dtype {code}, which elixir cannot read")
        return _DTYPES[code]

    def read_flat(self, fname: str, key: str, expect: torch.dtype, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened tensor ``key``, reading whole rows only."""
        sl = self.handle(fname).get_slice(key)
        shape = list(sl.get_shape())
        if len(shape) <= 1:
            return self.read(fname, key, expect, start, end).reshape(-1)
        row = 1
        for d in shape[1:]:
            row *= d
        r0, r1 = start // row, -(-end // row)
        rows = self.read(fname, key, expect, r0, r1).reshape(-1)
        return rows[start - r0 * row : end - r0 * row].clone()

    def assemble(self, pieces: list, start: int, end: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """Values ``[start, end)`` of a flattened tensor from saved ``pieces`` (index entries with
        global ranges)."""
        for e in pieces:  # the common case, same layout as saved: one piece, no staging copy
            if e.start == start and e.end == end and dtype_of(e.dtype) == dtype:
                return self.read(e.file, e.key, dtype)
        out = torch.empty(end - start, dtype=dtype)
        covered = 0
        for e in pieces:
            a, b = max(start, e.start), min(end, e.end)
            if a >= b:
                continue
            if dtype_of(e.dtype) != dtype:
                raise CheckpointError(f"{what}: saved as {e.dtype}, expected {dtype_name(dtype)} (mismatched dtype)")
            out[a - start : b - start] = self.read(e.file, e.key, dtype, a - e.start, b - e.start)
            covered += b - a
        if covered != end - start:
            raise CheckpointError(
                f"{what}: the checkpoint covers {covered} of the {end - start} elements [{start}, {end}) (a shard is missing)"
            )
        return out
