"""The models of 2026: MoE and hybrid families compile with transformers' defaults and train
exactly (issue 34).

Every family is built with its library's defaults: ``use_cache`` left on, the experts'
default implementation (``torch._grouped_mm``, whose meta kernel refuses float32 while the
CPU kernel runs it: those nodes run for real at compile time, and ``summary()`` says so).
Two stages split at ``model.layers.2``, 1F1B, 4 micro-batches, float32: the loss and every
gradient equal eager's, eval logits equal eager's at the batch and at batches smaller than
the micro-batch count, without ``output_merge``. Mixtral and Qwen3-MoE run by default, the
other families are marked slow. Below them, the pieces on small models: the fake replay's
real runs, batchedness from the graph, the merge error's suggestion, ``use_cache`` on
GPT-2, and the router's auxiliary loss named in a warning.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.fx as fx
from moe_models import FAMILIES, logits_loss, max_relative_grad_error, token_batch
from torch import nn

import fxpipe
from fxpipe.batching.batched_outputs import graph_batched_outputs
from fxpipe.batching.microbatch import MicrobatchError, merge
from fxpipe.passes.fake_replay import DATA_DEPENDENT, FakeReplay

transformers = pytest.importorskip("transformers")

SAMPLE = {"mixtral", "qwen3-moe"}
GRID = [pytest.param(name, marks=() if name in SAMPLE else pytest.mark.slow, id=name) for name in FAMILIES]
PLAN = dict(devices=["cpu", "cpu"], microbatches=4, schedule="1f1b")


@pytest.mark.parametrize("name", GRID)
def test_moe_family_with_library_defaults_trains_and_evaluates_like_eager(name: str) -> None:
    family = FAMILIES[name]
    model = family.build()
    ref = copy.deepcopy(model)
    ids, target = token_batch(), token_batch(seed=1)
    pipe = fxpipe.compile(model, fxpipe.Plan(split=[family.split], **PLAN), example_inputs=(ids,), loss_fn=logits_loss())
    grouped = [r for r in pipe.part.real_runs if r.target == "_grouped_mm"]
    assert grouped and all("fake kernel refused" in r.why for r in grouped)
    assert "ran for real at compile time" in pipe.summary() and "_grouped_mm" in pipe.summary()
    assert any("use_cache" in note for note in pipe.part.notes)

    loss = pipe.step(ids, target=target)
    eager = logits_loss()(ref(ids), target)
    eager.backward()
    assert torch.allclose(loss, eager, rtol=1e-6, atol=1e-6)
    assert max_relative_grad_error(pipe, ref) < 1e-4

    pipe.eval()
    ref.eval()
    with torch.no_grad():
        for rows in (8, 3, 1):  # 3 and 1: fewer samples than micro-batches
            out, expected = pipe(ids[:rows]).logits, ref(ids[:rows]).logits
            assert out.shape == expected.shape
            assert torch.allclose(out, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", [pytest.param("mixtral"), pytest.param("qwen3-moe", marks=pytest.mark.slow)])
def test_router_aux_loss_is_named_and_equals_eager_over_the_same_microbatches(name: str) -> None:
    """The load-balancing term is computed per micro-batch: a warning names it, once, and the
    step equals eager accumulated over the same micro-batches (each weighted by its share)."""
    model = FAMILIES[name].build(output_router_logits=True)
    ref = copy.deepcopy(model)
    ids = token_batch()
    pipe = fxpipe.compile(model, fxpipe.Plan(split=[FAMILIES[name].split], **PLAN), example_inputs=(ids,), example_kwargs={"labels": ids})
    assert pipe.part.loss_terms == ["aux_loss"]
    with pytest.warns(UserWarning, match=r"'aux_loss'.*per micro-batch") as caught:
        loss = pipe.step(ids, labels=ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: not again
        pipe.step(ids, labels=ids)
    assert sum("per micro-batch" in str(w.message) for w in caught) == 1

    expected = torch.zeros(())
    for piece in ids.split(2):
        out = ref(piece, labels=piece)
        (out.loss / 4).backward()
        expected = expected + out.loss.detach() / 4
    assert torch.allclose(loss.detach(), expected, rtol=1e-6, atol=0)
    for p in ref.parameters():  # the pipeline ran two steps: compare with twice the eager gradients
        p.grad = p.grad * 2
    assert max_relative_grad_error(pipe, ref) < 1e-4


def test_a_models_own_cross_entropy_names_no_term() -> None:
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32))
    ids = token_batch(4, 8)
    part = fxpipe.partition(model, fxpipe.Plan(split=["transformer.h.1"], **PLAN), example_inputs=(ids,), example_kwargs={"labels": ids})
    assert part.model_losses is not None and part.loss_terms == []


def test_gpt2_with_use_cache_at_its_default_trains_like_eager() -> None:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    assert config.use_cache
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double()
    ref = copy.deepcopy(model)
    ids = token_batch(4, 8)
    pipe = fxpipe.compile(model, fxpipe.Plan(split=["transformer.h.1"], **PLAN), example_inputs=(ids,), example_kwargs={"labels": ids})
    assert pipe.part.notes[0].startswith("use_cache left out: traced with use_cache=False")
    loss = pipe.step(ids, labels=ids)
    eager = ref(ids, labels=ids).loss
    eager.backward()
    assert torch.allclose(loss, eager, rtol=1e-12)
    assert max_relative_grad_error(pipe, ref) < 1e-10



def test_llama_with_use_cache_at_its_default_evaluates_a_new_batch_size_like_eager() -> None:
    """An eval call of another batch size traces again (eval mode, a new signature); the check
    that the trace computes what eager computes calls eager as the trace was made
    (use_cache=False), not with the generation cache an eval call would build."""
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=96, max_position_embeddings=32, bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    assert config.use_cache
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double()
    ref = copy.deepcopy(model).eval()
    ids = token_batch(4, 8)
    mask = torch.ones_like(ids)
    pipe = fxpipe.compile(model, fxpipe.Plan(split=["model.layers.1"], **PLAN), example_inputs=(ids,), example_kwargs={"attention_mask": mask})
    pipe.eval()
    with torch.no_grad():
        out = pipe(ids[:1], attention_mask=mask[:1])
        expected = ref(ids[:1], attention_mask=mask[:1]).logits
    assert torch.allclose(out.logits, expected, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ the fake replay's real runs
class Grouped(nn.Module):
    """torch._grouped_mm in float32: its meta kernel refuses what the CPU kernel runs."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offs = torch.tensor([2, 4, 6], dtype=torch.int32)
        return torch._grouped_mm(x, self.weight, offs=offs).relu()


def test_a_node_whose_fake_kernel_refuses_runs_for_real_and_says_why() -> None:
    gm = fx.symbolic_trace(Grouped())
    fake_run = FakeReplay()
    out = fake_run.run(gm, [torch.randn(6, 8)])
    assert out.shape == (6, 4) and out.requires_grad
    reasons = {n.name: why for n, why in fake_run.real_run_reasons().items()}
    assert list(reasons) == ["_grouped_mm"]
    assert "fake kernel refused" in reasons["_grouped_mm"] and "BFloat16" in reasons["_grouped_mm"]
    assert not fake_run.estimated  # its sizes are facts, not a data-dependent estimate


def test_a_node_the_real_kernel_refuses_too_raises_the_fake_runs_error() -> None:
    gm = fx.symbolic_trace(Grouped())
    with pytest.raises(RuntimeError, match="(?s)BFloat16.*while running node '_grouped_mm'"):
        FakeReplay().run(gm, [torch.randn(6, 12)])  # 12 columns against 8 rows: wrong in eager too


def kept_rows(ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Rows of ``ids`` where ``keep`` holds: a data-dependent size."""
    return ids[keep]


fx.wrap("kept_rows")  # one call_function node, as an opaque callee is


@torch.library.custom_op("fxpipe_test::checked_scale", mutates_args=())
def checked_scale(x: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """Raises unless every ``ok`` holds (a Python check on values); no fake kernel."""
    if not bool(ok.all()):
        raise ValueError("a structure check failed")
    return x * 2


class ReadsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        kept = kept_rows(ids, ids > 5)  # computed from the inputs alone: the example's values
        return kept, checked_scale(h, h == h)  # from parameters: a stand-in True keeps the check


def test_real_runs_take_the_examples_values_and_stand_ins_that_keep_checks() -> None:
    ids = torch.tensor([1, 7, 9, 3, 8, 2])
    gm = fx.symbolic_trace(ReadsValues())
    fake_run = FakeReplay()
    kept, scaled = fake_run.run(gm, [ids, torch.randn(6, 4)])
    assert kept.shape == (3,)  # the example's three ids above 5, not a zeros guess
    assert scaled.shape == (6, 4)
    reasons = {n.name: why for n, why in fake_run.real_run_reasons().items()}
    assert reasons["kept_rows"] == DATA_DEPENDENT
    assert "fake kernel refused" in reasons["checked_scale_default"]  # ran: a stand-in False would have raised


# ------------------------------------------------------------------ batchedness and merging
class Routed(nn.Module):
    """Logits through a data-dependent routing (nonzero), and a table that is not batched."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        rows = (h.sum(-1) > 0).nonzero().squeeze(-1)
        h = h.index_add(0, rows, self.b(h[rows]))
        return h, table * 2


def test_batched_outputs_come_from_the_graph_where_the_model_reads_values() -> None:
    x, table = torch.randn(8, 4), torch.randn(3, 4)
    plan = fxpipe.Plan(split=["b"], **PLAN)
    part = fxpipe.partition(Routed(), plan, example_inputs=(x, table))
    assert graph_batched_outputs(part, (x, table), {}) == {"0": True, "1": False}
    model = Routed()
    pipe = fxpipe.compile(model, fxpipe.Plan(split=["b"], output_merge={"1": "mean"}, **PLAN), example_inputs=(x, table))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "did not run on fake tensors"
        out, _ = pipe(x, table)
    assert torch.allclose(out, model(x, table)[0], atol=1e-6)


def test_a_merge_error_suggests_cat_for_outputs_with_a_batch_dim() -> None:
    rows = [torch.ones(2, 3), torch.ones(2, 3)]
    with pytest.raises(MicrobatchError, match=r"output_merge=\{'': 'cat'\}"):
        merge(rows, [2, 2], {}, {})
    with pytest.raises(MicrobatchError, match=r"output_merge=\{'': 'mean'\}"):
        merge([torch.ones(()), torch.ones(())], [2, 2], {}, {})


def test_forward_at_a_batch_smaller_than_the_microbatch_count_runs_fewer() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    pipe = fxpipe.compile(model, fxpipe.Plan(split=["2"], **PLAN), example_inputs=(torch.randn(8, 4),))
    for rows in (1, 3):
        x = torch.randn(rows, 4)
        assert torch.allclose(pipe(x), model(x), atol=1e-6)
    with pytest.raises(MicrobatchError, match="only 3 samples"):  # a step keeps the plan's count
        pipe.step(torch.randn(3, 4), target=None, loss_fn=lambda out, t: out.sum())


# ------------------------------------------------------------------ under torchrun
STEPS = 3
LR = 1e-3


def padded_case(name: str) -> tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor]:
    """The family's model (the same weights in every process), a batch of 8 whose rows pad
    0 to 3 tokens at their tails (one micro-batch without padding), and a target that
    ignores the padding."""
    model = FAMILIES[name].build()
    ids = token_batch()
    mask = torch.ones_like(ids)
    for row in range(ids.shape[0]):
        mask[row, ids.shape[1] - row % 4 :] = 0
    target = token_batch(seed=1).masked_fill(mask == 0, -100)
    return model, {"input_ids": ids, "attention_mask": mask}, target


def train_and_eval(pipe_or_model, inputs: dict, target: torch.Tensor, step) -> dict:
    """AdamW steps with global clipping, then eval at the batch and at batch 1: what a
    rank and the eager model both report."""
    opt = torch.optim.AdamW(pipe_or_model.parameters(), lr=LR)
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(step(inputs, target).detach().clone())
        norms.append(pipe_or_model.clip_grad_norm_(1.0) if hasattr(pipe_or_model, "clip_grad_norm_")
                     else torch.nn.utils.clip_grad_norm_(pipe_or_model.parameters(), 1.0))
        opt.step()
        opt.zero_grad()
    pipe_or_model.eval()
    with torch.no_grad():
        outs = [pipe_or_model(**{k: v[:rows] for k, v in inputs.items()}) for rows in (8, 1)]
    logits = [None if out is None else out.logits.clone() for out in outs]
    params = {n: p.detach().clone() for n, p in pipe_or_model.named_parameters()}
    return {"losses": losses, "norms": [n.detach().clone() for n in norms], "logits": logits, "params": params}


def moe_rank(name: str) -> dict:
    """One rank: compile with transformers' defaults, train, clip and evaluate."""
    model, inputs, target = padded_case(name)
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=[FAMILIES[name].split], microbatches=4, schedule="1f1b")
    with fxpipe.compile(model, plan, example_kwargs=inputs, loss_fn=masked_loss) as pipe:
        return train_and_eval(pipe, inputs, target, lambda x, t: pipe.step(**x, target=t))


def masked_loss(out, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten(), ignore_index=-100)


@pytest.mark.parametrize("name", [pytest.param("mixtral"), *(pytest.param(n, marks=pytest.mark.slow) for n in FAMILIES if n != "mixtral")])
@pytest.mark.timeout(400)
def test_moe_family_under_torchrun_trains_with_adamw_and_clipping_like_eager(name: str) -> None:
    from fxpipe.distributed import launch

    ranks = launch(moe_rank, 2, (name,), timeout=300)
    model, inputs, target = padded_case(name)

    def eager_step(x: dict, t: torch.Tensor) -> torch.Tensor:
        loss = masked_loss(model(**x), t)
        loss.backward()
        return loss

    ref = train_and_eval(model, inputs, target, eager_step)
    # float32: the first step's loss and norm are eager's to rounding; AdamW then turns the
    # rounding of near-zero gradient entries (summed per micro-batch) into updates of up to
    # +-lr, so parameters after the steps agree to a tenth of the learning rate
    for rank in ranks:
        for got, expected in zip(rank["losses"] + rank["norms"], ref["losses"] + ref["norms"]):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        for param, value in rank["params"].items():
            torch.testing.assert_close(value, ref["params"][param], rtol=0, atol=LR / 10, msg=lambda m, p=param: f"{p}: {m}")
    assert set(ranks[0]["params"]) | set(ranks[1]["params"]) == set(ref["params"])
    for got, expected in zip(ranks[1]["logits"], ref["logits"]):  # the last stage's rank
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert ranks[0]["logits"] == [None, None]


# ------------------------------------------------------------------ peers' regressions
class Singleton(nn.Module):
    """torchgpipe's test_input_singleton: a 1-tuple in, a 1-tuple out."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 1)

    def forward(self, only_a: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
        (a,) = only_a
        return (self.fc(a),)


def test_a_one_tuple_input_is_its_tensor_not_the_tuple() -> None:
    model = nn.Sequential(Singleton(), Singleton())
    a = torch.rand(4, 1, requires_grad=True)
    pipe = fxpipe.compile(model, fxpipe.Plan(split=["1"], devices=["cpu", "cpu"], microbatches=2), example_inputs=((a,),))
    (out,) = pipe((a,))
    assert torch.allclose(out, model((a,))[0])
    pipe.step((a,), target=None, loss_fn=lambda o, t: o[0].mean())
    pipe_grad = a.grad.clone()
    a.grad = None
    model((a,))[0].mean().backward()
    assert torch.allclose(pipe_grad, a.grad)


def test_pipe_call_merges_the_models_own_loss_by_its_token_counts() -> None:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double()
    ids = token_batch(8, 10)
    mask = torch.ones_like(ids)
    for row in range(8):
        mask[row, 10 - row % 4 :] = 0  # micro-batches count different numbers of tokens
    labels = ids.masked_fill(mask == 0, -100)
    call = dict(attention_mask=mask, labels=labels)
    pipe = fxpipe.compile(model, fxpipe.Plan(split=["transformer.h.1"], **PLAN), example_inputs=(ids,), example_kwargs=call)
    out, eager = pipe(ids, **call), model(ids, **call)
    assert torch.allclose(out.loss, eager.loss, rtol=1e-6, atol=0)
    by_samples = torch.stack([model(i, attention_mask=m, labels=t).loss for i, m, t in zip(ids.split(2), mask.split(2), labels.split(2))]).mean()
    assert not torch.allclose(by_samples, eager.loss, rtol=1e-4, atol=0)  # the shares of samples would be off


def mask_or_none(mask: torch.Tensor) -> torch.Tensor | None:
    """An additive mask, or None when nothing is masked (as HF's eager_mask decides)."""
    if bool(mask.all()):
        return None
    return (1.0 - mask.float()) * -1e4


class MaskedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        bias = mask_or_none(mask)
        return self.b(self.a(x) + bias)


def test_an_opaque_callee_returning_none_where_the_trace_saw_a_tensor_is_named() -> None:
    x, mask = torch.randn(4, 4), torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
    pipe = fxpipe.compile(MaskedHead(), fxpipe.Plan(split=["b"], **{**PLAN, "microbatches": 2}), example_inputs=(x, mask))
    assert [c.name for c in pipe.part.opaque] == ["test_moe_families.mask_or_none"]
    with pytest.raises(fxpipe.PipelineError, match=r"mask_or_none returned None but the trace assumed a tensor.*attn_implementation='sdpa'"):
        pipe(x, mask)  # micro-batch 1 masks nothing


class Wrap(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def test_a_module_shared_by_two_children_on_different_stages_belongs_to_each_caller() -> None:
    shared = nn.Linear(4, 4)
    model = nn.Sequential(Wrap(shared), nn.Tanh(), Wrap(shared))
    x, t = torch.randn(8, 4), torch.randn(8, 4)
    pipe = fxpipe.compile(model, fxpipe.Plan(split=["2"], devices=["cpu:0", "cpu:1"], microbatches=2), example_inputs=(x,))
    assert [[n.target for n in s.module.graph.nodes if n.op == "call_module"] for s in pipe.stages] == [["0.module", "1"], ["2.module"]]
    x3 = torch.randn(8, 2, 4)  # another signature, traced again and cut alike
    assert torch.allclose(pipe(x3), model(x3), atol=1e-6)
    pipe.step(x, target=t, loss_fn=nn.functional.mse_loss)
    nn.functional.mse_loss(model(x), t).backward()
    assert [k for k, _ in pipe.named_parameters()] == ["0.module.weight", "0.module.bias"]
    for k, p in pipe.named_parameters():  # both uses' gradients, summed as eager sums them
        assert torch.allclose(p.grad, dict(model.named_parameters())[k].grad, atol=1e-6)
