"""What the ``fxpipe`` command builds from its arguments: the model, random inputs, targets.

A model spec is ``torchvision:NAME``, ``package.module:factory`` or
``path/to/file.py[:factory]``; a file is imported with its own folder importable (so it
may import the files beside it) and a module spec from the current folder. Inputs are
random tensors of the ``--input`` shapes; a causal language model's next-token loss
(``--loss lm``) takes its targets from the token ids it reads. Every mistake is a
:class:`CommandError` whose message names the argument at fault and whose hints say what
to write instead.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

FACTORY_NAMES = ["build_model", "make_model", "get_model", "model"]
IMAGE_INPUT = "8x3x224x224"  # torchvision models' default --input


class CommandError(Exception):
    """A command-line value fxpipe cannot use. The message is one line; ``hints`` (at
    most three lines) say what to write instead."""

    def __init__(self, message: str, hints: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.hints = list(hints)[:3]


# ------------------------------------------------------------------ the model
def load_model(spec: str, kwargs: dict[str, Any] | None = None) -> nn.Module:
    """Returns the ``nn.Module`` that ``spec`` names (see ``fxpipe --help``), built with
    ``kwargs``.

    Raises:
        CommandError: when the spec names nothing that exists, its file or module does not
            import, the factory fails, or what it gives is not an nn.Module.
    """
    kwargs = dict(kwargs or {})
    if spec.startswith("torchvision:"):
        return _torchvision_model(spec, kwargs)
    where, _, attribute = spec.rpartition(":") if ":" in spec else (spec, "", "")
    if where.endswith(".py"):
        if not Path(where).is_file():
            raise CommandError(f"MODEL {spec!r}: no file {where}", [f"the path is relative to {Path.cwd()}"])
        module = _import(spec, lambda: _import_file(Path(where)))
        names = [attribute] if attribute else FACTORY_NAMES
    elif attribute:
        module = _import(spec, lambda: _import_module(where))
        names = [attribute]
    else:
        raise CommandError(
            f"MODEL {spec!r} is not a model spec",
            ["write torchvision:NAME, package.module:factory or path/to/file.py[:factory]"],
        )
    found = next((getattr(module, n) for n in names if hasattr(module, n)), None)
    if found is None:
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_") and getattr(v, "__module__", "") == module.__name__)
        raise CommandError(f"MODEL {spec!r}: {where} defines none of {', '.join(names)}", [f"it defines {', '.join(defined) or 'nothing callable'}"])
    return _built(spec, found, kwargs)


def _torchvision_model(spec: str, kwargs: dict[str, Any]) -> nn.Module:
    import torchvision

    name = spec.split(":", 1)[1]
    try:
        return torchvision.models.get_model(name, weights=None, **kwargs)
    except ValueError as err:
        raise CommandError(f"{spec}: {err}", ["list them with torchvision.models.list_models()"]) from err
    except TypeError as err:
        raise CommandError(f"MODEL {spec!r} did not build: {err}", ["check the --model-arg names"]) from err


def _import(spec: str, do_import: Any) -> Any:
    """Runs ``do_import()``; whatever the imported code raises becomes a CommandError."""
    try:
        return do_import()
    except CommandError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's file may raise anything while importing
        raise CommandError(
            f"MODEL {spec!r} does not import: {type(err).__name__}: {_first_line(err)}",
            ["rerun with --debug to see the traceback"],
        ) from err


def _import_module(name: str) -> Any:
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # as `python -m` does: the current folder's packages
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and name.startswith(err.name):
            raise CommandError(f"cannot import {name!r}: no module {err.name!r}", [f"run fxpipe from the folder that holds {name.split('.')[0]}, or install it"]) from err
        raise


def _import_file(path: Path) -> Any:
    """Imports ``path`` as a module named after it, with its folder importable first."""
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(path.stem, module)
    spec.loader.exec_module(module)
    return module


def _built(spec: str, found: Any, kwargs: dict[str, Any]) -> nn.Module:
    """The module ``found`` is, or the one it builds when called with ``kwargs``."""
    if isinstance(found, nn.Module):
        if kwargs:
            raise CommandError(f"MODEL {spec!r} is a module instance: --model-arg has nothing to build", ["name a function or class instead"])
        return found
    try:
        model = found(**kwargs)
    except Exception as err:  # noqa: BLE001 - a factory may raise anything
        takes = _parameters(found)
        raise CommandError(
            f"MODEL {spec!r} did not build: {type(err).__name__}: {_first_line(err)}",
            [f"{getattr(found, '__name__', 'the factory')} takes ({takes}); check --model-arg", "rerun with --debug to see the traceback"],
        ) from err
    if not isinstance(model, nn.Module):
        raise CommandError(f"MODEL {spec!r} gave a {type(model).__name__}, not a torch.nn.Module")
    return model


def parse_model_args(items: Sequence[str]) -> dict[str, Any]:
    """Returns ``{"num_classes": 10}`` for ``["num_classes=10"]``; values are Python
    literals, or strings when they parse as none.

    Raises:
        CommandError: for an item without ``=``.
    """
    kwargs = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier():
            raise CommandError(f"--model-arg {item!r}: write KEY=VALUE", ["e.g. --model-arg num_classes=10"])
        try:
            kwargs[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            kwargs[key] = text
    return kwargs


# ------------------------------------------------------------------ inputs
def input_shapes(spec: str, given: Sequence[str] | None, model: nn.Module) -> list[str]:
    """The ``--input`` values to use: those given, checked against the number of inputs
    ``model.forward`` takes; a torchvision model's default image batch otherwise.

    Raises:
        CommandError: when --input is missing for a model that is not torchvision's, or
            gives fewer inputs than the forward requires or more than it takes.
    """
    required, most, names = _forward_arity(model)
    if not given:
        if spec.startswith("torchvision:"):
            return [IMAGE_INPUT]
        raise CommandError(
            f"no --input: say what MODEL's forward({names}) takes",
            ["one --input per argument, dimensions joined by x, dim 0 the batch: e.g. --input 8x3x224x224",
             "token ids are integers: --input 8x128:int64"],
        )
    if len(given) < required or (most is not None and len(given) > most):
        wanted = f"{required}" if most == required else f"{required} to {most}" if most is not None else f"at least {required}"
        raise CommandError(
            f"{len(given)} --input given, but MODEL's forward({names}) takes {wanted}",
            ["give one --input per argument, in order"],
        )
    return list(given)


def _forward_arity(model: nn.Module) -> tuple[int, int | None, str]:
    """(required positional inputs, most positional inputs or None for *args, the
    parameters as written) of ``model.forward``."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return 0, None, "..."
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(1 for p in positional if p.default is p.empty)
    most = None if any(p.kind is p.VAR_POSITIONAL for p in params) else len(positional)
    return required, most, _parameters(model.forward)


def _parameters(fn: Any) -> str:
    try:
        return ", ".join(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return "..."


def example_inputs(shapes: Sequence[str], seed: int = 0, high: int = 2) -> tuple[torch.Tensor, ...]:
    """Returns random example tensors for ``--input`` values such as ``8x3x224x224`` or
    ``8x128:int64``: floats are standard normal, integers drawn from ``0 .. high - 1``.

    Raises:
        CommandError: for a malformed shape or an unknown dtype.
    """
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for text in shapes:
        shape_text, _, dtype_name = text.partition(":")
        try:
            shape = [int(d) for d in shape_text.lower().split("x")]
        except ValueError:
            raise CommandError(f"--input {text!r}: write dimensions joined by x", ["e.g. --input 8x3x224x224"]) from None
        dtype = getattr(torch, dtype_name or "float32", None)
        if not isinstance(dtype, torch.dtype) or any(d < 1 for d in shape):
            raise CommandError(f"--input {text!r}: positive dimensions and a torch dtype such as float32 or int64", ["e.g. --input 8x128:int64"])
        if dtype.is_floating_point:
            tensors.append(torch.randn(shape, generator=generator).to(dtype))
        else:
            tensors.append(torch.randint(0, high, shape, generator=generator).to(dtype))
    return tuple(tensors)


def describe_inputs(shapes: Sequence[str]) -> str:
    return " ".join(f"--input {s}" for s in shapes)


# ------------------------------------------------------------------ targets and losses
def make_target(loss: str, output: Any, generator: torch.Generator) -> Any:
    """Returns a random target for ``loss`` shaped like the model's ``output`` (a fake
    tensor from shape propagation): class indices for cross-entropy, values for mse.

    Raises:
        CommandError: when the model's output is not one tensor but the loss needs one.
    """
    if loss == "output":
        return None
    if not isinstance(output, torch.Tensor):
        raise CommandError(
            f"--loss {loss} needs a model that returns one tensor",
            ["--loss lm for a causal language model's logits", "--loss output for a model returning its own loss"],
        )
    if loss == "mse":
        return torch.randn(tuple(output.shape), generator=generator)
    if output.dim() < 2:
        raise CommandError(f"--loss cross-entropy needs an output of shape (batch, classes, …), got {tuple(output.shape)}")
    shape = (output.shape[0], *output.shape[2:])
    return torch.randint(0, int(output.shape[1]), shape, generator=generator)


def token_input(inputs: Sequence[Any]) -> int | None:
    """The position of the first input that holds token ids: integers of shape (batch, length)."""
    return next((k for k, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point()), None)


def token_logits(output: Any, tokens: torch.Tensor) -> torch.Tensor | None:
    """The first tensor of ``output`` shaped (batch, length, vocabulary) for ``tokens`` of
    shape (batch, length): a causal language model's logits; None when there is none."""
    leaves = output if isinstance(output, (tuple, list)) else output.values() if isinstance(output, Mapping) else [output]
    return next(
        (t for t in leaves if isinstance(t, torch.Tensor) and t.dim() == 3 and t.is_floating_point() and tuple(t.shape[:2]) == tuple(tokens.shape)),
        None,
    )


def logits_of(output: Any) -> torch.Tensor:
    """A language model's logits from what its forward returns: the tensor itself, its
    ``logits`` (a HuggingFace output), or the first tensor of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, Mapping):
        return output["logits"]
    return next(t for t in output if isinstance(t, torch.Tensor))


def next_token_loss(output: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each position's logits against the next token."""
    logits = logits_of(output)
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0]


__all__ = [
    "CommandError", "describe_inputs", "example_inputs", "input_shapes", "load_model", "logits_of", "make_target",
    "next_token_loss", "parse_model_args", "token_input", "token_logits",
]
