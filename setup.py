"""Build and install elixir.

The native extension ``elixir._C`` is built from ``csrc/*.cpp`` with pybind11 against raw buffers
only: no torch headers and no CUDA toolkit, so it compiles in seconds with any C++17 compiler.
SIMD variants (AVX-512, AVX2) are compiled into the same object through per-function target
attributes and chosen at run time, so no ``-march`` flag is needed. The extension is optional:
if it fails to build, installation still succeeds and elixir falls back to pure torch.
"""

import glob
import os
import re

from setuptools import find_packages, setup

try:
    from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
except ImportError:  # pybind11 missing at build time: install without the extension
    Pybind11Extension = None
    build_ext = None
else:
    # the sources compile one per core (NPY_NUM_BUILD_JOBS to choose): 40 s serial on a 2-core box, 21 s
    ParallelCompile("NPY_NUM_BUILD_JOBS").install()

HERE = os.path.dirname(os.path.abspath(__file__))


def read_version() -> str:
    with open(os.path.join(HERE, "elixir", "__init__.py")) as f:
        return re.search(r'__version__ = "([^"]+)"', f.read()).group(1)


def read_readme() -> str:
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
        return f.read()


def native_extensions():
    if Pybind11Extension is None or os.environ.get("ELIXIR_NO_NATIVE") == "1":
        return [], {}
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    ext = Pybind11Extension(
        "elixir._C",
        sources,
        include_dirs=["csrc"],
        depends=sorted(glob.glob(os.path.join("csrc", "*.h"))),  # a header's change rebuilds the extension
        extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno"],
        extra_link_args=["-fopenmp"],
        cxx_std=17,
        optional=True,  # a broken build must not break installation
    )
    return [ext], {"build_ext": build_ext}


ext_modules, cmdclass = native_extensions()

DIST_NAME = "elixir-train"  # "elixir" on PyPI is another project (a SQLAlchemy mapper); import name stays `elixir`
DOCS_URL = "https://elixir-train.readthedocs.io"
PYPI_URL = f"https://pypi.org/project/{DIST_NAME}/"

DOCS_EXTRA = ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"]

setup(
    name=DIST_NAME,
    version=read_version(),
    description="Train PyTorch models larger than accelerator memory: chunked ZeRO-3 with searched plans.",
    long_description=read_readme(),
    long_description_content_type="text/markdown",
    url=DOCS_URL,
    project_urls={
        "Documentation": DOCS_URL,
        "Getting started": f"{DOCS_URL}/getting-started/",
        "Changelog": f"{DOCS_URL}/changelog/",
        "Package": PYPI_URL,
    },
    keywords=["pytorch", "zero", "fsdp", "offload", "distributed training", "large models"],
    classifiers=[
        "Development Status :: 4 - Beta",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: C++",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.9",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Typing :: Typed",
    ],
    packages=find_packages(include=["elixir", "elixir.*"]),
    package_data={"elixir": ["py.typed", "data/*.json", "data/**/*.json"]},
    python_requires=">=3.9",
    install_requires=["torch>=2.1,<3", "numpy", "scipy", "networkx", "pybind11", "rich", "safetensors"],
    extras_require={
        "hf": ["transformers", "safetensors"],
        "peft": ["peft>=0.13", "transformers", "safetensors"],
        "plot": ["matplotlib"],
        "lightning": ["lightning>=2.4"],
        "transformers": ["transformers>=4.46", "accelerate", "safetensors"],
        "bench": ["transformers", "safetensors", "psutil"],
        "docs": DOCS_EXTRA,
        "dev": [
            "pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "ruff", "transformers", "accelerate", "safetensors", "psutil",
            "matplotlib", "lightning>=2.4", "peft>=0.13", "build", *DOCS_EXTRA,
        ],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": ["elixir=elixir.cli:main"]},
    zip_safe=False,
)
