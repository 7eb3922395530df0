"""Micro-batch outputs are merged by what they are, decided at compile time: batched outputs
are concatenated, every other tensor output as ``Plan(output_merge=...)`` says."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.batching.batched_outputs import batched_outputs
from fxpipe.batching.microbatch import (
    LossFunctionError,
    MicrobatchError,
    check_output_merge,
    merge,
    split,
    split_step,
    weighted_loss,
)


class LogitsAndAux(nn.Module):
    """A classifier returning (logits, a mean-reduced auxiliary loss), like a MoE router."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 4)
        self.norm = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.norm(self.body(x))
        return self.drop(logits), logits.pow(2).mean()


class Report(nn.Module):
    """A dict output: batched logits, a 0-d mean and a 0-d sum, per-channel statistics,
    rows of (batch × 2) flattened, and a constant table whose rows equal the example batch."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.body = nn.Linear(6, 3)
        self.register_buffer("table", torch.arange(batch * 2.0).reshape(batch, 2))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.body(x)
        return {
            "logits": h,
            "aux": h.pow(2).mean(),
            "total": h.abs().sum(),
            "stats": h.mean(0),
            "pairs": h[:, :2].reshape(-1, 1).expand(-1, 2).reshape(-1, 2),
            "table": self.table * 1,
        }


def eager_pieces(model: nn.Module, x: torch.Tensor, m: int) -> tuple[list, list[int]]:
    pieces, sizes = split((x,), m)
    with torch.no_grad():
        return [model(*p) for p in pieces], sizes


X = torch.randn(10, 6, dtype=torch.float64)


def test_batched_outputs_tell_the_batch_from_everything_else() -> None:
    assert batched_outputs(LogitsAndAux(), (X.float(),)) == {"0": True, "1": False}
    found = batched_outputs(Report(10).double(), (X,))
    assert found == {"logits": True, "aux": False, "total": False, "stats": False, "pairs": True, "table": False}


def test_batched_outputs_compute_nothing_and_leave_the_model_and_generator_alone() -> None:
    model = LogitsAndAux().train()
    before = copy.deepcopy(model.state_dict())
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    batched_outputs(model, (X.float(),))
    assert torch.equal(torch.rand(4), expected)  # dropout ran on fake tensors: no draw
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key  # BatchNorm statistics untouched
    with torch.device("meta"):
        big = LogitsAndAux()
    assert batched_outputs(big, (X.float(),)) == {"0": True, "1": False}


def test_a_forward_that_cannot_run_on_fake_tensors_warns_and_asks_for_output_merge() -> None:
    class DataDependent(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[x > 0]  # output size depends on the values

    with pytest.warns(UserWarning, match="did not run on fake tensors"):
        assert batched_outputs(DataDependent(), (X,)) == {}
    outputs = [torch.ones(3), torch.ones(2)]
    with pytest.raises(MicrobatchError, match="the output .*not known at compile time.*output_merge=\\{'': 'mean'\\}"):
        merge(outputs, [5, 5], {}, {})
    assert merge(outputs, [5, 5], {}, {"": "cat"}).shape == (5,)


def test_an_unbatched_output_without_output_merge_is_an_error_naming_its_path() -> None:
    model = LogitsAndAux().double().eval()
    outputs, sizes = eager_pieces(model, X, 4)
    with pytest.raises(MicrobatchError, match=r"output '1' is a tensor of shape \(\).*Plan\(output_merge=\{'1': 'mean'\}\)"):
        merge(outputs, sizes, batched_outputs(model, (X,)), {})
    report = Report(10).double()
    outputs, sizes = eager_pieces(report, X, 4)
    with pytest.raises(MicrobatchError, match="output 'aux'"):
        merge(outputs, sizes, batched_outputs(report, (X,)), {"stats": "mean", "table": "mean", "total": "sum"})


def test_mean_of_a_mean_reduced_loss_over_uneven_microbatches_is_the_full_batch_value() -> None:
    model = LogitsAndAux().double().eval()
    outputs, sizes = eager_pieces(model, X, 4)
    assert sizes == [3, 3, 2, 2]
    logits, aux = merge(outputs, sizes, batched_outputs(model, (X,)), {"1": "mean"})
    with torch.no_grad():
        full_logits, full_aux = model(X)
    torch.testing.assert_close(logits, full_logits, rtol=1e-14, atol=1e-15)  # BLAS blocks by batch size
    torch.testing.assert_close(aux, full_aux, rtol=1e-14, atol=0)
    assert aux.dim() == 0


def test_every_merge_mode_equals_eager() -> None:
    report = Report(10).double()
    outputs, sizes = eager_pieces(report, X, 4)
    batched = batched_outputs(report, (X,))
    with torch.no_grad():
        full = report(X)
    merged = merge(outputs, sizes, batched, {"aux": "mean", "total": "sum", "stats": "mean", "table": "mean"})
    for key in ("logits", "pairs", "aux", "total", "stats", "table"):
        torch.testing.assert_close(merged[key], full[key], rtol=1e-13, atol=0, msg=key)
    per_microbatch = merge(outputs, sizes, batched, {"aux": "stack", "total": "stack", "stats": "cat", "table": "stack"})
    torch.testing.assert_close(per_microbatch["aux"], torch.stack([o["aux"] for o in outputs]))
    torch.testing.assert_close(per_microbatch["stats"], torch.cat([o["stats"] for o in outputs]))
    assert per_microbatch["table"].shape == (4, 10, 2)


def test_one_microbatch_needs_no_output_merge_and_non_tensors_keep_their_rule() -> None:
    model = LogitsAndAux().double().eval()
    outputs, sizes = eager_pieces(model, X, 1)
    assert merge(outputs, sizes, batched_outputs(model, (X,)), {}) is outputs[0]
    mixed = [(torch.ones(2, 1), "same", 1), (torch.ones(3, 1), "same", 2)]
    assert merge(mixed, [2, 3], {"0": True}, {})[1:] == ("same", [1, 2])
    with pytest.raises(MicrobatchError, match=r"output_merge\['1'\] = 'sum', but output '1' is a str"):
        merge(mixed, [2, 3], {"0": True}, {"1": "sum"})


def test_output_merge_is_checked_in_the_plan_and_against_the_outputs() -> None:
    with pytest.raises(fxpipe.PlanError, match=r"plan\.output_merge\['1'\] = 'median'"):
        fxpipe.Plan(output_merge={"1": "median"})
    assert fxpipe.Plan.coerce({"output_merge": {"aux": "mean"}}).output_merge == {"aux": "mean"}
    with pytest.raises(MicrobatchError, match=r"names \['2'\].*'0', '1'"):
        check_output_merge({"2": "mean"}, {"0": True, "1": False})


def test_step_inputs_and_targets_are_cut_together() -> None:
    x, t = torch.randn(10, 2), torch.arange(10)
    inputs, targets, sizes = split_step([x], (t, torch.tensor(1.0)), 4)
    assert sizes == [3, 3, 2, 2]
    assert [tg[0].tolist() for tg in targets] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert all(tg[1].item() == 1.0 for tg in targets)  # a 0-d target goes to every micro-batch
    with pytest.raises(MicrobatchError, match=r"target\[1\]\['w'\] has 3 samples \(shape \(3, 2\)\) but the inputs have 10"):
        split_step([x], (t, {"w": torch.ones(3, 2)}), 2)


def test_a_loss_given_a_tuple_says_which_part_to_pass() -> None:
    out = (torch.randn(4, 3), torch.tensor(0.5))
    loss_of = weighted_loss(nn.CrossEntropyLoss(), lambda i, o: o, [torch.zeros(4, dtype=torch.long)], [1.0])
    with pytest.raises(LossFunctionError, match=r"CrossEntropyLoss.*tuple \(Tensor\[4, 3\], Tensor\[\]\).*ce = CrossEntropyLoss\(\); loss_fn=lambda out, t: ce\(out\[0\], t\)"):
        loss_of(0, out)
    loss_of = weighted_loss(torch.nn.functional.mse_loss, lambda i, o: o, [torch.zeros(4, 3)], [1.0])
    with pytest.raises(LossFunctionError, match=r"dict \{'aux': Tensor\[\], 'logits': Tensor\[4, 3\]\}.*mse_loss\(out\['logits'\], t\)"):
        loss_of(0, {"aux": out[1], "logits": out[0]})
