"""The LLM training loop as a user writes it: padded token-mean losses, a model's own
``labels=`` loss, global gradient clipping, eval mode, batch-1 examples, outputs that do
not follow the batch, left-out arguments, and a clean exit; locally and on gloo ranks."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.batching.microbatch import MicrobatchError
from fxpipe.distributed import launch

transformers = pytest.importorskip("transformers")

V, T, B = 50, 12, 8


class TinyLM(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, width)
        self.body = nn.Linear(width, width)
        self.head = nn.Linear(width, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.emb(ids))))


def padded_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[:4, 2:] = -100  # half the samples are mostly padding
    targets[6] = -100  # one sample is all padding
    return ids, targets


def gpt2(layers: int = 2) -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=32, n_head=4, vocab_size=V, n_positions=32, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).double()


def max_relative_grad_error(pipe, model: nn.Module) -> float:
    eager = dict(model.named_parameters())
    return max(float((p.grad - eager[k].grad).abs().max() / eager[k].grad.abs().max().clamp_min(1e-30)) for k, p in pipe.named_parameters())


CE = nn.CrossEntropyLoss(ignore_index=-100)
WEIGHTS = torch.rand(V, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 0.5
LOSSES = {
    "module": lambda out, t: CE(out.flatten(0, 1), t.flatten()),
    "functional+mse": lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten(), ignore_index=-100) + 0.1 * F.mse_loss(out, torch.zeros_like(out)),
    "class-weighted nll": lambda out, t: F.nll_loss(out.log_softmax(-1).flatten(0, 1), t.flatten(), weight=WEIGHTS),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("m", [2, 3])
def test_token_mean_loss_with_padding_equals_the_full_batch_loss(name: str, m: int) -> None:
    """However the batch is cut (3 micro-batches of 3, 3, 2), the step's loss and gradients are
    the full batch's: the sum over the step divided by the step's count of tokens."""
    loss_fn = LOSSES[name]
    torch.manual_seed(0)
    model = TinyLM().double()
    ids, targets = padded_batch()
    plan = fxpipe.Plan(split=["body"], devices=["cpu", "cpu"], microbatches=m, schedule="1f1b")
    ref = copy.deepcopy(model)  # the pipeline's parameters are the model's own
    pipe = fxpipe.compile(model, plan, example_inputs=(ids,), loss_fn=loss_fn)
    loss = pipe.step(ids, target=targets)
    eager = loss_fn(ref(ids), targets)
    eager.backward()
    assert torch.allclose(loss, eager, rtol=1e-12, atol=0)
    assert max_relative_grad_error(pipe, ref) < 1e-10


def test_a_models_own_labels_loss_equals_the_full_batch_loss() -> None:
    model = gpt2()
    ids, labels = padded_batch()
    plan = fxpipe.Plan(split=["transformer.h.1"], devices=["cpu", "cpu"], microbatches=4, schedule="1f1b")
    ref = copy.deepcopy(model)
    pipe = fxpipe.compile(model, plan, example_inputs=(ids,), example_kwargs={"labels": labels})
    assert pipe.part.model_losses is not None  # the target slice was found in the graph
    loss = pipe.step(ids, labels=labels)
    eager = ref(ids, labels=labels).loss
    eager.backward()
    assert torch.allclose(loss.double(), eager.double(), rtol=1e-6)
    assert max_relative_grad_error(pipe, ref) < 1e-9


def test_a_loss_that_cannot_be_counted_warns_once_and_weights_per_sample() -> None:
    def opaque(out, t):  # the mask comes from the output's values: not countable on meta copies
        keep = out.detach().argmax(-1) != t
        return F.cross_entropy(out[keep], t[keep])

    model = TinyLM().double()
    ids, targets = padded_batch()
    targets = targets.clamp_min(0)
    pipe = fxpipe.compile(model, fxpipe.Plan(split=["body"], devices=["cpu", "cpu"], microbatches=2), example_inputs=(ids,), loss_fn=opaque)
    with pytest.warns(UserWarning, match="weighted by its share of the samples"):
        pipe.step(ids, target=targets)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_equals_torch_on_the_eager_model_with_tied_weights(norm_type: float) -> None:
    model = gpt2()
    ids, targets = padded_batch()
    loss_fn = lambda out, t: CE(out.logits.flatten(0, 1), t.flatten())  # noqa: E731
    ref = copy.deepcopy(model)
    pipe = fxpipe.compile(model, fxpipe.Plan(split=["transformer.h.1"], devices=["cpu", "cpu"], microbatches=2), example_inputs=(ids,), loss_fn=loss_fn)
    pipe.step(ids, target=targets)
    total = pipe.clip_grad_norm_(0.1, norm_type)
    loss_fn(ref(ids), targets).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1, norm_type)
    assert torch.allclose(total, expected, rtol=1e-10)
    assert max_relative_grad_error(pipe, ref) < 1e-9


class TrainingFlag(nn.Module):
    """Reads self.training in Python, as attention implementations do for dropout_p."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.dropout(self.a(x), p=0.5 if self.training else 0.0, training=self.training))


def test_eval_mode_follows_python_reads_of_self_training() -> None:
    model = TrainingFlag()
    x = torch.randn(6, 8)
    pipe = fxpipe.compile(model, fxpipe.Plan(split=["b"], devices=["cpu", "cpu"], microbatches=2), example_inputs=(x,))
    pipe.eval()
    model.eval()
    first, second = pipe(x), pipe(x)
    assert torch.equal(first, second)
    assert torch.allclose(first, model(x))
    assert [s.endswith("(eval)") for s in pipe.signatures] == [False, True]
    pipe.train()
    assert not torch.equal(pipe(x), pipe(x))  # dropout is back
    assert len(pipe.signatures) == 2  # the train program was kept


class WithStatistics(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, table: torch.Tensor):
        return self.b(self.a(x)), self.b.weight.sum(0), table * 2, x.sum(0)


def test_outputs_that_do_not_follow_the_batch_pass_through_once() -> None:
    model = WithStatistics()
    x, table = torch.randn(6, 4), torch.randn(3, 5)
    plan = fxpipe.Plan(split=["b"], devices=["cpu", "cpu"], microbatches=3, output_merge={"3": "sum"})
    out = fxpipe.compile(model, plan, example_inputs=(x, table))(x, table)
    for got, expected in zip(out, model(x, table)):
        assert torch.allclose(got, expected, atol=1e-6)
    # a batch-dependent output without a merge rule keeps the clear error
    pipe = fxpipe.compile(model, fxpipe.Plan(split=["b"], devices=["cpu", "cpu"], microbatches=3), example_inputs=(x, table))
    with pytest.raises(MicrobatchError, match="output '3'"):
        pipe(x, table)


def test_a_batch_one_example_serves_other_batch_sizes_under_export() -> None:
    model = gpt2().eval()
    plan = fxpipe.Plan(split=["transformer.h.1"], devices=["cpu", "cpu"], microbatches=1, frontend="export")
    pipe = fxpipe.compile(model, plan, example_inputs=(torch.randint(0, V, (1, 8)),))
    ids = torch.randint(0, V, (3, 8))
    assert torch.allclose(pipe(ids).logits, model(ids).logits)
    assert len(pipe.signatures) == 1


class CausalUnlessMasked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is None:
            length = int(x.shape[1])  # fx cannot make a traced size an int
            mask = torch.ones(length, length).tril().bool()
        h = self.a(x)
        return self.b((h @ h.transpose(1, 2)).masked_fill(~mask, -1e9).softmax(-1) @ h)


def test_a_left_out_argument_works_or_is_named_with_the_fix() -> None:
    model = CausalUnlessMasked()
    x, mask = torch.randn(4, 5, 8), torch.ones(5, 5, dtype=torch.bool)
    exported = fxpipe.compile(model, fxpipe.Plan(split=["b"], devices=["cpu", "cpu"], microbatches=2, frontend="export"), example_inputs=(x,), example_kwargs={"mask": mask})
    assert torch.allclose(exported(x), model(x), atol=1e-6)  # a new signature
    traced = fxpipe.compile(model, fxpipe.Plan(split=["b"], devices=["cpu", "cpu"], microbatches=2, frontend="fx"), example_inputs=(x,), example_kwargs={"mask": mask})
    with pytest.raises(Exception, match=r"mask: bool\[\*, \*\] -> None.*To run without mask"):
        traced(x)


def test_close_joins_the_local_workers_and_the_pipeline_still_runs() -> None:
    model = TinyLM()
    ids = torch.randint(0, V, (4, T))
    with fxpipe.compile(model, fxpipe.Plan(split=["body"], devices=["cpu", "cpu"], microbatches=2), example_inputs=(ids,)) as pipe:
        pipe(ids)
        workers = [w.thread for w in pipe._executor._threads.values()]
    assert workers and not any(t.is_alive() for t in workers)
    assert torch.allclose(pipe(ids), model(ids), atol=1e-6)
    pipe.close()


# ------------------------------------------------------------------ torchrun
def distributed_loop(replicas: int) -> dict:
    """GPT-2 (tied embedding across ranks) with padded targets: loss_fn and labels= losses,
    then clip_grad_norm_, equal to the full-batch eager loop; fxpipe's threads end on close."""
    import torch.distributed as dist

    model = gpt2(layers=4)
    ids, targets = padded_batch()
    loss_fn = lambda out, t: CE(out.logits.flatten(0, 1), t.flatten())  # noqa: E731
    plan = fxpipe.Plan(split=["transformer.h.2"], devices=["cpu", "cpu"], microbatches=2, data_parallel=replicas)
    result = {}
    ref = copy.deepcopy(model)  # the pipeline's parameters are the model's own
    with fxpipe.compile(model, plan, example_inputs=(ids,), loss_fn=loss_fn) as pipe:
        loss = pipe.step(ids, target=targets)
        total = pipe.clip_grad_norm_(0.5)
        eager = loss_fn(ref(ids), targets)
        eager.backward()
        expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        result["loss_fn"] = (float(loss), float(eager), float(total), float(expected), max_relative_grad_error(pipe, ref))
    model.zero_grad()
    ref.zero_grad()
    with fxpipe.compile(model, plan, example_inputs=(ids,), example_kwargs={"labels": targets}) as pipe:
        loss = pipe.step(ids, labels=targets)
        eager = ref(ids, labels=targets).loss
        eager.backward()
        result["labels"] = (float(loss), float(eager), max_relative_grad_error(pipe, ref))
    result["threads"] = sorted(t.name for t in threading.enumerate() if t.name in ("fxpipe-heartbeat", "fxpipe-comm-wait"))
    dist.destroy_process_group()
    return result


@pytest.mark.parametrize("world, replicas", [(2, 1), (4, 2)])
def test_the_llm_loop_equals_eager_across_ranks_and_replicas(world: int, replicas: int) -> None:
    for rank, r in enumerate(launch(distributed_loop, world, (replicas,), timeout=240)):
        loss, eager, total, expected, err = r["loss_fn"]
        assert abs(loss - eager) < 1e-12 and abs(total - expected) < 1e-12 and err < 1e-9, (rank, r)
        loss, eager, err = r["labels"]
        assert abs(loss - eager) < 1e-6 and err < 1e-9, (rank, r)
        assert r["threads"] == [], (rank, r)
