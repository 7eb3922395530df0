"""The fxpipe command: inspect and train end to end, model specs, inputs, plans, errors."""

import argparse
import copy
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib.image
import pytest
import torch
from test_dot import SkipNet

from fxpipe import cli, cli_model

SMALL_RESNET = ["torchvision:resnet18", "--model-arg", "num_classes=10", "--input", "4x3x32x32"]


def _fxpipe(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("fxpipe")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "fxpipe.cli"]
    return subprocess.run([*command, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def test_inspect_prints_the_summary_and_writes_drawing_timeline_and_trace(tmp_path):
    done = _fxpipe("inspect", *SMALL_RESNET, "--stages", "2", "--split", "layer3", "--format", "png", "--out", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "2 stage(s), schedule 1f1b, 4 micro-batch(es)" in done.stdout
    assert "conv1, bn1, relu, maxpool, layer1, layer2\n" in done.stdout and "layer3, layer4, avgpool, fc\n" in done.stdout
    assert "bubble" in done.stdout
    out = tmp_path / "out"
    assert matplotlib.image.imread(out / "partition.png").shape[0] > 100
    assert matplotlib.image.imread(out / "timeline-predicted.png").shape[1] > 100
    trace = json.loads((out / "trace-predicted.json").read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in trace) == 2 * 2 * 4  # two stages, forward and backward, four micro-batches


def test_train_runs_steps_with_a_progress_bar_and_writes_the_measured_timeline(tmp_path):
    done = _fxpipe(
        "train", *SMALL_RESNET, "--stages", "2", "--split", "layer3", "--schedule", "gpipe",
        "--microbatches", "2", "--steps", "2", "--out", str(tmp_path), cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "2/2" in done.stderr and "loss=" in done.stderr
    assert "measured timeline: 2 workers" in done.stdout
    trace = json.loads((tmp_path / "trace-measured.json").read_text())["traceEvents"]
    compute = [e for e in trace if e["name"].startswith(("F", "B"))]
    assert len(compute) == 2 * 2 * 2  # two stages, forward and backward, two micro-batches
    assert len(trace) >= len(compute)  # plus the spans where a worker waited (recv)
    assert matplotlib.image.imread(tmp_path / "timeline.png").shape[0] > 100


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "inspect" in capsys.readouterr().out
    for command, options in (
        ("inspect", ["--stages", "--devices", "--split", "--schedule", "--microbatches", "--input", "--level", "--format", "--out"]),
        ("train", ["--stages", "--devices", "--split", "--schedule", "--microbatches", "--input", "--steps", "--lr", "--loss"]),
    ):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = capsys.readouterr().out
        assert all(option in text for option in options)
        assert "torchvision:NAME" in text and "examples:" in text


def test_bad_model_spec_exits_2_with_a_one_line_message(capsys):
    assert cli.main(["inspect", "no_such_package_xyz:build"]) == 2
    assert "cannot import 'no_such_package_xyz'" in capsys.readouterr().err
    assert cli.main(["inspect", "torchvision:not_a_model"]) == 2
    assert "torchvision.models.list_models()" in capsys.readouterr().err


def test_load_model_from_a_module_factory_a_class_and_a_file(tmp_path):
    model = cli_model.load_model("torchvision.models:resnet18", {"num_classes": 3})
    assert model.fc.out_features == 3
    assert isinstance(cli_model.load_model("test_dot:SkipNet"), SkipNet)
    path = tmp_path / "mynet.py"
    path.write_text("from torch import nn\n\ndef build_model(width=4):\n    return nn.Linear(width, 2)\n")
    assert cli_model.load_model(str(path), {"width": 5}).in_features == 5
    assert cli_model.load_model(f"{path}:build_model").in_features == 4
    with pytest.raises(cli_model.CommandError, match="defines none of nope"):
        cli_model.load_model(f"{path}:nope")
    with pytest.raises(cli_model.CommandError, match="no file"):
        cli_model.load_model(str(tmp_path / "missing.py"))


def test_inputs_and_model_args_parse():
    x, ids = cli_model.example_inputs(["2x3x8x8", "2x5:int64"])
    assert x.shape == (2, 3, 8, 8) and x.dtype == torch.float32
    assert ids.dtype == torch.int64 and set(ids.unique().tolist()) <= {0, 1}
    with pytest.raises(cli_model.CommandError, match="joined by x"):
        cli_model.example_inputs(["2by3"])
    with pytest.raises(cli_model.CommandError, match="torch dtype"):
        cli_model.example_inputs(["2x3:float99"])
    assert cli_model.parse_model_args(["num_classes=10", "name=tiny", "flags=(1, 2)"]) == {
        "num_classes": 10, "name": "tiny", "flags": (1, 2),
    }


def _plan_args(**overrides) -> argparse.Namespace:
    args = {"stages": None, "devices": None, "split": None, "schedule": "1f1b", "microbatches": 4,
            "chunks": 1, "checkpoint": False, "frontend": "auto"}
    return argparse.Namespace(**{**args, **overrides})


def test_plan_from_args_places_stages_on_logical_cpus_and_defaults_the_split():
    plan = cli.plan_from_args(_plan_args(stages=3))
    assert plan.devices == ["cpu:0", "cpu:1", "cpu:2"] and plan.split == "auto"
    plan = cli.plan_from_args(_plan_args(devices="cpu,cuda:0", split="layer2, layer3"))
    assert plan.devices == ["cpu", "cuda:0"] and plan.split == ["layer2", "layer3"]
    plan = cli.plan_from_args(_plan_args(stages=4, chunks=2, schedule="interleaved-1f1b"))
    assert plan.devices == ["cpu:0", "cpu:1"]
    assert cli.plan_from_args(_plan_args()).split == "tags"
    with pytest.raises(cli_model.CommandError, match="needs 2"):
        cli.plan_from_args(_plan_args(stages=2, devices="cpu:0,cpu:1,cpu:2"))


def test_targets_fit_the_loss_and_the_output_shape():
    generator = torch.Generator().manual_seed(0)
    labels = cli_model.make_target("cross-entropy", torch.empty(6, 10), generator)
    assert labels.shape == (6,) and labels.max() < 10
    assert cli_model.make_target("mse", torch.empty(6, 4), generator).shape == (6, 4)
    assert cli_model.make_target("output", None, generator) is None
    with pytest.raises(cli_model.CommandError, match="returns one tensor") as info:
        cli_model.make_target("mse", (torch.empty(1),), generator)
    assert any("--loss output" in hint for hint in info.value.hints)


# ------------------------------------------------------------------ user mistakes
TINY_LM = '''\
import torch
from torch import nn


class TinyLM(nn.Module):
    """Token ids in, logits of shape (batch, length, vocabulary) out."""

    def __init__(self, vocab=50, width=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def build_model(vocab=50):
    return TinyLM(vocab)
'''


@pytest.fixture
def model_folder(tmp_path, monkeypatch) -> Path:
    """A folder holding net.py, whose model comes from the file beside it (its_blocks.py),
    and tiny_lm.py; the current folder while the test runs."""
    (tmp_path / "its_blocks.py").write_text(
        "from torch import nn\n\ndef mlp(width):\n"
        "    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 3))\n"
    )
    (tmp_path / "net.py").write_text("from its_blocks import mlp\n\ndef build_model(width=10):\n    return mlp(width)\n")
    (tmp_path / "tiny_lm.py").write_text(TINY_LM)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the model files' folder leaves with the test
    return tmp_path


MISTAKES = [
    (["inspect", "net.py", "--stages", "2"], "no --input: say what MODEL's forward(input) takes"),
    (["inspect", "net.py", "--input", "8by10"], "--input '8by10': write dimensions joined by x"),
    (["inspect", "net.py", "--input", "8x10", "--input", "8x3"], "2 --input given, but MODEL's forward(input) takes 1"),
    (["inspect", "net.py", "--stages", "2", "--input", "8x3x32x32"], "MODEL 'net.py' does not run on --input 8x3x32x32: RuntimeError: mat1 and mat2"),
    (["inspect", "missing.py", "--input", "8x10"], "MODEL 'missing.py': no file missing.py"),
    (["inspect", "net.py:nope", "--input", "8x10"], "MODEL 'net.py:nope': net.py defines none of nope"),
    (["inspect", "net.py", "--model-arg", "depth=3", "--input", "8x10"], "MODEL 'net.py' did not build: TypeError"),
    (["inspect", "no_such_package_xyz:build"], "cannot import 'no_such_package_xyz'"),
    (["inspect", "net.py", "--input", "8x10", "--stages", "3", "--chunks", "2"], "--stages 3 is not a multiple of --chunks 2"),
    (["inspect", "net.py", "--input", "8x10", "--devices", "cpu:0,cpu:1", "--split", "nowhere"], "nowhere"),
    (["inspect", "net.py", "--schedule", "2f2b"], "argument --schedule: invalid choice: '2f2b'"),
    (["train", "net.py", "--input", "8x10", "--loss", "lm"], "--loss lm needs token ids in and logits"),
    (["train", "tiny_lm.py", "--input", "4x6"], "does not run on --input 4x6: RuntimeError: Expected tensor"),
    # inspect checks what compile checks, and speaks in flags (issue 32)
    (["inspect", "net.py", "--input", "8x10", "--stages", "2", "--microbatches", "100"],
     "--microbatches 100 cuts a batch of 8 samples (--input 8x10) into more micro-batches than samples"),
    (["inspect", "net.py", "--input", "8x10:float16", "--stages", "2"],
     "--input (float16[8, 10]) meet Sequential's float32 parameters where real kernels refuse mixed dtypes"),
    (["inspect", "net.py", "--input", "8x10", "--stages", "2", "--schedule", "interleaved-1f1b", "--chunks", "2"],
     "--stages 2 with --chunks 2 puts every stage on one worker"),
    (["inspect", "net.py", "--input", "8x10", "--devices", "cpu:0,cpu:1", "--split", "22"],
     "--split 22 is not a module of the model; nearest: 2"),
    (["inspect", "net.py", "--input", "8x10", "--devices", "cpu:0,cpu:1,cpu:2", "--split", "2"],
     "--devices lists 3 device(s) but --split 2 gives 2 stage(s) on 2 worker(s) of the schedule 1f1b; list one device per "
     "stage or one per worker, e.g. --devices cpu:0,cpu:1"),
]


@pytest.mark.parametrize(("argv", "message"), MISTAKES, ids=[" ".join(a) for a, _ in MISTAKES])
def test_a_user_mistake_is_one_line_at_most_three_hints_and_status_2(model_folder, capsys, argv, message):
    assert _status(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [k for k, line in enumerate(lines) if ": error: " in line]
    assert len(errors) == 1, lines
    first = errors[0]
    assert lines[first].startswith(f"fxpipe {argv[0]}: error: ") and message in lines[first], lines
    hints = lines[first + 1 :]
    assert len(hints) <= 3 and all(h.startswith("  ") for h in hints), lines
    assert all(line.startswith("fxpipe: compiled") for line in lines[:first]), lines  # no traceback, no log
    assert not any("Traceback" in line or "File \"" in line for line in lines)


def _status(argv: list[str]) -> int:
    """The exit status of ``fxpipe ARGV``, run in this process (argparse exits by itself)."""
    try:
        return cli.main(argv)
    except SystemExit as done:
        return int(done.code)


def test_debug_raises_the_error_with_its_traceback(model_folder):
    with pytest.raises(cli_model.CommandError, match="does not run on") as info:
        cli.main(["inspect", "net.py", "--stages", "2", "--input", "8x3x32x32", "--debug"])
    assert isinstance(info.value.__cause__, RuntimeError)


def test_the_command_line_script_prints_no_traceback_for_a_model_file_beside_its_imports(model_folder):
    done = _fxpipe("inspect", "net.py", "--stages", "2", "--input", "8x3x32x32", cwd=model_folder)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("fxpipe inspect: error: MODEL 'net.py' does not run on --input 8x3x32x32") and len(lines) <= 4, done.stderr
    done = _fxpipe("inspect", "net.py", "--stages", "2", "--input", "8x10", "--format", "dot", "--out", "out", cwd=model_folder)
    assert done.returncode == 0, done.stderr  # net.py imported its_blocks.py from its own folder
    assert (model_folder / "out" / "partition.dot").exists()


def test_a_model_file_imports_the_files_beside_it_from_any_folder(model_folder, tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    assert isinstance(cli_model.load_model(str(model_folder / "net.py")), torch.nn.Sequential)


# ------------------------------------------------------------------ language models
def test_train_lm_reports_tokens_per_second_and_a_plain_loss_warns_on_lm_logits(model_folder, capsys):
    args = ["tiny_lm.py", "--input", "4x6:int64", "--stages", "2", "--split", "mix", "--microbatches", "2", "--out", "out"]
    assert cli.main(["train", *args, "--loss", "lm", "--steps", "3"]) == 0
    captured = capsys.readouterr()
    assert "tokens/s" in captured.out and "tokens/s=" in captured.err and "warning" not in captured.err
    assert cli.main(["train", *args, "--steps", "1"]) == 0
    warning = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warning == [
        "fxpipe train: warning: MODEL returns token logits (4, 6, 50); --loss cross-entropy scores them against "
        "random targets, not the next token: use --loss lm to train a language model"
    ]


def test_lm_tokens_are_drawn_below_the_vocabulary():
    ids = cli_model.example_inputs(["64x32:int64"], high=50)[0]
    assert ids.min() >= 0 and ids.max() == 49


def test_the_next_token_loss_equals_eager_on_a_gpt2_pipeline():
    from llm_models import gpt2

    import fxpipe

    torch.manual_seed(0)
    model = gpt2(layers=2).double()
    ids = torch.randint(3, 64, (4, 9))
    eager = copy.deepcopy(model)
    expected = cli_model.next_token_loss(eager(ids), ids)
    expected.backward()
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["transformer.h.1"], microbatches=2)
    pipe = fxpipe.compile(model, plan, example_inputs=(ids,), loss_fn=cli_model.next_token_loss)
    loss = pipe.step(ids, target=ids)
    assert abs(float(loss) - float(expected.detach())) < 1e-12
    grads = dict(eager.named_parameters())
    for name, p in pipe.named_parameters():
        assert torch.allclose(p.grad, grads[name].grad, atol=1e-12), name


# ------------------------------------------------------------------ the page
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--hide-scrollbars",
]


def _chromium(page: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tempfile.mkdtemp(dir=tmp_path)
    command = [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, page.resolve().as_uri()]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def _share(image, colour: str) -> float:
    """The share of the screenshot's pixels within a few levels of ``colour`` (#rrggbb)."""
    rgb = [int(colour[k : k + 2], 16) / 255 for k in (1, 3, 5)]
    near = (abs(image[..., :3] - torch.tensor(rgb).numpy()) < 4 / 255).all(axis=-1)
    return float(near.mean())


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (make install installs it where apt-get can)")
def test_inspect_html_is_one_page_a_real_browser_renders(model_folder, tmp_path, capsys):
    from fxpipe.inspection import diagram, gantt

    assert cli.main(["inspect", "net.py", "--input", "8x10", "--stages", "2", "--split", "2", "--html", "--explain", "--out", "out"]) == 0
    page = model_folder / "out" / "inspect.html"
    text = page.read_text()
    assert "<svg" in text and "data:image/png;base64," in text
    assert not any(token in text for token in ('src="http', "href=\"http", "<script", "<link", 'src="file', "url("))
    dom = _chromium(page, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert dom.stdout.count("<tr>") == 1 + 2 + 1 + 1  # summary: header and two stages; crossing: header and one value
    assert "why each stage holds what it holds" in dom.stdout.lower() and "send to stage 1: 1 " in dom.stdout
    shot = tmp_path / "page.png"
    done = _chromium(page, tmp_path, f"--screenshot={shot}", "--window-size=1400,2400")
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    image = matplotlib.image.imread(shot)
    assert image.shape[:2] == (2400, 1400)
    # the drawing rendered (both stages' fills), the timeline too (forward blue), and text
    assert _share(image, diagram._FILLS[0]) > 0.002 and _share(image, diagram._FILLS[1]) > 0.002
    assert _share(image, gantt._COLOURS["F"][0]) > 0.002
    assert (image[..., :3] < 0.3).all(axis=-1).mean() > 0.003


def test_inspect_names_an_llms_decoder_layers_as_ranges(capsys):
    examples = Path(__file__).resolve().parent.parent / "examples"
    argv = ["inspect", f"{examples}/llm_configs.py:llama", "--model-arg", "layers=4", "--model-arg", "width=32",
            "--input", "2x16:int64", "--stages", "2", "--split", "model.layers.2", "--format", "dot", "--explain"]
    with tempfile.TemporaryDirectory() as out:
        assert cli.main([*argv, "--out", out]) == 0
    text = capsys.readouterr().out
    assert "model.embed_tokens, model.rotary_emb, model.layers.0 – model.layers.1\n" in text
    assert "model.layers.2 – model.layers.3, model.norm, lm_head\n" in text
    assert "send to stage 1: model.layers.1 · add f32[2, 16, 32]" in text  # the residual stream, by its layer


def test_hints_speak_in_flags_not_python():
    assert cli.in_flags("plan.split[0] = 'layer9' is not a module; use Plan(split='auto') or devices=['cpu:0', 'cpu:1']") == (
        "--split layer9 is not a module; use --split auto or --devices cpu:0,cpu:1"
    )
    assert cli.in_flags("plan.schedule = 'zb-v' with plan.chunks = 1") == "--schedule zb-v with --chunks 1"
    assert cli.in_flags("pass example_inputs=(x, ...) shaped like a batch") == "pass --input SHAPE[:DTYPE] shaped like a batch"


def test_inspect_refuses_float16_inputs_for_a_float32_resnet(capsys):
    argv = ["inspect", "torchvision:resnet18", "--model-arg", "num_classes=10", "--input", "4x3x32x32:float16", "--stages", "2", "--split", "layer3"]
    assert _status(argv) == 2
    error = capsys.readouterr().err.strip().splitlines()[0]
    assert error.startswith("fxpipe inspect: error: --input (float16[4, 3, 32, 32]) meet ResNet's float32 parameters"), error
    assert "convolution: input of dtype torch.float16, weight of dtype torch.float32" in error
    assert "give --input the model's dtype, e.g. --input 8x3x224x224:float32" in error
