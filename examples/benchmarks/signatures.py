"""A new input signature: what its first call costs, and whether a cached one runs as fast.

GPT-2 (12 layers, width 64, tied embeddings; torch.export bakes the sequence length) on a
2-stage 1F1B pipeline with 4 micro-batches. In one run:
  first call   pipeline A, compiled at length 16, called at length 32 for the first time:
               that call traces and cuts the new signature (seconds), against A's cached
               step at length 16
  cached       A's later steps at length 32, against pipeline B compiled at length 32 in the
               first place; measurements interleaved, medians reported. Goal: A within 5% of B.

    .venv/bin/python examples/benchmarks/signatures.py [--repeats 9] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import fxpipe

sys.path.insert(0, str(Path(__file__).parent))
from rng_overhead import interleaved  # noqa: E402 - the shared timing helper beside this file


def lm_loss(out, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="4 layers, 3 repeats: a check that it runs")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    layers, repeats = (4, 3) if args.quick else (12, args.repeats)
    torch.manual_seed(0)
    config = GPT2Config(bos_token_id=0, eos_token_id=1, vocab_size=256, n_positions=64, n_embd=64, n_layer=layers, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, use_cache=False)
    model = GPT2LMHeadModel(config)
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=[f"transformer.h.{layers // 2}"], microbatches=4)

    def batch(length: int) -> tuple[dict, torch.Tensor]:
        ids = torch.randint(0, 256, (8, length))
        return {"input_ids": ids}, torch.randint(0, 256, (8, length))

    short, long = batch(16), batch(32)
    started = time.perf_counter()
    pipe_a = fxpipe.compile(copy.deepcopy(model), plan, example_kwargs=short[0], loss_fn=lm_loss)
    compile_a = time.perf_counter() - started
    pipe_a.step(target=short[1], **short[0])
    cached_short = interleaved({"A at 16": lambda: pipe_a.step(target=short[1], **short[0])}, repeats, 1)["A at 16"]
    started = time.perf_counter()
    pipe_a.step(target=long[1], **long[0])
    first_call = time.perf_counter() - started
    started = time.perf_counter()
    pipe_b = fxpipe.compile(copy.deepcopy(model), plan, example_kwargs=long[0], loss_fn=lm_loss)
    compile_b = time.perf_counter() - started
    times = interleaved(
        {"A at 32 (cached)": lambda: pipe_a.step(target=long[1], **long[0]), "B at 32 (compiled at 32)": lambda: pipe_b.step(target=long[1], **long[0])},
        repeats,
        1,
    )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads; GPT-2 {layers} layers, width 64, batch 8, 2 stages, 1F1B, 4 micro-batches")
    print(f"  compile A at length 16            {compile_a:7.2f} s")
    print(f"  compile B at length 32            {compile_b:7.2f} s")
    print(f"  A's first call at length 32       {first_call:7.2f} s  (a new signature: traced and cut, then run; a step at 16 takes {cached_short * 1e3:.1f} ms)")
    for name, seconds in times.items():
        print(f"  {name:<33} {seconds * 1e3:7.1f} ms per step")
    ratio = times["A at 32 (cached)"] / times["B at 32 (compiled at 32)"]
    print(f"  cached / compiled for the shape:  {ratio:.3f}x (goal <= 1.05)")
    print(f"  signatures A holds: {pipe_a.signatures}")


if __name__ == "__main__":
    main()
