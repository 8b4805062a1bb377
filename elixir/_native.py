"""The one door to the C++ extension ``elixir._C``.

Everything that wants a native kernel calls :func:`get_native`. When the extension is missing
(no compiler at install time, a broken build, or ``ELIXIR_DISABLE_NATIVE=1``), ``get_native``
returns ``None``, callers use their pure-torch path, and :func:`warn_fallback` says so once,
naming the cause.
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType
from typing import Optional

_module: Optional[ModuleType] = None
_error: Optional[str] = None
_loaded = False
_warned: set[str] = set()


def _load() -> None:
    global _module, _error, _loaded
    if _loaded:
        return
    _loaded = True
    if os.environ.get("ELIXIR_DISABLE_NATIVE", "") == "1":
        _error = "disabled by ELIXIR_DISABLE_NATIVE=1"
        return
    try:
        _module = importlib.import_module("elixir._C")
    except ImportError as e:  # not built, or built for another Python/arch
        _error = f"{type(e).__name__}: {e}"


def get_native() -> Optional[ModuleType]:
    """The extension module, or None if it cannot be imported."""
    _load()
    return _module


def native_available() -> bool:
    """Whether the C++ extension is importable."""
    return get_native() is not None


def native_error() -> Optional[str]:
    """Why the extension is unavailable, or None if it loaded."""
    _load()
    return _error


def warn_fallback(feature: str) -> None:
    """Warn once per feature that it runs on pure torch because the extension is missing."""
    if feature in _warned:
        return
    _warned.add(feature)
    warnings.warn(
        f"elixir: native extension unavailable ({native_error()}); {feature} falls back to pure torch. "
        "Reinstall with a C++ compiler present (`pip install -e .`) to enable it.",
        RuntimeWarning,
        stacklevel=3,
    )


def cpu_features() -> dict[str, bool]:
    """CPU features seen at run time (from the extension; torch's view if it is missing)."""
    native = get_native()
    if native is not None:
        return dict(native.cpu_features())
    # lazy: the extension's door loads without torch; only this fallback needs it
    import torch

    cap = torch.backends.cpu.get_cpu_capability()  # e.g. "AVX512", "AVX2", "DEFAULT"
    return {"avx2": cap in ("AVX2", "AVX512"), "avx512f": cap == "AVX512"}


def simd_level() -> str:
    """The SIMD level native kernels use: 'avx512', 'avx2', 'scalar', or 'none' without the extension."""
    native = get_native()
    return native.simd_level() if native is not None else "none"
