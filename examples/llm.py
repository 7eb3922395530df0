"""Train a GPT-2 language model with tied embeddings on batches of varying length.

A small GPT-2 (transformers' ``GPT2LMHeadModel`` built from a config: the output head is the
token embedding, tied) learns a synthetic language: token sequences drawn from a fixed
random Markov chain, so the best possible loss is known (the chain's entropy rate) and the
curve has somewhere to go. Batches come bucketed by length, as LM data loaders do: every
batch has its own sequence length (``--lengths``), and each epoch ends on a short batch.

The pipeline is two stages cut at ``transformer.h.<layers/2>`` (or ``--split auto``),
1F1B over 4 micro-batches. fxpipe traces GPT-2 with torch.fx (its default frontend),
following the sequence length it is given, and compiles once per input signature
(sequence length), keeping the stage boundaries where the first signature put them. The script draws the split
(``--draw``); an eager copy trains on the same batches; it prints both losses, the largest
difference and the pipeline's summary. Exit status 1 when a step's losses differ by more than 1e-4.

    .venv/bin/python examples/llm.py [--steps 60] [--lengths 16,24,32,48] [--split auto] \\
        [--draw docs/img/llm-split.png]
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from common import eager_step, limit_threads, stage_devices
from torch import nn

import fxpipe

LOSS_TOLERANCE = 1e-4


def gpt2(vocab: int, layers: int, width: int) -> nn.Module:
    """A GPT-2 from a config (no download), dropout off so eager and pipeline agree step by step."""
    import transformers

    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=128, n_embd=width, n_layer=layers, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0, tie_word_embeddings=True,
    )
    return transformers.GPT2LMHeadModel(config)


class MarkovLanguage:
    """Sequences from a random first-order Markov chain whose rows favour a few successors."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(vocab, vocab, generator=g) * 3.0
        self.transitions = logits.softmax(-1)
        self.generator = g

    def entropy_rate(self) -> float:
        """Nats per token of the chain in its stationary distribution: the loss floor."""
        stationary = torch.linalg.matrix_power(self.transitions, 256)[0]
        per_state = -(self.transitions * self.transitions.log()).sum(-1)
        return float((stationary * per_state).sum())

    def batch(self, size: int, length: int) -> torch.Tensor:
        tokens = torch.empty(size, length + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, len(self.transitions), (size,), generator=self.generator)
        for t in range(length):
            tokens[:, t + 1] = torch.multinomial(self.transitions[tokens[:, t]], 1, generator=self.generator).squeeze(1)
        return tokens


def batches(language: MarkovLanguage, steps: int, batch: int, lengths: Sequence[int]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, next-token targets), cycling through the lengths; every 5th batch is short
    (the end of an epoch: fewer samples than the others)."""
    for step in range(steps):
        size = batch - batch // 4 if step % 5 == 4 else batch
        tokens = language.batch(size, lengths[step % len(lengths)])
        yield tokens[:, :-1], tokens[:, 1:]


def lm_loss(out, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lengths", default="16,24,32,48", help="sequence lengths, comma-separated, in turn")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--split", default="module", choices=("module", "auto"), help="cut at transformer.h.<layers/2> or by the cost model")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--draw", default=None, help="write the partition drawing here (.png, .svg)")
    parser.add_argument("--print-every", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="a few steps of a 2-layer model (for tests)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.layers, args.width, args.batch = 6, 2, 32, 8
    limit_threads()
    lengths = [int(n) for n in args.lengths.split(",")]

    torch.manual_seed(0)
    model = gpt2(args.vocab, args.layers, args.width)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    eager = copy.deepcopy(model)
    language = MarkovLanguage(args.vocab)
    split = [f"transformer.h.{args.layers // 2}"] if args.split == "module" else "auto"
    plan = fxpipe.Plan(devices=stage_devices(2), split=split, schedule="1f1b", microbatches=args.microbatches)
    print(
        f"GPT-2: {args.layers} layers, width {args.width}, vocabulary {args.vocab} (tied head); lengths {lengths}, "
        f"batches of {args.batch}; {plan.devices}, 1F1B, {plan.microbatches} micro-batches; "
        f"the chain's entropy rate {language.entropy_rate():.3f} nats (the best loss), uniform guess {math.log(args.vocab):.3f}"
    )
    data = list(batches(language, args.steps, args.batch, lengths))
    pipe = fxpipe.compile(model, plan, example_inputs=(data[0][0],), loss_fn=lm_loss)
    if args.draw:
        print(f"partition drawn to {pipe.draw(args.draw, level='stage')}")
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=args.lr)

    print(f"{'step':>5}  {'length':>6}  {'batch':>5}  {'pipelined loss':>14}  {'eager loss':>10}  {'difference':>10}")
    losses, differences, began = [], [], time.perf_counter()
    for step, (ids, target) in enumerate(data):
        opt.zero_grad()
        eager_opt.zero_grad()
        loss = float(pipe.step(ids, target=target))
        reference = float(eager_step(eager, ids, target, lm_loss, plan.microbatches))
        opt.step()
        eager_opt.step()
        losses.append(loss)
        differences.append(abs(loss - reference))
        if step % args.print_every == 0 or step == len(data) - 1:
            print(f"{step:>5}  {ids.shape[1]:>6}  {ids.shape[0]:>5}  {loss:>14.6f}  {reference:>10.6f}  {differences[-1]:>10.2e}")
    seconds = time.perf_counter() - began
    print(f"\n{len(data)} steps in {seconds:.1f} s (pipeline and eager); largest loss difference {max(differences):.2e}\n")
    print(pipe.summary())
    return {"losses": losses, "largest_difference": max(differences), "pipeline": pipe}


if __name__ == "__main__":
    result = main()
    raise SystemExit(0 if result["largest_difference"] <= LOSS_TOLERANCE else 1)
