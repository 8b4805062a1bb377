"""Measure a machine into a hardware profile for the search.

On one node with several accelerators, run it under torchrun so the collectives are measured over
the real interconnect and backend (every rank takes part; rank 0 measures the rest and writes)::

    torchrun --nproc-per-node 8 profile/measure.py --out hw.json [--dir /nvme/offload] [--quick]

On a single device or a CPU box, plain ``python profile/measure.py --out hw.json`` spawns
``--world-size`` local ranks for the collective part (2 by default). This is the same as
``elixir hwprofile``.
"""

import sys

from elixir.cli import main

if __name__ == "__main__":
    sys.exit(main(["hwprofile", *sys.argv[1:]]))
