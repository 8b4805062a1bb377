"""Which module of a wrapped model a Hugging Face checkpoint belongs to, and PEFT's naming.

The module an ``ElixirModule`` wraps is often not the Hugging Face model itself: a
LightningModule holds it as ``self.model``, a PEFT ``PeftModel`` wraps it. :func:`resolve` picks
the module that :func:`~elixir.checkpoint.load_pretrained` and
:func:`~elixir.checkpoint.save_pretrained` read and write, one rule for both:

- ``submodule="model"`` names it (its attribute path; ``""`` is the wrapped module itself);
- otherwise the wrapped module when it is a ``PreTrainedModel`` or a PEFT model;
- otherwise the one outermost ``PreTrainedModel`` / PEFT model inside it (several: refused, name one);
- otherwise (a plain torch model) the wrapped module.

Keys are then that module's own (``lm_head.weight``, not ``model.lm_head.weight``), and the
parameters outside it are neither loaded nor saved nor reported missing.
"""

from __future__ import annotations

from typing import Optional

import torch

from elixir.checkpoint.errors import CheckpointError
from elixir.checkpoint.hf_conversion import hf_model

PEFT_PREFIX = "base_model.model."


def peft_base(module: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The base model of a PEFT model (``peft.PeftModel``), or None for any other module."""
    if hasattr(module, "peft_config") and callable(getattr(module, "get_base_model", None)):
        return module.get_base_model()
    return None


def base_key(key: str) -> str:
    """A PEFT model's key as the base model names it: without the ``base_model.model.`` prefix and
    the ``base_layer`` that LoRA wraps each adapted layer in."""
    key = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
    return key.replace(".base_layer.", ".")


def _is_hf(module: torch.nn.Module) -> bool:
    return hf_model(module) or peft_base(module) is not None


def resolve(module: torch.nn.Module, submodule: Optional[str] = None) -> tuple[torch.nn.Module, str]:
    """The module a Hugging Face checkpoint of ``module`` (the wrapped model) is for, and its path
    inside ``module`` ("" for ``module`` itself); see the module docstring. Raises
    :class:`CheckpointError` for a ``submodule`` that does not exist, and when ``module`` holds
    several Hugging Face models and none is named."""
    if submodule is not None:
        if submodule == "":
            return module, ""
        try:
            return module.get_submodule(submodule), submodule
        except AttributeError:
            raise CheckpointError(
                f"submodule={submodule!r}: {type(module).__name__} has no such submodule (give the attribute path "
                "of the Hugging Face model inside the wrapped module, e.g. submodule='model')"
            ) from None
    if _is_hf(module):
        return module, ""
    found = [n for n, m in module.named_modules() if n and _is_hf(m)]
    outer = [n for n in found if not any(n.startswith(o + ".") for o in found)]
    if len(outer) > 1:
        raise CheckpointError(
            f"{type(module).__name__} holds several Hugging Face models ({', '.join(outer)}); pass submodule= "
            "naming the one this checkpoint is for"
        )
    if outer:
        return module.get_submodule(outer[0]), outer[0]
    return module, ""
