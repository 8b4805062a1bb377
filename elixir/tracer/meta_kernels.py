"""Make meta execution take the same kernels a real CPU run takes.

Two gaps are closed here:

- **Attention backend.** ``scaled_dot_product_attention`` picks its kernel from the tensors' device;
  on meta it always falls back to the math path, which materialises the full attention matrix,
  while CPU picks the fused flash kernel. :func:`sdpa_as_cpu` asks the CPU selector which backend it
  would choose for the same shapes, dtypes and flags (using tiny probe tensors) and calls that
  kernel's meta implementation, so meta memory matches a real CPU run.
- **Data-dependent checks in Hugging Face code.** ``transformers.masking_utils`` inspects
  ``position_ids`` (``.all()``) to detect packed sequences when training without a cache (e.g.
  with gradient checkpointing). On meta that value does not exist; :func:`hf_meta_shims` answers
  "not packed", which is what a batch without explicit restarting ``position_ids`` gives.
- **Known, kept difference.** Meta ``native_layer_norm`` returns ``mean``/``rstd`` in fp32 for
  bf16/fp16 inputs (as CUDA does) where CPU returns them in the input dtype: 4 bytes per row per
  LayerNorm in half precision (0.07% of activations on a small GPT-2 in bf16). It is kept because it
  is what a GPU run allocates.
- **Missing meta kernels.** :func:`register_meta_kernel` registers a shape function for an aten
  op that has none; :func:`ensure_meta_kernels` registers the ones elixir knows are missing
  (on torch 2.13: CTC loss backward). An op with no meta kernel makes the tracer raise a
  ``TracerError`` naming the op.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["sdpa_as_cpu", "register_meta_kernel", "ensure_meta_kernels", "hf_meta_shims"]

_LIBS: dict[str, Any] = {}


def register_meta_kernel(op: str, fn: Callable[..., Any]) -> None:
    """Register ``fn`` as the Meta kernel of aten op ``op`` (e.g. ``"aten::addbmm"``).

    ``fn`` gets the op's arguments (meta tensors) and returns empty meta outputs of the right
    shape, dtype and strides. Registering twice is an error from torch.
    """
    ns, name = op.split("::") if "::" in op else ("aten", op)  # name may carry ".overload"
    lib = _LIBS.get(ns)
    if lib is None:
        lib = _LIBS[ns] = torch.library.Library(ns, "IMPL")  # noqa: TOR901 - process-lifetime
    lib.impl(name, fn, "Meta")


def _has_meta(op: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, "Meta")


def _ctc_loss_backward_meta(grad, log_probs, *args, **kwargs):
    # CPU allocates the gradient like ``log_probs`` in contiguous (legacy) layout
    return torch.empty(log_probs.shape, dtype=log_probs.dtype, device="meta")


# ops used in training that torch 2.13 ships without a Meta kernel (found by running a battery of
# ~60 forward+backward ops on meta: convs and their backward, baddbmm/addbmm, norms, pooling, RNNs,
# attention, losses, interpolation, ... all have one except these)
_KNOWN_MISSING: dict[str, Callable[..., Any]] = {
    "aten::_ctc_loss_backward": _ctc_loss_backward_meta,
    "aten::_ctc_loss_backward.Tensor": _ctc_loss_backward_meta,
}


def ensure_meta_kernels() -> None:
    """Register elixir's meta kernels for the ops known to lack one (idempotent)."""
    for op, fn in _KNOWN_MISSING.items():
        if not _has_meta(op):
            register_meta_kernel(op, fn)


def _probe(t: torch.Tensor, keep_dims: int = 2) -> torch.Tensor:
    """A tiny real CPU tensor with ``t``'s dtype and leading/trailing dims, sequence dims set to 1."""
    shape = list(t.shape)
    for i in range(max(0, len(shape) - keep_dims), len(shape) - 1):
        shape[i] = min(shape[i], 1) if shape[i] != 0 else 0
    return torch.zeros(shape, dtype=t.dtype)


def _sdpa_args(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def _cpu_choice(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa) -> int:
    with _disable_current_modes():  # the probes are not part of the traced step
        return _cpu_choice_probe(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)


def _cpu_choice_probe(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa) -> int:
    m = None
    if mask is not None:
        shape = list(mask.shape)
        for i in range(max(0, len(shape) - 2), len(shape)):
            shape[i] = min(shape[i], 1)
        m = torch.zeros(shape, dtype=mask.dtype)
    return torch._fused_sdp_choice(
        _probe(q), _probe(k), _probe(v), m, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )


@contextlib.contextmanager
def sdpa_as_cpu() -> Iterator[None]:
    """While active, meta ``F.scaled_dot_product_attention`` runs the kernel CPU would choose.

    It replaces the ``torch.nn.functional`` attribute (the name HF models and
    ``F.multi_head_attention_forward`` call through), so it also covers recomputation inside
    backward. Code that imported the function by name before tracing is not covered.
    """
    orig = F.scaled_dot_product_attention

    def scaled_dot_product_attention(*args, **kwargs):
        q, k, v, mask, dropout_p, is_causal, scale, gqa = _sdpa_args(*args, **kwargs)
        if q.device.type == "meta" and _cpu_choice(q, k, v, mask, dropout_p, is_causal, scale, gqa) == int(
            SDPBackend.FLASH_ATTENTION
        ):
            # (the CPU flash kernel handles grouped-query attention natively)
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout_p, is_causal, attn_mask=mask, scale=scale
            )[0]
        return orig(*args, **kwargs)

    F.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = orig


@contextlib.contextmanager
def hf_meta_shims() -> Iterator[None]:
    """Answer Hugging Face's data-dependent packed-sequence check on meta (see the module docstring)."""
    mu = sys.modules.get("transformers.masking_utils")
    orig = getattr(mu, "find_packed_sequence_indices", None) if mu is not None else None
    if orig is None:
        yield
        return

    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        if isinstance(position_ids, torch.Tensor) and position_ids.device.type == "meta":
            return None
        return orig(position_ids, *args, **kwargs)

    mu.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = orig
