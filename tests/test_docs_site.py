"""The documentation site (issue 34): ``mkdocs build --strict`` passes (a broken link, a missing
page or an unresolved reference fails it), and the generated API reference has an entry for every
name in ``elixir.__all__`` and in each subpackage's ``__all__``."""

from __future__ import annotations

import importlib
import os
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest

import elixir

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.dist  # runs mkdocs / the build and a fresh interpreter in subprocesses

# Modules (not packages) whose __all__ the reference covers too.
EXTRA_MODULES = ("elixir.models", "elixir.integrations.transformers")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    return out


def public_modules() -> list[str]:
    """elixir and every subpackage of it with an ``__all__``, plus :data:`EXTRA_MODULES`."""
    names = ["elixir"]
    for info in pkgutil.walk_packages(elixir.__path__, "elixir."):
        if info.ispkg and hasattr(importlib.import_module(info.name), "__all__"):
            names.append(info.name)
    return names + list(EXTRA_MODULES)


def _anchors(site: pathlib.Path) -> set[str]:
    ids: set[str] = set()
    for page in (site / "api").rglob("*.html"):
        ids |= set(re.findall(r'id="([^"]+)"', page.read_text(encoding="utf-8")))
    return ids


def test_strict_build_makes_every_page(site):
    for page in ("index.html", "getting-started/index.html", "coming-from/index.html", "changelog/index.html",
                 "api/index.html", "api/wrapper/index.html"):
        assert (site / page).is_file(), page
    assert "elixir-train" in (site / "index.html").read_text(encoding="utf-8")


def test_api_reference_covers_every_public_name(site):
    ids = _anchors(site)
    missing = []
    for mod_name in public_modules():
        mod = importlib.import_module(mod_name)
        for name in mod.__all__:
            obj = getattr(mod, name)
            where = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
            if f"{mod_name}.{name}" not in ids and where not in ids:
                missing.append(f"{mod_name}.{name}")
    assert not missing, f"no API reference entry for {missing}: add them to a page under docs/api/"
    assert {"elixir.wrapper", "elixir.search", "elixir.booster", "elixir.checkpoint"} <= set(public_modules())
