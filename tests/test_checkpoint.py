"""fxpipe.save_checkpoint / load_checkpoint: a resumed run equals an uninterrupted one in any
layout, a save killed at any point leaves the previous checkpoint loadable, and a damaged
file is named."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.distributed import launch

CE = nn.CrossEntropyLoss()
ROOT = Path(__file__).resolve().parent.parent


class TiedLM(nn.Module):
    """An embedding whose weight is also the output head's (the two uses on different stages)."""

    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mid = nn.Linear(width, width)
        self.mid2 = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid2(torch.tanh(self.mid(self.emb(idx))))).mean(1))


def batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randint(0, 11, (6, 5), generator=g), torch.randint(0, 11, (6,), generator=g)) for _ in range(n)]


def trainer(model: nn.Module, plan: fxpipe.Plan):
    """A pipeline with AdamW on the model's parameters and a warm-up schedule."""
    pipe = fxpipe.compile(model, plan, example_inputs=(batches(1)[0][0],), loss_fn=CE)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))
    return pipe, opt, sched


def train(pipe, opt, sched, steps: list) -> list[float]:
    losses = []
    for x, t in steps:
        losses.append(float(pipe.step(x, target=t)))
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses


TWO = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["mid2"], schedule="1f1b", microbatches=3)
LAYOUTS = {
    "3 stages": fxpipe.Plan(devices=["cpu:0", "cpu:1", "cpu:2"], split=["mid", "mid2"], schedule="gpipe", microbatches=2),
    "1 stage": fxpipe.Plan(devices=["cpu"], microbatches=1),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_resume_in_another_layout_equals_the_uninterrupted_run(tmp_path, float64, layout: str) -> None:
    data = batches()
    torch.manual_seed(0)
    pipe, opt, sched = trainer(TiedLM(), TWO)
    train(pipe, opt, sched, data[:2])
    fxpipe.save_checkpoint(tmp_path / "ckpt", pipe, opt, sched, extra={"step": 2})
    expected = train(pipe, opt, sched, data[2:])
    lr = opt.param_groups[0]["lr"]

    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    pipe, opt, sched = trainer(TiedLM(), LAYOUTS[layout])
    assert fxpipe.load_checkpoint(tmp_path / "ckpt", pipe, opt, sched) == {"step": 2}
    assert train(pipe, opt, sched, data[2:]) == pytest.approx(expected, rel=1e-12, abs=0)
    assert opt.param_groups[0]["lr"] == lr and sched.last_epoch == 4


def test_a_flipped_or_truncated_byte_is_named(tmp_path) -> None:
    torch.manual_seed(0)
    pipe, opt, sched = trainer(TiedLM(), TWO)
    train(pipe, opt, sched, batches(1))
    path = tmp_path / "ckpt"
    fxpipe.save_checkpoint(path, pipe, opt, sched)
    data = next(f for f in path.iterdir() if f.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(fxpipe.CheckpointError, match=f"{data.name} is altered"):
        fxpipe.load_checkpoint(path, pipe, opt, sched)
    data.write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(fxpipe.CheckpointError, match=f"{data.name} is truncated"):
        fxpipe.load_checkpoint(path, pipe)
    (path / ".metadata").unlink()
    with pytest.raises(fxpipe.CheckpointError, match=r"\.metadata is missing"):
        fxpipe.load_checkpoint(path, pipe)
    with pytest.raises(fxpipe.CheckpointError, match="no checkpoint at"):
        fxpipe.load_checkpoint(tmp_path / "nothing", pipe)


def test_loading_the_optimizer_from_a_checkpoint_saved_without_one_is_refused(tmp_path) -> None:
    pipe, opt, sched = trainer(TiedLM(), TWO)
    fxpipe.save_checkpoint(tmp_path / "ckpt", pipe)
    with pytest.raises(fxpipe.CheckpointError, match="no optimizer state for emb.weight"):
        fxpipe.load_checkpoint(tmp_path / "ckpt", pipe, opt)
    with pytest.raises(fxpipe.CheckpointError, match="no scheduler state"):
        fxpipe.load_checkpoint(tmp_path / "ckpt", pipe, scheduler=sched)


SAVER = """
import os, sys, torch
sys.path.insert(0, {tests!r})
from test_checkpoint import TiedLM, TWO, batches, trainer, train
import fxpipe
torch.manual_seed(0)
pipe, opt, sched = trainer(TiedLM(), TWO)
train(pipe, opt, sched, batches(1))
fxpipe.save_checkpoint({path!r}, pipe, opt, sched, extra={{"step": 1}})
torch.save(pipe.state_dict(), {expected!r})
train(pipe, opt, sched, batches(2)[1:])
os.environ["FXPIPE_CHECKPOINT_PAUSE"] = {pause!r}
fxpipe.save_checkpoint({path!r}, pipe, opt, sched, extra={{"step": 2}})
"""


def _written(staging: Path, stage: str) -> bool:
    if not staging.is_dir():
        return False
    names = {f.name for f in staging.iterdir()}
    if stage == "write":
        return any(n.endswith(".distcp") for n in names)
    return "fxpipe-manifest.json" in names


@pytest.mark.parametrize("stage", ["write", "swap"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path, stage: str) -> None:
    path, expected = tmp_path / "ckpt", tmp_path / "expected.pt"
    script = SAVER.format(tests=str(ROOT / "tests"), path=str(path), expected=str(expected), pause=f"{stage}:120")
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, stderr=subprocess.PIPE)
    staging = tmp_path / "ckpt.saving"
    deadline = time.monotonic() + 120
    while not (expected.exists() and _written(staging, stage)):  # the second save is paused inside
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the second save never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL

    torch.manual_seed(1)
    pipe, opt, sched = trainer(TiedLM(), TWO)
    assert fxpipe.load_checkpoint(path, pipe, opt, sched) == {"step": 1}
    for key, value in torch.load(expected).items():
        torch.testing.assert_close(pipe.state_dict()[key], value, rtol=0, atol=0, msg=key)
    fxpipe.save_checkpoint(path, pipe, opt, sched, extra={"step": 3})  # the killed save's leftovers are cleared
    assert fxpipe.load_checkpoint(path, pipe) == {"step": 3}
    assert not staging.exists()


def two_rank_save(path: str) -> list[float]:
    """Train a 2-stage TiedLM on 2 ranks for 2 steps, save, and train 2 more."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    plan = fxpipe.Plan(devices=["cpu", "cpu"], split=["mid2"], schedule="1f1b", microbatches=3)
    pipe, opt, sched = trainer(TiedLM(), plan)
    data = batches()
    train(pipe, opt, sched, data[:2])
    fxpipe.save_checkpoint(path, pipe, opt, sched, extra={"step": 2})
    return train(pipe, opt, sched, data[2:])


def test_a_two_rank_save_resumes_in_one_process(tmp_path, float64) -> None:
    path = str(tmp_path / "ckpt")
    first, second = launch(two_rank_save, 2, (path,), timeout=120)
    assert first == second
    torch.manual_seed(1)
    pipe, opt, sched = trainer(TiedLM(), LAYOUTS["3 stages"])
    assert fxpipe.load_checkpoint(path, pipe, opt, sched) == {"step": 2}
    assert train(pipe, opt, sched, batches()[2:]) == pytest.approx(first, rel=1e-12, abs=0)


SHARDED = dict(devices=["cpu"], microbatches=3, data_parallel=2, fsdp=True)


def sharded_trainer(seed: int):
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(seed)
    pipe = fxpipe.compile(TiedLM(), fxpipe.Plan(**SHARDED), example_inputs=(batches(1)[0][0],), loss_fn=CE)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.05, weight_decay=0.1)  # the shards (DTensors)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))
    return pipe, opt, sched


def sharded_save(path: str) -> list[float]:
    """2 replicas sharding one stage (FSDP): 2 steps, save, 2 more."""
    pipe, opt, sched = sharded_trainer(0)
    data = batches()
    train(pipe, opt, sched, data[:2])
    fxpipe.save_checkpoint(path, pipe, opt, sched)
    return train(pipe, opt, sched, data[2:])


def sharded_resume(path: str) -> list[float]:
    pipe, opt, sched = sharded_trainer(1)
    fxpipe.load_checkpoint(path, pipe, opt, sched)
    return train(pipe, opt, sched, batches()[2:])


def test_a_sharded_save_resumes_sharded_and_in_one_process(tmp_path, float64) -> None:
    path = str(tmp_path / "ckpt")
    first, _ = launch(sharded_save, 2, (path,), timeout=120)
    for resumed in launch(sharded_resume, 2, (path,), timeout=120):
        assert resumed == pytest.approx(first, rel=1e-12, abs=0)
    torch.manual_seed(1)
    pipe, opt, sched = trainer(TiedLM(), TWO)
    fxpipe.load_checkpoint(path, pipe, opt, sched)
    assert train(pipe, opt, sched, batches()[2:]) == pytest.approx(first, rel=1e-12, abs=0)


def test_without_an_atomic_exchange_two_renames_keep_the_previous_checkpoint_reachable(tmp_path, monkeypatch) -> None:
    import fxpipe.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "_exchange", lambda a, b: False)  # a file system without RENAME_EXCHANGE
    pipe, opt, sched = trainer(TiedLM(), TWO)
    path = tmp_path / "ckpt"
    fxpipe.save_checkpoint(path, pipe, extra={"step": 1})
    fxpipe.save_checkpoint(path, pipe, extra={"step": 2})
    assert fxpipe.load_checkpoint(path, pipe) == {"step": 2} and not (tmp_path / "ckpt.old").exists()
    path.rename(tmp_path / "ckpt.old")  # a save killed between its two renames
    assert fxpipe.load_checkpoint(path, pipe) == {"step": 2}
    fxpipe.save_checkpoint(path, pipe, extra={"step": 3})
    assert fxpipe.load_checkpoint(path, pipe) == {"step": 3} and not (tmp_path / "ckpt.old").exists()


def test_keep_holds_the_newest_checkpoints_each_loadable_and_refuses_a_bad_count(tmp_path) -> None:
    pipe, opt, sched = trainer(TiedLM(), TWO)
    path = tmp_path / "ckpt"
    for step in range(1, 5):
        fxpipe.save_checkpoint(path, pipe, optimizer=opt, extra={"step": step}, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.1", "ckpt.2"]
    assert [fxpipe.load_checkpoint(tmp_path / name, pipe, optimizer=opt) for name in ("ckpt", "ckpt.1", "ckpt.2")] == [
        {"step": 4}, {"step": 3}, {"step": 2}
    ]
    fxpipe.save_checkpoint(path, pipe, extra={"step": 5})  # keep=1: the replaced one is deleted, older ones stay
    assert fxpipe.load_checkpoint(path, pipe) == {"step": 5} and fxpipe.load_checkpoint(tmp_path / "ckpt.1", pipe) == {"step": 3}
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="an integer >= 1"):
            fxpipe.save_checkpoint(path, pipe, keep=bad)
