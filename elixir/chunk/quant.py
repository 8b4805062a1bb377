"""Quantised frozen shards: a frozen chunk's values kept as NF4 or int8 codes in one byte buffer,
dequantised to the compute dtype at each gather (issue 33 item 3; the formats and their sizes are
:mod:`elixir.plan.state_format`'s table).

**NF4** is QLoRA's format in torchao's layout (``torchao.dtypes.nf4tensor.NF4Tensor``, the one a
maintained library keeps on CPU and GPU): blocks of 64 elements, each element the index of the
nearest of 16 normal-float levels after dividing by the block's absmax, two codes per byte (the
first element in the high nibble); the absmaxes double-quantised: their mean subtracted, then int8
codes with one scale factor per group of 256 blocks; every step computed in the compute dtype, as
torchao computes it. For a shard whose length is a multiple of 64 x 256 the codes, scaler codes,
factors and mean are bit for bit torchao's ``to_nf4(values)`` (tests/test_frozen_quant.py); a
shorter last group is a smaller group, and padding to a whole block is zeros. One deviation: a
block of zeros (absmax 0) is coded as 0.0 (torchao divides 0 by 0 and stores the code of NaN).

**int8**: blocks of 64 elements, an fp32 absmax per block, codes ``round(x / absmax * 127)``;
decoded as ``code * (absmax / 127)`` in fp32, then cast to the compute dtype.

The buffer (``uint8``, :func:`~elixir.plan.state_format.frozen_shard_bytes` bytes) holds, for NF4,
the group factors and the mean (compute dtype) then the codes then the scaler codes; for int8 the
fp32 absmaxes then the codes. One flat buffer is what the shard stores, pins, stages on disk and
copies to the device, unchanged from an unquantised shard's handling.

Dequantising is the hot path (every gather of a frozen chunk). NF4 on a CPU in fp32 or bf16 runs
the native kernel (``csrc/nf4.cpp``: raw buffers, AVX-512 / AVX2 / scalar chosen at run time, bit
for bit the torch path); elsewhere (a GPU, no extension) torch, in pieces of :data:`PIECE`
elements: a 256-entry table maps each code byte to its two levels at once, then one multiply by
the block scales. Measured on the 2-core CPU box (``bench/nf4_dequant.py``, 16M elements to bf16,
2 threads, median of 7 rounds, load 1.96, 2026-11-28): native 0.123 ns/element (as fast as a
bf16 ``copy_``, 0.124), the torch path 0.89, torchao's ``NF4Tensor.get_original_weight`` 5.33
(43x the native kernel's time); int8 (torch) 0.28. The native kernel is kept; torchao's format
is kept, its kernel is not (slower on CPU, and it needs the whole tensor as one NF4Tensor).
"""

from __future__ import annotations

from typing import Optional

import torch

from elixir._native import get_native
from elixir.plan.footprint import element_bytes
from elixir.plan.state_format import (
    INT8_BLOCK,
    NF4_BLOCK,
    NF4_SCALER_BLOCK,
    check_frozen_format,
    frozen_shard_bytes,
)

#: The 16 NF4 levels (QLoRA's normal-float code, as torchao writes them).
NF4_LEVELS = (-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0, 0.0796, 0.1609, 0.2461, 0.3379,
              0.4407, 0.5626, 0.7230, 1.0)
#: Elements dequantised (or quantised) at once: a multiple of every block and group.
PIECE = 1 << 20


def _levels(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(NF4_LEVELS, dtype=dtype, device=device)


def _pairs(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(256, 2): the two levels a code byte stands for (high nibble first)."""
    lv = _levels(dtype, device)
    return torch.stack([lv.repeat_interleave(16), lv.repeat(16)], dim=1).contiguous()


def _nearest_level(x: torch.Tensor, lv: torch.Tensor) -> torch.Tensor:
    """The index of the level nearest each ``x`` (in ``[-1, 1]``), the first of ties: torchao's
    ``quantize_tensor_nearest`` (the argmin of ``|x - level|`` over all 16 levels, in ``x``'s
    dtype), found from the two levels around ``x`` only. The rounded difference ``x - level``
    falls as the level rises and is 0 only at ``x == level``, so its magnitude falls to the last
    level at or below ``x`` and rises after: the argmin is that level or the next one."""
    k = (torch.searchsorted(lv, x, right=True) - 1).clamp_(0, len(NF4_LEVELS) - 2)
    below, above = (x - lv[k]).abs(), (x - lv[k + 1]).abs()
    return (k + (above < below)).to(torch.uint8)


class FrozenCodec:
    """Encodes and decodes one frozen shard of ``numel`` elements of ``dtype`` in format ``fmt``
    (``"nf4"`` or ``"int8"``) to and from its byte buffer of :attr:`nbytes` bytes."""

    def __init__(self, fmt: str, numel: int, dtype: torch.dtype) -> None:
        check_frozen_format(fmt, "FrozenCodec")
        if fmt is None:
            raise ValueError("FrozenCodec needs a quantised format ('nf4' or 'int8'), not None")
        self.fmt, self.numel, self.dtype = fmt, int(numel), dtype
        self.elem = element_bytes(dtype)
        self.block = NF4_BLOCK if fmt == "nf4" else INT8_BLOCK
        self.blocks = -(-self.numel // self.block)
        self.padded = self.blocks * self.block
        self.groups = -(-self.blocks // NF4_SCALER_BLOCK)
        self.nbytes = frozen_shard_bytes(fmt, self.numel, self.elem)
        self._tables: dict = {}
        # NF4 on a CPU in fp32/bf16: the native kernel (csrc/nf4.cpp) when built, else torch
        self.use_native = True

    # ---- the buffer's regions ----------------------------------------------------------------

    def regions(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``buf`` (``uint8``, :attr:`nbytes`): NF4 ``factors``, ``mean``, ``codes``,
        ``scalers``; int8 ``absmax``, ``codes``."""
        if buf.dtype != torch.uint8 or buf.numel() != self.nbytes:
            raise ValueError(f"a {self.fmt} shard of {self.numel} elements is {self.nbytes} bytes of uint8, got "
                             f"{buf.numel()} of {buf.dtype}")
        if self.fmt == "int8":
            a = self.blocks * 4
            return {"absmax": buf[:a].view(torch.float32), "codes": buf[a:].view(torch.int8)}
        g, e = self.groups * self.elem, self.elem
        c = g + e + self.blocks * (NF4_BLOCK // 2)
        return {"factors": buf[:g].view(self.dtype), "mean": buf[g : g + e].view(self.dtype),
                "codes": buf[g + e : c], "scalers": buf[c:].view(torch.int8)}

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    # ---- encode --------------------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, values: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Quantise ``values`` (``numel`` elements, cast to the compute dtype) into ``out`` (a new
        buffer on ``values``' device when None); returns it."""
        if values.numel() != self.numel:
            raise ValueError(f"expected {self.numel} values, got {values.numel()}")
        out = self.empty(values.device) if out is None else out
        r = self.regions(out)
        x = torch.zeros(self.padded, dtype=self.dtype if self.fmt == "nf4" else torch.float32, device=values.device)
        x[: self.numel].copy_(values.reshape(-1))
        blocks = x.view(self.blocks, self.block)
        absmax = blocks.abs().amax(dim=1)
        safe = torch.where(absmax == 0, torch.ones_like(absmax), absmax)
        if self.fmt == "int8":
            r["absmax"].copy_(absmax)
            r["codes"].view(self.blocks, self.block).copy_((blocks / safe[:, None] * 127).round_().clamp_(-127, 127))
            return out
        self._double_quantise(absmax, r)
        lv = _levels(self.dtype, x.device)
        native = self._native_encoder(x.device)
        if native is not None:  # the same codes (tests/test_frozen_quant.py), 20x the torch path below
            # (64M bf16 values: 147 against 7 M/s, 2 busy cores, 2026-11-28): a 64.9B base quantises
            # in minutes, not an hour
            safe, levels = safe.contiguous(), lv.float()  # named: alive through the call
            native.nf4_encode(x.data_ptr(), safe.data_ptr(), r["codes"].data_ptr(), levels.data_ptr(), self.blocks,
                              self.dtype == torch.bfloat16, torch.get_num_threads())
            return out
        scaled = (blocks / safe[:, None]).view(-1)
        codes = torch.empty(self.padded, dtype=torch.uint8, device=x.device)
        for lo in range(0, self.padded, PIECE):
            piece = scaled[lo : lo + PIECE]
            codes[lo : lo + piece.numel()] = _nearest_level(piece, lv)
        r["codes"].copy_(codes[0::2] << 4 | codes[1::2])
        return out

    def _native_encoder(self, device: torch.device) -> Optional[object]:
        """The extension whose ``nf4_encode`` quantises this shard on ``device``, or None (torch)."""
        native = get_native() if self.use_native and device.type == "cpu" else None
        ok = native is not None and hasattr(native, "nf4_encode") and self.dtype in (torch.float32, torch.bfloat16)
        return native if ok else None

    def _double_quantise(self, absmax: torch.Tensor, r: dict) -> None:
        """torchao's ``double_quantize_scalers``: int8 codes of the absmaxes less their mean."""
        mean = absmax.mean()
        s1 = torch.zeros(self.groups * NF4_SCALER_BLOCK, dtype=self.dtype, device=absmax.device)
        s1[: self.blocks] = absmax - mean
        groups = s1.view(self.groups, NF4_SCALER_BLOCK)
        factor = 256 / (2 * groups.abs().amax(dim=1))
        q = (groups * factor[:, None]).round().clamp(-128, 127).view(-1)[: self.blocks]
        r["scalers"].copy_(q.to(torch.int8))
        r["factors"].copy_(factor)
        r["mean"].copy_(mean.reshape(1))

    # ---- decode --------------------------------------------------------------------------------

    def block_scales(self, buf: torch.Tensor) -> torch.Tensor:
        """The per-block scales a decode multiplies by (NF4: the absmaxes dequantised, torchao's
        ``dequantize_scalers``; int8: ``absmax / 127``)."""
        r = self.regions(buf)
        if self.fmt == "int8":
            return r["absmax"] / 127
        per_block = r["factors"].repeat_interleave(NF4_SCALER_BLOCK)[: self.blocks]
        return (r["scalers"] / per_block).to(self.dtype) + r["mean"]

    def native_kernel(self, device: torch.device) -> Optional[object]:
        """The extension whose ``nf4_decode`` decodes this shard on ``device``, or None (torch)."""
        native = get_native() if self.use_native and self.fmt == "nf4" and device.type == "cpu" else None
        ok = native is not None and hasattr(native, "nf4_decode") and self.dtype in (torch.float32, torch.bfloat16)
        return native if ok else None

    @torch.no_grad()
    def decode(self, buf: torch.Tensor, out: Optional[torch.Tensor] = None, simd: str = "") -> torch.Tensor:
        """Dequantise ``buf`` into ``out`` (``numel`` elements of the compute dtype, a new tensor
        on ``buf``'s device when None); returns it. ``simd`` forces a native variant (tests)."""
        out = torch.empty(self.numel, dtype=self.dtype, device=buf.device) if out is None else out
        if out.numel() != self.numel or out.dtype != self.dtype or not out.is_contiguous():
            raise ValueError(f"decode into {self.numel} contiguous elements of {self.dtype}, got {out.numel()} of "
                             f"{out.dtype}")
        scales = self.block_scales(buf).contiguous()
        codes = self.regions(buf)["codes"]
        full = self.numel // self.block * self.block
        native = self.native_kernel(buf.device)
        if native is not None:  # whole blocks: one call, threads split them
            levels = self._tables.get("native")
            if levels is None:
                levels = self._tables["native"] = _levels(self.dtype, torch.device("cpu")).float()
            native.nf4_decode(codes.data_ptr(), scales.data_ptr(), out.data_ptr(), levels.data_ptr(),
                              full // self.block, self.dtype == torch.bfloat16, torch.get_num_threads(), simd)
        for lo in range(0, full if native is None else 0, PIECE):  # whole blocks straight into out
            hi = min(lo + PIECE, full)
            self._decode_blocks(codes, scales, lo, hi, out[lo:hi])
        if full < self.numel:  # the last, partial block: through a block of its own
            tail = torch.empty(self.block, dtype=self.dtype, device=buf.device)
            self._decode_blocks(codes, scales, full, full + self.block, tail)
            out[full:].copy_(tail[: self.numel - full])
        return out

    def _decode_blocks(self, codes: torch.Tensor, scales: torch.Tensor, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements ``[lo, hi)`` (whole blocks) into ``out``."""
        b0, b1 = lo // self.block, hi // self.block
        s = scales[b0:b1]
        if self.fmt == "int8":  # the product in fp32, then cast to the compute dtype
            out.view(b1 - b0, self.block).copy_(codes[lo:hi].view(b1 - b0, self.block) * s[:, None])
            return
        key = (codes.device, self.dtype)
        pairs = self._tables.get(key)
        if pairs is None:
            pairs = self._tables[key] = _pairs(self.dtype, codes.device)
        levels = torch.nn.functional.embedding(codes[lo // 2 : hi // 2].int(), pairs)  # (n/2, 2)
        torch.mul(levels.view(b1 - b0, self.block), s[:, None], out=out.view(b1 - b0, self.block))
