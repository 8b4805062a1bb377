"""The runtime's policies: frozen dataclasses that say how an ElixirModule computes and offloads
and how an ElixirOptimizer scales the loss, in the style of FSDP2's ``MixedPrecisionPolicy`` and
``OffloadPolicy``.

The plan says *where* each chunk lives; a policy says *how* the runtime treats it. Each policy
checks its own fields when it is built, so a bad value fails where it is written, with the fix
named. The original keyword arguments of ``ElixirModule`` (``dtype``, ``reduce_always_fp32``,
``output_fp32``, ``grad_dtype``, ``offload_dir``, ``offload_direct``) and ``ElixirOptimizer``
(``initial_scale`` ... ``hysteresis``) stay as thin aliases: :func:`module_policies` and
:func:`loss_scale_policy` are the one place that turns either spelling into policies, and they
refuse both spellings at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from elixir.optim.loss_scaler import LossScalePolicy
from elixir.plan.state_format import (
    FROZEN_FORMATS,
    MASTER_FORMATS,
    MOMENT_FORMATS,
    check_frozen_format,
    check_state_formats,
    is_lossy,
)

CHUNK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_dtype(field: str, value: Optional[torch.dtype], optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, torch.dtype) or value not in CHUNK_DTYPES:
        allowed = "torch.float32, torch.bfloat16 or torch.float16" + (" (or None)" if optional else "")
        raise ValueError(f"MixedPrecisionPolicy.{field} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """The dtypes an ElixirModule computes in, reduces gradients in and keeps them in.

    The optimizer always steps fp32 masters; with a low-precision ``param_dtype`` the module keeps
    them beside the compute copies and refreshes the copies after each step.

    Attributes:
        param_dtype: dtype of the chunks' compute copies of the parameters: forward and backward
            run in it, and floating inputs are cast to it. ``torch.float32`` (default),
            ``torch.bfloat16`` or ``torch.float16`` (fp16 adds dynamic loss scaling, see
            :class:`LossScalePolicy`).
        reduce_dtype: dtype gradients are reduced in (the reduce-scatter of sharded chunks, the
            all-reduce of replicated ones): ``param_dtype`` or ``torch.float32``. ``None``
            (default): ``param_dtype``.
        grad_dtype: dtype of the reduced shard gradients kept until the optimizer steps:
            ``torch.float32``, or ``torch.bfloat16``/``torch.float16`` to halve their bytes.
            ``None`` (default): the plan's ``grad_dtype``.
        output_dtype: cast the module's floating outputs to this dtype (``torch.float32`` for an
            fp32 loss from a low-precision model). ``None`` (default): leave them as computed.
        master: format of the optimizer's master copy: ``"fp32"`` (default), ``"bf16-sr"`` (bf16,
            updated with stochastic rounding) or ``"bf16-kahan"`` (bf16 plus a bf16 Kahan
            compensation buffer). Lossy formats need CPUAdam/HybridAdam (:mod:`elixir.optim.lowbit`).
        moments: format of Adam's moments: ``"fp32"`` (default), ``"bf16"`` or ``"int8"``
            (blockwise 8-bit codes with one fp32 scale per block).
        frozen: format the frozen chunks (an adapter fine-tune's base weights) are stored in:
            None (default: the compute dtype), ``"nf4"`` (QLoRA's 4-bit NormalFloat in torchao's
            layout, about 0.52 B/param) or ``"int8"`` (blockwise 8-bit, 1.06 B/param); each
            gather dequantises into the compute dtype (:mod:`elixir.chunk.quant`). Lossy: a state
            dict or checkpoint of the frozen weights holds their dequantised values.
        allow_lossy_state: let ``optimal_search(..., mp_policy=...)`` choose leaner optimizer-state
            formats than ``master``/``moments`` where their plan does not fit, or fits only with
            state on disk (int8 moments, then a bf16-sr master too; the least lossy that fits
            without disk, else the fastest). Default False: the search never changes the formats.
            One format for the whole model (the runtime applies a plan's formats to every chunk);
            the runtime then takes the plan's formats, even where they differ from this policy's.
            Frozen weights are never quantised by the search (``frozen`` is the user's choice).
    """

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: Optional[torch.dtype] = None
    grad_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    master: str = "fp32"
    moments: str = "fp32"
    frozen: Optional[str] = None
    allow_lossy_state: bool = False

    def __post_init__(self) -> None:
        check_state_formats(self.master, self.moments)
        check_frozen_format(self.frozen)
        if not isinstance(self.allow_lossy_state, bool):
            raise ValueError(f"MixedPrecisionPolicy.allow_lossy_state must be True or False, got {self.allow_lossy_state!r}")
        _check_dtype("param_dtype", self.param_dtype, optional=False)
        for name in ("reduce_dtype", "grad_dtype", "output_dtype"):
            _check_dtype(name, getattr(self, name), optional=True)
        if self.reduce_dtype not in (None, self.param_dtype, torch.float32):
            raise ValueError(
                f"MixedPrecisionPolicy.reduce_dtype must be the param_dtype ({self.param_dtype}) or "
                f"torch.float32, got {self.reduce_dtype}"
            )

    @property
    def reduce(self) -> torch.dtype:
        """The dtype gradients are reduced in (``reduce_dtype``, else ``param_dtype``)."""
        return self.reduce_dtype or self.param_dtype

    @property
    def lossy_state(self) -> bool:
        """Whether the optimizer state is kept in a format below fp32."""
        return is_lossy(self.master, self.moments)


@dataclass(frozen=True)
class OffloadPolicy:
    """How an ElixirModule keeps what its plan puts on disk (the fp32 masters and optimizer state
    of chunks whose ``optim_placement`` is ``DISK``). Which chunks go to the host or the disk is
    the plan's choice; this says where the file is and how it is read and written.

    Attributes:
        offload_dir: directory of the per-rank offload file. ``None`` (default): a per-run
            directory under ``tempfile.gettempdir()``. The file is unlinked as soon as it is open,
            so nothing is left behind, even by a killed process; a directory that does not exist
            is created, and removed again (if empty) when the file is closed. Never created when
            no chunk is on disk.
        direct: also open the file with ``O_DIRECT`` (bypassing the page cache) for transfers whose
            buffers are page-aligned; everything else stays buffered. Default False.
    """

    offload_dir: Optional[str] = None
    direct: bool = False

    def __post_init__(self) -> None:
        if self.offload_dir is not None and not isinstance(self.offload_dir, str):
            raise ValueError(f"OffloadPolicy.offload_dir must be a directory path (str) or None, got {self.offload_dir!r}")
        if not isinstance(self.direct, bool):
            raise ValueError(f"OffloadPolicy.direct must be True or False, got {self.direct!r}")


def module_policies(
    mp_policy: Optional[MixedPrecisionPolicy],
    offload_policy: Optional[OffloadPolicy],
    *,
    dtype: torch.dtype = torch.float32,
    reduce_always_fp32: bool = False,
    output_fp32: bool = False,
    grad_dtype: Optional[torch.dtype] = None,
    offload_dir: Optional[str] = None,
    offload_direct: bool = False,
) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    """ElixirModule's policies, from the policy objects or from the keyword arguments of the
    original API (one spelling per concern: both raise ``ValueError`` naming the keywords)."""
    loose = [k for k, v, d in (("dtype", dtype, torch.float32), ("reduce_always_fp32", reduce_always_fp32, False),
                               ("output_fp32", output_fp32, False), ("grad_dtype", grad_dtype, None)) if v != d]
    if mp_policy is not None and loose:
        raise ValueError(f"pass mp_policy or {', '.join(loose)}, not both: put the dtypes in MixedPrecisionPolicy(...)")
    if mp_policy is None:
        _check_dtype("param_dtype", dtype, optional=False)  # the alias's error names the policy's field
        mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if reduce_always_fp32 else None,
                                         grad_dtype=grad_dtype, output_dtype=torch.float32 if output_fp32 else None)
    loose = [k for k, v, d in (("offload_dir", offload_dir, None), ("offload_direct", offload_direct, False)) if v != d]
    if offload_policy is not None and loose:
        raise ValueError(f"pass offload_policy or {', '.join(loose)}, not both: put them in OffloadPolicy(...)")
    if offload_policy is None:
        offload_policy = OffloadPolicy(offload_dir=offload_dir, direct=bool(offload_direct))
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}")
    return mp_policy, offload_policy


def state_formats(mp_policy: MixedPrecisionPolicy, plan: Any) -> tuple[str, str]:
    """The (master, moments) formats a run keeps its optimizer state in: those the plan records
    (it was searched with them, and its memory figures count them), else the policy's. A policy
    asking for other lossy formats than the plan's raises, naming both, unless it allowed the
    search to choose them (``allow_lossy_state``)."""
    recorded = getattr(plan, "master_format", None), getattr(plan, "moments_format", None)
    wanted = (mp_policy.master, mp_policy.moments)
    if recorded[0] is None:
        return wanted
    if mp_policy.lossy_state and wanted != recorded and not mp_policy.allow_lossy_state:
        raise ValueError(
            f"the plan was searched with master={recorded[0]!r}, moments={recorded[1]!r} but the MixedPrecisionPolicy "
            f"asks for master={wanted[0]!r}, moments={wanted[1]!r}: search again with the policy's formats, or leave "
            "them at their defaults to take the plan's"
        )
    return recorded


def frozen_format(mp_policy: MixedPrecisionPolicy, plan: Any) -> Optional[str]:
    """The format a run stores its frozen chunks in: the plan's (its memory figures count it),
    else the policy's ``frozen``. A policy asking for another format than the plan's raises."""
    recorded = getattr(plan, "frozen_format", None)
    if recorded is None:
        return mp_policy.frozen
    if mp_policy.frozen not in (None, recorded):
        raise ValueError(
            f"the plan was searched with frozen={recorded!r} but the MixedPrecisionPolicy asks for frozen="
            f"{mp_policy.frozen!r}: search again with the policy's format, or leave frozen=None to take the plan's"
        )
    return recorded


def rcache_blocks(plan: Any, frozen: Optional[str]) -> int:
    """The rCache blocks a run keeps: the plan's; at least two when its frozen chunks are
    quantised but the plan was not searched for it (they are dequantised into a block per use,
    where such a plan may have kept them whole, with no block: a layer may straddle two chunks)."""
    blocks = int(plan.cache_blocks)
    unplanned = frozen is not None and plan.frozen_chunks and getattr(plan, "frozen_format", None) is None
    return max(blocks, 2) if unplanned else blocks


_SCALE_DEFAULTS = LossScalePolicy()
SCALE_KEYWORDS = ("initial_scale", "min_scale", "max_scale", "growth_factor", "backoff_factor", "growth_interval",
                  "hysteresis")


def loss_scale_policy(policy: Optional[LossScalePolicy], **keywords: float) -> LossScalePolicy:
    """The loss-scale policy of ElixirOptimizer, the plugins and the integrations, from ``policy``
    or from the keyword arguments of the original API (``initial_scale`` ... ``hysteresis``; one
    left out takes :class:`LossScalePolicy`'s default; both spellings raise ``ValueError``)."""
    unknown = sorted(set(keywords) - set(SCALE_KEYWORDS))
    if unknown:
        raise TypeError(f"unknown loss-scale arguments {unknown}; they are {list(SCALE_KEYWORDS)}")
    loose = [k for k in SCALE_KEYWORDS if k in keywords and keywords[k] != getattr(_SCALE_DEFAULTS, k)]
    if policy is not None:
        if loose:
            raise ValueError(f"pass loss_scale_policy or {', '.join(loose)}, not both: put them in LossScalePolicy(...)")
        if not isinstance(policy, LossScalePolicy):
            raise TypeError(f"loss_scale_policy must be a LossScalePolicy, got {type(policy).__name__}")
        return policy
    return LossScalePolicy(**keywords)


__all__ = ["LossScalePolicy", "MixedPrecisionPolicy", "MASTER_FORMATS", "MOMENT_FORMATS", "FROZEN_FORMATS", "check_state_formats", "OffloadPolicy", "module_policies", "loss_scale_policy", "state_formats", "frozen_format", "rcache_blocks"]
