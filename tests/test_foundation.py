"""The package imports, with and without the native extension, and the CLI answers."""

import os
import subprocess
import sys

import pytest

import elixir
from elixir import _native


def test_version():
    assert isinstance(elixir.__version__, str) and elixir.__version__.count(".") == 2


def test_native_extension_reports_cpu_features():
    if not _native.native_available():
        pytest.skip(f"native extension not built: {_native.native_error()}")
    feats = _native.get_native().cpu_features()
    assert set(feats) >= {"avx2", "avx512f", "f16c"}
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else None
    if flags is not None:  # the extension must agree with the kernel's view of the CPU
        assert feats["avx2"] == ("avx2" in flags)
        assert feats["avx512f"] == ("avx512f" in flags)
    assert _native.simd_level() in ("avx512", "avx2", "scalar")


@pytest.mark.dist
def test_simd_level_can_be_capped_by_env():
    if not _native.native_available():
        pytest.skip("native extension not built")
    code = "from elixir import _native; print(_native.simd_level())"
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "ELIXIR_SIMD": "scalar"}, capture_output=True, text=True
    )
    assert out.stdout.strip() == "scalar", out.stderr


HIDE_EXTENSION = """
import importlib.abc, sys, warnings
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "elixir._C":
            raise ImportError("hidden by test")
sys.meta_path.insert(0, Hide())
import elixir
from elixir import _native
assert not _native.native_available()
assert "hidden by test" in _native.native_error()
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    _native.warn_fallback("cpu adam")
    _native.warn_fallback("cpu adam")  # once only
assert len(w) == 1 and "hidden by test" in str(w[0].message), [str(x.message) for x in w]
print("fallback-ok", _native.simd_level(), sorted(_native.cpu_features()))
"""


@pytest.mark.dist
def test_import_without_extension_falls_back():
    out = subprocess.run([sys.executable, "-c", HIDE_EXTENSION], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "fallback-ok none" in out.stdout


@pytest.mark.dist
def test_cli_help_and_info():
    out = subprocess.run([sys.executable, "-m", "elixir", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "info" in out.stdout, out.stderr
    out = subprocess.run([sys.executable, "-m", "elixir", "info", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert '"elixir": "' + elixir.__version__ in out.stdout.replace(" ", "").replace('":"', '": "')
