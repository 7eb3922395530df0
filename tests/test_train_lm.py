"""examples/train_lm.py: a GPT-2 trained on the standard library's source with fxpipe
follows eager PyTorch, and a resumed run repeats the uninterrupted one.

The quick test runs the example in-process at ``--smoke`` sizes (a 2-layer GPT-2 of width
32, sequences of 32 bytes); the slow one launches it under torchrun with 2 ranks.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SMOKE = ["--smoke", "--steps", "8", "--warmup", "2", "--lr", "3e-3", "--eval-every", "4", "--print-every", "4"]


@pytest.fixture(scope="module")
def train_lm():
    # the example sets one intra-op thread per process; later tests get back what they had
    threads = torch.get_num_threads()
    sys.path.insert(0, str(EXAMPLES))
    yield importlib.import_module("train_lm")
    sys.path.remove(str(EXAMPLES))
    torch.set_num_threads(threads)


def numbers(history: dict) -> tuple[list, list]:
    """What a run computed, without its timings."""
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in history["steps"]], history["eval"]


def test_file_sequences_pad_the_end_of_a_file_and_ignore_its_targets(train_lm):
    rows = train_lm.file_sequences(b"abcdefgh", 4)  # 8 bytes: targets b..h, 7 of them
    assert rows.tolist() == [[97, 98, 99, 100, 101], [101, 102, 103, 104, train_lm.PAD]]
    x, t = train_lm.inputs_and_targets(rows)
    assert x.tolist() == [[97, 98, 99, 100], [101, 102, 103, 104]]
    assert t.tolist() == [[98, 99, 100, 101], [102, 103, 104, train_lm.IGNORE]]


def test_stdlib_corpus_is_deterministic_and_holds_files_out(train_lm):
    corpus = train_lm.Corpus.load(32)
    assert corpus.files > 50 and len(corpus.held_out) > 0
    x, t = corpus.training_batch(3, 4, seed=0)
    again = train_lm.Corpus.load(32).training_batch(3, 4, seed=0)
    assert torch.equal(x, again[0]) and torch.equal(t, again[1])
    assert x.shape == t.shape == (4, 32) and int(x.max()) <= train_lm.PAD


def test_train_lm_loss_falls_as_in_eager_and_resume_repeats_the_losses(train_lm, tmp_path):
    plot = tmp_path / "compare.png"
    whole = train_lm.main(SMOKE + ["--compare-eager", "--plot", str(plot)])
    losses = [r["loss"] for r in whole["fxpipe"]["steps"]]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.2
    assert [e["step"] for e in whole["fxpipe"]["eval"]] == [3, 7]
    assert whole["largest_relative_difference"] < 1e-4
    assert plot.stat().st_size > 0

    checkpoints = ["--checkpoint-every", "4", "--ckpt-dir", str(tmp_path / "ckpt")]
    interrupted = train_lm.main(SMOKE + checkpoints + ["--stop-after", "4"])
    assert len(interrupted["fxpipe"]["steps"]) == 4
    assert (tmp_path / "ckpt" / "checkpoint" / "fxpipe-manifest.json").exists()
    resumed = train_lm.main(SMOKE + checkpoints + ["--resume", "--schedule", "gpipe"])  # another layout
    assert numbers(resumed["fxpipe"]) == numbers(whole["fxpipe"])


def test_resume_refuses_a_checkpoint_trained_with_another_learning_rate(train_lm, tmp_path):
    checkpoints = ["--checkpoint-every", "2", "--ckpt-dir", str(tmp_path), "--eval-every", "0"]
    train_lm.main(["--smoke", "--steps", "2", *checkpoints])
    with pytest.raises(SystemExit, match="--lr 0.001 .now 0.002."):
        train_lm.main(["--smoke", "--steps", "2", "--lr", "2e-3", "--resume", *checkpoints])


@pytest.mark.slow
def test_train_lm_under_torchrun_matches_eager_and_resumes(tmp_path):
    def torchrun(*options: str) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             str(EXAMPLES / "train_lm.py"), *SMOKE, "--checkpoint-every", "4", "--ckpt-dir", str(tmp_path), *options],
            capture_output=True, text=True, timeout=300, cwd=EXAMPLES.parent,
        )
        assert done.returncode == 0, done.stdout + done.stderr

    torchrun("--loss-log", str(tmp_path / "whole.json"))
    torchrun("--stop-after", "4")
    torchrun("--resume", "--loss-log", str(tmp_path / "resumed.json"))
    whole, resumed = (json.loads((tmp_path / name).read_text()) for name in ("whole.json", "resumed.json"))
    assert numbers(resumed) == numbers(whole)
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_lm.py"), "--compare-eager", str(tmp_path / "whole.json")],
        capture_output=True, text=True, timeout=300, cwd=EXAMPLES.parent,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "largest relative difference of the loss" in done.stdout
