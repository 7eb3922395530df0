"""One rank of tests/test_multinode.py, started by ``torchrun --nnodes 2 --nproc-per-node 2``.

Compiles a 4-stage pipeline (one stage per rank) and then 2 stages x 2 replicas
(``data_parallel=2``), runs one step of each, and prints one JSON line per pipeline
(prefixed ``RESULT``): this rank's environment (``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``),
what fxpipe made of it (``pipe.rank``, its stages) and the largest differences of the loss
and of this rank's gradients to eager ``loss_fn(model(x), t).backward()`` on the whole batch.
"""

from __future__ import annotations

import copy
import json
import os

import torch
from torch import nn

import fxpipe

CE = nn.CrossEntropyLoss()


def mlp(width: int = 16, depth: int = 6, classes: int = 3) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def against_eager(name: str, plan: fxpipe.Plan) -> dict:
    torch.manual_seed(0)
    model = mlp().double()
    x, t = torch.randn(12, 16, dtype=torch.float64), torch.randint(0, 3, (12,))
    ref = copy.deepcopy(model)
    eager_loss = CE(ref(x), t)
    eager_loss.backward()
    expected = dict(ref.named_parameters())
    with fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=CE) as pipe:
        loss = pipe.step(x, target=t)
        grads = {n: p.grad for n, p in pipe.named_parameters()}
        return {
            "case": name,
            "env": {k: int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE")},
            "pipe_rank": pipe.rank,
            "local_stages": list(pipe.local_stages),
            "params": sorted(grads),
            "loss_err": abs(float(loss) - float(eager_loss)),
            "grad_err": max(float((g - expected[n].grad).abs().max()) for n, g in grads.items()),
        }


def main() -> None:
    four = fxpipe.Plan(devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"], split=["2", "6", "10"], microbatches=4)
    replicated = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["6"], microbatches=2, data_parallel=2)
    for name, plan in (("4 stages", four), ("2 stages x 2 replicas", replicated)):
        print("RESULT " + json.dumps(against_eager(name, plan)), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
