"""``use_fused_kernels``: swap a model's unfused attention for torch's fused kernel, exactly.

What it changes, and only where the result stays the same computation:

- **Hugging Face models running eager attention** (``config._attn_implementation == "eager"``)
  switch to ``"sdpa"`` (``torch.nn.functional.scaled_dot_product_attention``: one fused kernel
  instead of matmul, scale, mask, softmax, dropout and matmul as separate ops, and no materialised
  attention-probability tensor kept for backward). Transformers builds the same boolean/additive
  padding and causal masks for both paths, so padded batches give the same outputs at every
  position the mask keeps, up to floating-point rounding (a fully padded query row has no defined
  output in either, and no loss should read it); the tests check that against the eager model.

Current transformers already picks SDPA by default for every model that supports it, so the flag
helps only models loaded or built with ``attn_implementation="eager"`` (or whose checkpoint
config asks for eager); the warning when nothing changed names the implementation each model runs.

It refuses (``ValueError``, naming the fix) where the fused path cannot be exact: a model asked to
return attention probabilities (``output_attentions=True``: the fused kernel never forms them), or
a model class without an SDPA implementation. It warns when there is nothing to change (the model
already runs fused attention, or is not a Hugging Face model), so the flag never silently does
nothing.
"""

from __future__ import annotations

import warnings

import torch.nn as nn


def _hf_configs(model: nn.Module) -> list:
    """The Hugging Face pretrained models inside ``model`` (outermost first), by their config."""
    out, seen = [], set()
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(m, "set_attn_implementation") and id(m) not in seen:
            if any(m is not o and _contains(o, m) for o in out):
                continue  # the outer model switches its submodels too
            out.append(m)
            seen.add(id(m))
    return out


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(x is inner for x in outer.modules())


def apply_fused_kernels(model: nn.Module) -> list[str]:
    """Switch ``model``'s eager attention to torch's fused SDPA where that is exact; return what
    changed (one line per switched model). Idempotent."""
    changed: list[str] = []
    for m in _hf_configs(model):
        cfg = m.config
        impl = getattr(cfg, "_attn_implementation", None)
        if impl != "eager":
            continue
        if getattr(cfg, "output_attentions", False):
            raise ValueError(
                f"use_fused_kernels=True cannot be exact for {type(m).__name__}: its config asks for "
                "output_attentions=True, which the fused attention kernel never forms; set "
                "config.output_attentions=False or pass use_fused_kernels=False"
            )
        try:
            m.set_attn_implementation("sdpa")
        except (ValueError, ImportError) as e:
            raise ValueError(
                f"use_fused_kernels=True: {type(m).__name__} has no fused (SDPA) attention in this "
                f"transformers version ({e}); pass use_fused_kernels=False"
            ) from e
        changed.append(f"{type(m).__name__}: attention eager -> sdpa")
    if not changed:
        found = sorted({f"{type(m).__name__} ({getattr(m.config, '_attn_implementation', None)})" for m in _hf_configs(model)})
        warnings.warn(
            "use_fused_kernels=True changed nothing: "
            + (f"the Hugging Face models here already run {', '.join(found)} attention" if found
               else "there is no Hugging Face transformers model here")
            + ". It helps only models running eager attention: those loaded or built with "
            "attn_implementation='eager' (transformers picks 'sdpa' by default wherever a model supports it), "
            "where it switches them to torch's fused SDPA exactly; drop the flag otherwise",
            stacklevel=3,
        )
    return changed


__all__ = ["apply_fused_kernels"]
