"""Trace pass: a model becomes one flat ``torch.fx`` graph; this module picks the frontend.

Frontends
---------
``fx``      ``torch.fx`` symbolic tracing (``passes/trace_fx.py``).
``export``  ``torch.export.export(strict=False)`` (``passes/trace_export.py``).
``auto``    fx first, for every model (HuggingFace's included): what fx cannot trace
            runs as an opaque call and the trace goes on around it; export when fx fails
            anyway (the root forward's own body cannot be traced). The result's ``notes``
            say which frontend ran and why.

What a trace specialises on is explicit (``passes/signature.py``): ``Traced.key`` is the
call's :class:`TraceKey`; ``Traced.key_of`` gives another call's key in the same terms, so
a caller traces again exactly when a call's key is new. ``bind_inputs`` raises
SignatureError for a call whose None pattern, constants, dtypes, structure or baked sizes
differ from the trace's (the batch size aside).

Writes, per node: ``node.meta["custom"]["fxpipe_device"]`` (device_guard tags, recorded by
``torch.fx.traceback``) and ``node.meta[MODULE_PATH]``: the qualified name of the
innermost module whose forward created the node ("" for the root).

Tracing never changes the model (``passes/module_state.py``). A frontend tries the model
quietly (:func:`quiet_attempt`): a failed attempt prints nothing, and the TraceError is a
few lines naming the model's source line (``passes/trace_errors.py``).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch import nn

from fxpipe.passes.signature import SignatureError
from fxpipe.passes.tags import TagError
from fxpipe.passes.trace_errors import failure_message, first_line, where
from fxpipe.passes.trace_export import trace_export
from fxpipe.passes.trace_fx import trace_fx
from fxpipe.passes.traced import Traced, TraceError


@contextlib.contextmanager
def quiet_attempt() -> Iterator[None]:
    """A frontend tries the model without noise: torch's loggers are silenced and stderr is
    held back (torch.export prints the partial graph of a failed attempt there), then
    replayed if the attempt succeeds and dropped if it fails. ``TORCH_LOGS`` turns this off."""
    if os.environ.get("TORCH_LOGS"):
        yield
        return
    logger = logging.getLogger("torch")
    level = logger.level
    held = io.StringIO()
    logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(held):
            yield
    finally:
        logger.setLevel(level)
    sys.stderr.write(held.getvalue())


def trace(
    model: nn.Module,
    example_inputs: tuple = (),
    example_kwargs: Mapping[str, Any] | None = None,
    frontend: str = "auto",
    leaf_modules: Sequence[Any] = (),
    concrete_args: Mapping[str, Any] | None = None,
    *,
    dynamic_batch: bool = True,
) -> Traced:
    """Trace ``model`` for the call ``model(*example_inputs, **example_kwargs)``.

    dynamic_batch: True keeps dim 0 of batch-sized tensor inputs out of what the trace
    specialises on, so one trace serves every micro-batch size (export marks it symbolic
    and may still bake it, e.g. for a batch of 1: ``key`` then holds it; fx branches on
    sizes as a batch of two would); False traces at the example's sizes, which ``key``
    holds wherever the trace depends on sizes: trace once per micro-batch signature.

    Returns a :class:`Traced`. Raises SignatureError when the example does not fit
    ``model.forward``, TraceError naming, for each frontend tried, the module and source
    line where it stopped, with the usual fixes (a leaf module, concrete args, or the
    other frontend), or naming the argument when a None argument reaches an operator.
    """
    owner = type(model).__name__
    signature = inspect.signature(model.forward)
    try:
        bound = signature.bind_partial(*example_inputs, **dict(example_kwargs or {}))
    except TypeError as err:
        raise SignatureError(f"example inputs do not match {owner}.forward{signature}: {err}") from None
    notes: list[str] = []
    concrete_args = dict(concrete_args or {})
    inference_only = inference_only_defaults(model, signature, bound, concrete_args)
    _with_inference_only(signature, bound, concrete_args, inference_only)
    for name, value in inference_only.items():
        notes.append(f"{name} left out: traced with {name}={value!r} (an inference-only option; a pipeline's call returns no generation cache)")
    # an argument the example leaves out stays an input (fx needs no value for it); the
    # compiler's bind_inputs then asks for a complete example
    bound.apply_defaults()
    failures: list[tuple[str, BaseException]] = []
    with quiet_attempt():
        if frontend in ("auto", "fx"):
            try:
                traced = trace_fx(model, signature, bound, leaf_modules, concrete_args, dynamic_batch)
            except (TraceError, TagError):
                raise  # a wrong device_guard or a None operand: every frontend stops there
            except Exception as err:  # noqa: BLE001 - any failure means: try the next frontend
                failures.append(("torch.fx", err))
                if frontend == "fx":
                    raise TraceError(failure_message(model, failures, bound, fx_only=True), failures) from None
            else:
                traced.notes[:0] = notes
                return traced
        try:
            traced = trace_export(model, signature, bound, dynamic_batch)
        except TagError:
            raise
        except Exception as err:  # noqa: BLE001
            failures.append(("torch.export", err))
            raise TraceError(failure_message(model, failures, bound), failures) from None
    if failures:
        note = (
            f"torch.fx could not trace {owner} ({where(model, failures[0][1])}: "
            f"{first_line(failures[0][1])}); traced with torch.export instead"
        )
        notes.append(note)
        warnings.warn(f"fxpipe: {note}", stacklevel=2)
    traced.notes[:0] = notes
    return traced


# forward arguments that only serve generation (incremental decoding), with the value a
# training-mode trace takes when the call leaves them out: HF's ``use_cache`` defaults to
# the config's (True), which builds a DynamicCache that neither frontend can carry as a value
INFERENCE_ONLY = {"use_cache": False}


def inference_only_defaults(
    model: nn.Module, signature: inspect.Signature, bound: inspect.BoundArguments, concrete_args: Mapping[str, Any]
) -> dict[str, Any]:
    """The inference-only arguments (:data:`INFERENCE_ONLY`) that the call leaves out
    (neither passed nor in ``concrete_args``), with the value fx traces them at: those
    ``forward`` names whose value in the model's ``config`` is not already that, and those
    a ``forward(**kwargs)`` hands down that the config or one of its sub-configs sets
    otherwise (a vision-language model's ``text_config.use_cache``). Read before the call's
    defaults are applied."""
    config = getattr(model, "config", None)
    passed = {**bound.arguments, **bound.arguments.get(_var_keyword(signature) or "", {})}
    return {
        name: value
        for name, value in INFERENCE_ONLY.items()
        if name not in passed and name not in concrete_args and _left_otherwise(config, signature, name, value)
    }


def _left_otherwise(config: Any, signature: inspect.Signature, name: str, value: Any) -> bool:
    if name in signature.parameters:
        return getattr(config, name, None) != value
    if _var_keyword(signature) is None or config is None:
        return False
    sub_configs = [v for v in vars(config).values() if hasattr(v, "to_dict") and hasattr(v, name)]
    return any(getattr(c, name) not in (None, value) for c in (config, *sub_configs) if hasattr(c, name))


def _var_keyword(signature: inspect.Signature) -> str | None:
    """The name of ``forward``'s ``**kwargs`` parameter, or None."""
    return next((p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)


def _with_inference_only(signature: inspect.Signature, bound: inspect.BoundArguments, concrete_args: dict[str, Any], values: Mapping[str, Any]) -> None:
    """Put the inference-only ``values`` into ``concrete_args``: a named parameter as
    itself, one handed down through ``**kwargs`` in that argument's template (after the
    call's own keyword arguments, whose tensors stay inputs)."""
    var_keyword = _var_keyword(signature)
    for name, value in values.items():
        if name in signature.parameters or var_keyword is None:
            concrete_args[name] = value
        else:
            template = concrete_args.get(var_keyword, bound.arguments.get(var_keyword, {}))
            concrete_args[var_keyword] = {**template, name: value}
