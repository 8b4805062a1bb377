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
  "not packed", which is what a batch without explicit restarting ``position_ids`` gives. Checks
  on values computed from the batch alone (``padding_mask.all()`` on the attention mask) are
  answered from the batch's real values (:mod:`elixir.tracer.known_values`), not here.
- **Known, kept difference.** Meta ``native_layer_norm`` returns ``mean``/``rstd`` in fp32 for
  bf16/fp16 inputs (as CUDA does) where CPU returns them in the input dtype: 4 bytes per row per
  LayerNorm in half precision (0.07% of activations on a small GPT-2 in bf16). It is kept because it
  is what a GPU run allocates.
- **Mixture-of-experts.** torch's meta ``_grouped_mm`` copies the CUDA kernel's bf16-only check,
  while the CPU kernel (and transformers' grouped experts path) runs every float dtype: the rule
  :func:`meta_rule` gives it the output shape for any dtype (routing cannot change it: the op
  multiplies every routed token row once, ``tokens x top_k`` rows, however they split over the
  experts). transformers' *eager* experts loop over the experts the router picked
  (``nonzero`` on the routing, which depends on the weights); :func:`hf_static_experts` traces them
  through transformers' own ``grouped_mm`` experts path instead: the same parameters, FLOPs and
  saved activations for any routing. Per-expert imbalance, which changes kernel efficiency and the
  eager loop's transient per-expert buffers, is not modelled: routing is priced as balanced.
- **Missing meta kernels.** :func:`register_meta_kernel` registers a shape function for an aten
  op that has none; :func:`ensure_meta_kernels` registers the ones elixir knows are missing
  (on torch 2.13: CTC loss backward). An op with no meta kernel makes the tracer raise a
  ``TracerError`` naming the op.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["sdpa_as_cpu", "register_meta_kernel", "ensure_meta_kernels", "hf_meta_shims", "meta_rule",
           "hf_static_experts"]

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
def _patched(owner: Any, name: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    """Replace ``owner.name`` by ``make(original)`` while active (nothing when it does not exist)."""
    orig = getattr(owner, name, None) if owner is not None else None
    if orig is None:
        yield
        return
    setattr(owner, name, make(orig))
    try:
        yield
    finally:
        setattr(owner, name, orig)


@contextlib.contextmanager
def hf_meta_shims(value: Callable[[torch.Tensor], Optional[torch.Tensor]] = lambda t: None) -> Iterator[None]:
    """Answer Hugging Face's data-dependent checks on meta (see the module docstring).

    ``value(t)`` is a meta tensor's real value when the tracer knows it (else None), as
    :meth:`elixir.tracer.known_values.KnownValues.value` gives.

    - ``masking_utils.find_packed_sequence_indices`` answers "not packed" for meta position ids.
    - ``PreTrainedModel.warn_if_padding_and_no_attention_mask`` (a warning only: it changes nothing
      the step computes) runs on the real ``input_ids`` when they are known, and is skipped
      otherwise. It indexes with a Python list, which becomes a meta tensor no op produced.
    """
    mu = sys.modules.get("transformers.masking_utils")
    mod_utils = sys.modules.get("transformers.modeling_utils")

    def packed(orig):
        def find_packed_sequence_indices(position_ids, *args, **kwargs):
            if isinstance(position_ids, torch.Tensor) and position_ids.device.type == "meta":
                return None
            return orig(position_ids, *args, **kwargs)
        return find_packed_sequence_indices

    def warn_padding(orig):
        def warn_if_padding_and_no_attention_mask(self, input_ids, attention_mask):
            if isinstance(input_ids, torch.Tensor) and input_ids.device.type == "meta":
                real = value(input_ids)
                if real is None:
                    return None
                with _disable_current_modes():  # a check on the batch, not part of the traced step
                    return orig(self, real, attention_mask)
            return orig(self, input_ids, attention_mask)
        return warn_if_padding_and_no_attention_mask

    with _patched(mu, "find_packed_sequence_indices", packed), \
            _patched(getattr(mod_utils, "PreTrainedModel", None), "warn_if_padding_and_no_attention_mask", warn_padding):
        yield


def _grouped_mm_rule(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """torch's meta ``_grouped_mm`` for a dtype other than bf16: its own checks (shapes, strides)
    run on bf16 stand-ins, and the output takes the requested dtype."""
    if mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16:
        return NotImplemented  # torch's own refusal stands

    def bf16(t):
        return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=torch.bfloat16, device="meta")

    ref = torch.ops.aten._grouped_mm.default(bf16(mat_a), bf16(mat_b), offs, bf16(bias))
    dtype = out_dtype or mat_a.dtype
    size = list(ref.shape)
    if torch.version.cuda:  # CUDA pads rows to 16 bytes, as torch's meta kernel does
        align = 16 // dtype.itemsize
        padded = (size[-1] + align - 1) // align * align
        stride = [size[1] * padded, padded, 1] if len(size) == 3 else [padded, 1]
        return torch.empty_strided(size, stride, dtype=dtype, device="meta")
    return torch.empty(size, dtype=dtype, device="meta")


_RULES: dict[Any, Callable[..., Any]] = {torch.ops.aten._grouped_mm.default: _grouped_mm_rule}


def meta_rule(func: Any, args: tuple, kwargs: dict) -> Any:
    """The output of ``func`` on meta tensors by elixir's shape rule where torch's meta kernel
    refuses what the CPU kernel runs (see the module docstring); ``NotImplemented`` otherwise."""
    rule = _RULES.get(func)
    if rule is None or any(isinstance(a, torch.Tensor) and a.device.type != "meta" for a in args):
        return NotImplemented
    with _disable_current_modes():
        return rule(*args, **kwargs)


def hf_static_experts(model: torch.nn.Module) -> int:
    """Route transformers' eager experts modules of ``model`` (a traced copy) through transformers'
    ``grouped_mm`` experts path (see the module docstring); returns how many modules it switched."""
    switched = 0
    for m in model.modules():
        cfg = getattr(m, "config", None)
        # modules made by transformers' @use_experts_implementation carry these attributes
        if cfg is None or not hasattr(m, "_is_expert_parallel") or not hasattr(m, "has_gate"):
            continue
        if getattr(cfg, "_experts_implementation", None) in (None, "eager"):
            cfg._experts_implementation = "grouped_mm"
            switched += 1
        elif cfg._experts_implementation == "grouped_mm":
            switched += 1
    return switched
