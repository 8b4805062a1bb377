"""``save_pretrained`` on the Hugging Face model inside an ElixirModule.

The wrapped model's parameters are views of chunk payloads, and a sharded chunk's payload holds no
bytes between uses, so transformers' own ``save_pretrained`` (which reads ``self.state_dict()``)
would fail half way, after writing ``config.json`` ("setStorage: ... out of bounds for storage of
size 0"). :func:`guard_save_pretrained` replaces the wrapped model's method by one that

- passes an explicit ``state_dict=`` through unchanged (what a trainer does after gathering);
- at world size 1, gathers the state dict itself (no collective is needed) and saves;
- at a larger world size refuses before anything is written, naming the calls that work:
  :func:`elixir.checkpoint.save_pretrained` (collective, streamed chunk by chunk), or
  ``save_pretrained(path, state_dict=model.state_dict(rank0_only=True))``.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elixir.wrapper.interfaces import ChunkedModel


class WrappedSaveError(RuntimeError):
    """``save_pretrained`` was called on a sharded wrapped model without a state dict."""


def guard_save_pretrained(em: ChunkedModel) -> None:
    """Install the guarded ``save_pretrained`` on ``em.module`` when it has one (HF models)."""
    inner = em.module
    original = getattr(inner, "save_pretrained", None)
    if not callable(original):
        return
    ref = weakref.ref(em)

    def save_pretrained(save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        wrapper = ref()
        if wrapper is not None and kwargs.get("state_dict") is None:
            if wrapper.world_size > 1:
                raise WrappedSaveError(
                    f"save_pretrained() on the model inside an ElixirModule sharded over {wrapper.world_size} ranks "
                    "cannot read its parameters (each rank holds only its shards); nothing was written. Call "
                    "elixir.checkpoint.save_pretrained(path, model) on every rank (the same Hugging Face layout, "
                    "streamed chunk by chunk), or model.module.save_pretrained(path, "
                    "state_dict=model.state_dict(rank0_only=True)) (a collective gather; save from rank 0)"
                )
            kwargs["state_dict"] = wrapper.state_dict()
        return original(save_directory, *args, **kwargs)

    save_pretrained.__doc__ = __doc__
    inner.save_pretrained = save_pretrained
