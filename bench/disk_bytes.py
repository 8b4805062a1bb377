"""Bytes on disk per parameter of offloaded optimizer state, for each state format (issue 33,
done-when 2: <= 4 B/param with ``master="bf16-sr"``, ``moments="int8"``; 12 for fp32).

A LLaMA-style model (``bench/capacity.py``'s config, tens of millions of parameters) is wrapped
with every chunk's master and optimizer state on disk (shards in host memory, as the capacity
bench's largest elixir rungs place them) and trained a few steps under each format. Three figures
per format, each per trainable parameter:

- ``written/step``: the capacity bench's disk counter (``/proc/self/io`` ``write_bytes``) over a
  steady step (after the first): a disk step writes each chunk's master and moments back once
  (their filled part: the chunks' zero padding is laid down once, at the first write); beside it
  the store's own count of the bytes it wrote (``DiskStore.bytes_written``);
- ``file``: the offload file's allocated size (``st_blocks``), the space it takes on disk;
- ``laid out``: the bytes the store laid out (its regions, alignment included);

beside the footprint rule's prediction (:func:`elixir.plan.state_format.disk_state_bytes`).

    python bench/disk_bytes.py                          # 57.7M parameters, fp32 and bf16-sr/int8
    python bench/disk_bytes.py --formats fp32/fp32,bf16-sr/int8,bf16-kahan/bf16 --hidden 256 --layers 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from capacity import _io, llama_config  # bench/capacity.py: the same counter and model family


def measure(master: str, moments: str, hidden: int, layers: int, vocab: int, seq: int, steps: int, offload: str) -> dict:
    """Train ``steps`` steps with every chunk's state on disk under the formats; the figures above."""
    import torch
    from transformers import AutoModelForCausalLM

    from elixir.optim import HybridAdam
    from elixir.plan import Placement
    from elixir.plan.state_format import disk_state_bytes
    from elixir.search import minimum_waste_search
    from elixir.wrapper import ElixirModule, ElixirOptimizer
    from elixir.wrapper.policies import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config(hidden, layers, vocab)).train()
    numel = sum(p.numel() for p in model.parameters())
    plan = minimum_waste_search(model, 1, unified_dtype=torch.bfloat16)
    plan = dataclasses.replace(plan, chunks=tuple(
        dataclasses.replace(c, optim_placement=Placement.DISK, shard_placement=Placement.HOST) for c in plan.chunks))
    em = ElixirModule(model, plan, offload_dir=offload,
                      mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32,
                                                     master=master, moments=moments))
    eo = ElixirOptimizer(em, HybridAdam(em.parameters(), lr=1e-4))
    ids = torch.randint(0, vocab, (1, seq))
    written, by_store, losses = [], [], []
    for _ in range(steps):
        w0, s0 = _io()[1], em.disk_store.bytes_written
        loss = em(input_ids=ids, labels=ids).loss
        loss.backward()
        eo.step()
        eo.zero_grad()
        em.disk_store.settle()
        os.sync()  # the counter books pages as they are dirtied; settle the step's writes first
        written.append(_io()[1] - w0)
        by_store.append(em.disk_store.bytes_written - s0)
        losses.append(float(loss))
    store = em.disk_store
    elements = sum(rec.numel for rec in store.chunks.values())
    steady, store_steady = written[1:] or written, by_store[1:] or by_store
    out = {
        "master": master, "moments": moments, "params": numel, "disk_elements": elements,
        "written_per_step_B_per_param": sum(steady) / len(steady) / numel,
        "store_written_per_step_B_per_param": sum(store_steady) / len(store_steady) / numel,
        "file_B_per_param": os.fstat(store.location.file.fd).st_blocks * 512 / numel,
        "laid_out_B_per_param": store.report()["file_bytes"] / elements,
        "predicted_B_per_param": disk_state_bytes(master, moments),
        "losses": losses,
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="fp32/fp32,bf16-sr/int8", help="master/moments pairs, comma-separated")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--offload-dir", default=None)
    args = ap.parse_args()
    for pair in args.formats.split(","):
        master, moments = pair.split("/")
        with tempfile.TemporaryDirectory(prefix="disk-bytes-", dir=args.offload_dir) as d:
            print(json.dumps(measure(master, moments, args.hidden, args.layers, args.vocab, args.seq, args.steps, d)), flush=True)


if __name__ == "__main__":
    main()
