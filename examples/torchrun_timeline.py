"""The whole pipeline's timeline under torchrun: every rank's events of a step on one clock.

A GPT-2 (examples/llm_configs.py) cut into one stage per rank trains a few steps with
next-token cross-entropy; after the last, every rank calls ``pipe.timeline()``, which
gathers the ranks' events (two all-gathers, only when asked). Rank 0 prints the
pipeline's bubble beside the bubble each rank's own events would give (its own view
counts the other ranks as idle) and writes the Gantt chart and the Chrome trace (one named
process per rank, the messages between ranks as flow arrows).

    .venv/bin/torchrun --nproc-per-node 4 examples/torchrun_timeline.py \\
        [--schedule 1f1b] [--microbatches 8] [--out docs/img]

``--smoke``: a 2-layer model, 2 micro-batches, one step (for tests).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from common import stage_devices
from llm_configs import gpt2

import fxpipe
from fxpipe.cli_model import next_token_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zb-h1"])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for torchrun-timeline.png and torchrun-trace.json")
    parser.add_argument("--smoke", action="store_true", help="a 2-layer model, 2 micro-batches, one step (for tests)")
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.microbatches, args.steps = 2, 2, 1
    torch.manual_seed(0)
    torch.set_num_threads(1)
    ids = torch.randint(0, 1024, (4, 16) if args.smoke else (16, 64))
    devices = stage_devices(int(os.environ["WORLD_SIZE"]))  # one stage per rank
    plan = fxpipe.Plan(devices=devices, split="auto", schedule=args.schedule, microbatches=args.microbatches)
    pipe = fxpipe.compile(gpt2(layers=args.layers), plan, example_inputs=(ids,), loss_fn=next_token_loss)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    for _ in range(args.steps):
        loss = pipe.step(ids, target=ids)
        optimizer.step()
        optimizer.zero_grad()
    whole = pipe.timeline()  # a collective: every rank asks
    own = pipe.timeline(gather=False)
    own_bubbles = [0.0] * pipe.world_size
    dist.all_gather_object(own_bubbles, own.bubble_fraction)
    if pipe.rank == 0:
        print(f"{pipe.world_size} ranks, {args.schedule}, {args.microbatches} micro-batches; last loss {float(loss):.4f}")
        print(whole.summary())
        print("each rank's own events alone: bubble " + ", ".join(f"rank {r} {b:.1%}" for r, b in enumerate(own_bubbles)))
        args.out.mkdir(parents=True, exist_ok=True)
        picture, trace = args.out / "torchrun-timeline.png", args.out / "torchrun-trace.json"
        whole.plot(picture, title=f"GPT-2 on {pipe.world_size} ranks under torchrun, {args.schedule}: the last step of every rank")
        whole.to_chrome_trace(trace)
        print(f"timeline: {picture}\nChrome trace: {trace}")
    pipe.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
