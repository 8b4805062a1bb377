"""ColossalAI 0.5 arguments that elixir's plugins and Booster take without acting on them as
ColossalAI does.

Every argument of ColossalAI 0.5's ``GeminiPlugin``, ``LowLevelZeroPlugin`` and ``Booster`` is
accepted, so code written for ColossalAI runs with only its imports changed. An argument this
module lists is, at a value other than ColossalAI's default, either

- **ignored with a one-line note** (a ``UserWarning`` starting ``elixir:``) saying what elixir
  does instead, where the run is still the one the user asked for in every way that matters
  (a chunk-size hint, a memory ratio of Gemini's own manager, a device elixir picks itself), or
- **refused** (``ValueError``) naming the alternative, where honouring it is impossible and
  ignoring it would train something else (a second data-parallel axis, no fp32 master weights).

An argument the plugin honours itself is not listed here; a name neither honoured nor listed is a
``TypeError``, as in ColossalAI.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

ALWAYS = object()  # a Compat default meaning "every value is fine: elixir already does this"


@dataclass(frozen=True)
class Compat:
    """How one ColossalAI argument is taken.

    Attributes:
        default: ColossalAI's default (nothing is said at it), or :data:`ALWAYS`.
        why: what elixir does instead (for a note) or the alternative (for a refusal).
        refuse: True where honouring another value is impossible.
    """

    default: Any
    why: str = ""
    refuse: bool = False


def note(message: str, stacklevel: int = 3) -> None:
    """A one-line note that an argument was ignored and what elixir does instead."""
    warnings.warn(f"elixir: {message}", UserWarning, stacklevel=stacklevel + 1)


def _same(value: Any, default: Any) -> bool:
    if value is default:
        return True
    try:
        return bool(value == default)
    except Exception:  # e.g. a tensor or an object without a plain ==
        return False


def check_compat(owner: str, given: dict[str, Any], table: dict[str, Compat]) -> None:
    """Take the arguments in ``given`` by ``table`` (see the module docstring): an unknown name is
    a ``TypeError``; a value other than ColossalAI's default is noted or refused."""
    for name, value in given.items():
        entry: Optional[Compat] = table.get(name)
        if entry is None:
            raise TypeError(f"{owner} got an unexpected argument {name!r}")
        if entry.default is ALWAYS or _same(value, entry.default):
            continue
        if entry.refuse:
            raise ValueError(f"{owner}({name}={value!r}) is not supported: {entry.why}")
        note(f"{owner}({name}={value!r}) is ignored: {entry.why}", stacklevel=3)


_CHUNKS = ("chunk sizes come from elixir's search (minimum_waste_search; optimal_search with placement_policy='auto'); "
           "pass plan= for fixed chunks")
_DEVICE = "elixir computes on its default device (the current CUDA device, else the CPU: elixir.device.default_device())"
_RATIOS = ("placement_policy='auto' budgets memory from the step it traces, with optimal_search's safety margins; for "
           "other budgets pass plan=optimal_search(model, world, device_memory=..., host_memory=...)")
_SHARDFORMER = "Shardformer rewrites are not applied: the model's own modules run as they are"
_MASTER = ("elixir always keeps fp32 master weights for low-precision chunks; leave master_weights=True (to save "
           "memory, place the master weights and optimizer state in host memory instead)")

# GeminiPlugin (ColossalAI 0.5) arguments elixir does not honour one-to-one
GEMINI: dict[str, Compat] = {
    "chunk_config_dict": Compat(None, _CHUNKS),
    "chunk_init_device": Compat(None, _DEVICE),
    "device": Compat(None, _DEVICE),  # not in 0.5's signature, but in its NVMe tutorial
    "strict_ddp_mode": Compat(ALWAYS),  # elixir is always plain data parallelism over its group
    "search_range_m": Compat(32, _CHUNKS),
    "hidden_dim": Compat(None, _CHUNKS),
    "min_chunk_size_m": Compat(32, _CHUNKS),
    "memstats": Compat(None, "memory statistics come from elixir's tracer (`elixir plan`, elixir.tracer)"),
    "warmup_non_model_data_ratio": Compat(0.8, _RATIOS),
    "steady_cuda_cap_ratio": Compat(0.9, _RATIOS),
    "gpu_margin_mem_ratio": Compat(0.0, _RATIOS),
    "master_weights": Compat(True, _MASTER, refuse=True),
    "extra_dp_size": Compat(1, "elixir shards over its whole process group; leave extra_dp_size=1", refuse=True),
    "enable_fused_normalization": Compat(False, _SHARDFORMER),
    "enable_jit_fused": Compat(False, _SHARDFORMER),
    "enable_sequence_parallelism": Compat(False, "GeminiPlugin keeps activations replicated over tp (ColossalAI also "
                                                 "drops it at tp_size=1): HybridParallelPlugin(tp_size=..., "
                                                 "enable_sequence_parallelism=True) splits them by the sequence"),
    "enable_async_reduce": Compat(True, "gradient reductions always overlap backward"),
    "use_fp8": Compat(False, "fp8 compute is not supported; the chunks compute in the plugin's precision"),
    "fp8_communication": Compat(False, "gradients are reduced in the compute dtype (fp8 communication is not supported)"),
}

# LowLevelZeroPlugin (ColossalAI 0.5) arguments elixir does not honour one-to-one
LOW_LEVEL_ZERO: dict[str, Compat] = {
    "master_weights": Compat(True, _MASTER, refuse=True),
    "extra_dp_size": Compat(1, "elixir shards over its whole process group; leave extra_dp_size=1", refuse=True),
    "partition_grad": Compat(False, "use stage=2 for partitioned (reduce-scattered) gradients", refuse=True),
    "overlap_communication": Compat(True, "each chunk is reduced as soon as backward completes its gradients"),
    "overlap_allgather": Compat(False, "the updated parameters are all-gathered right after the step"),
    "cast_inputs": Compat(True, "floating-point inputs are always cast to the compute dtype"),
    "fp8_communication": Compat(False, "gradients are reduced in the compute dtype or fp32 (communication_dtype=)"),
    "use_fp8": Compat(False, "fp8 compute is not supported; the parameters compute in the plugin's precision"),
}

# Booster checkpoint arguments (ColossalAI 0.5) elixir does not honour one-to-one
SAVE_MODEL: dict[str, Compat] = {
    "gather_dtensor": Compat(True, "the saved model is always the full (gathered) one"),
    "prefix": Compat(None, "files are named as Hugging Face names them (model.safetensors, model-0000i-of-0000n.safetensors)"),
    "use_async": Compat(False, "the checkpoint is written before save_model returns"),
}
SAVE_OPTIMIZER: dict[str, Compat] = {
    "gather_dtensor": Compat(True, "each rank writes its own shard (elixir never gathers the optimizer state)"),
    "prefix": Compat(None, "files are named optimizer-rankNNNNN-of-NNNNN"),
    "size_per_shard": Compat(1024, "each rank writes its own shard as one file"),
    "use_async": Compat(False, "the checkpoint is written before save_optimizer returns"),
}
LOAD: dict[str, Compat] = {
    "low_cpu_mem_mode": Compat(True, "elixir reads the files once, with no RAM cache"),
    "num_threads": Compat(1, "elixir reads the files from one thread per rank"),
}
