"""Run a ColossalAI tutorial program from this folder under torchrun: ``python tests/tutorials/run.py NAME``.

On a machine without CUDA the tutorials' CUDA device is the CPU: ``torch.cuda.current_device()``
returns the CPU device, and the literal ``'cuda'`` in the program text becomes ``'cpu'`` (the
count of such replacements is printed). With CUDA nothing is replaced. A program that defines
``train()`` (the Booster tutorial) is called with the launcher's ``rank``, ``world_size`` and
``port`` as globals, as the tutorial's launcher provides them.
"""

from __future__ import annotations

import os
import sys

import torch

here = os.path.dirname(os.path.abspath(__file__))
name = sys.argv[1]
src = open(os.path.join(here, name + ".py")).read()
if not torch.cuda.is_available():
    torch.cuda.current_device = lambda: torch.device("cpu")
    print(f"cpu stand-in: {src.count(chr(39) + 'cuda' + chr(39))} 'cuda' literal(s) -> 'cpu'")
    src = src.replace("'cuda'", "'cpu'")
scope = {"__name__": "__tutorial__", "rank": int(os.environ.get("RANK", 0)), "world_size": int(os.environ.get("WORLD_SIZE", 1)),
         "port": int(os.environ.get("MASTER_PORT", 29500))}
exec(compile(src, os.path.join(here, name + ".py"), "exec"), scope)
if "train" in scope:
    scope["train"]()
print("tutorial done")
