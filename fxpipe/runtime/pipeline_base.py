"""``PipelineBase``: what the local and the distributed pipeline share.

The module-like API over the tensors this process holds (``named_parameters``,
``state_dict``, ``load_state_dict``, ``zero_grad``, ``train``), the micro-batch split
(data-parallel replicas take their shard first) or the caller's own list of micro-batches
(``microbatches=[...]``: of any sizes, each run by its own signature's program), the
per-micro-batch loss weights, the cache of programs per input signature and the call/step
flow (the schedule is the program's partition's: ``part.actions(m, train)``). A subclass
says how one call executes (``_execute``), what the caller gets back (``_output``,
``_step_loss``) and what follows a ``load_state_dict`` (``_after_load``).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.batching import loss_scale, microbatch
from fxpipe.batching.microbatch import LossFunctionError, MicrobatchError
from fxpipe.inspection.memory_report import MemoryReport, memory_report
from fxpipe.inspection.views import PipelineViews
from fxpipe.runtime.attributes import AttributeGuard
from fxpipe.runtime.context import StepContext
from fxpipe.runtime.inputs import InputCheck
from fxpipe.runtime.interpret import ActionHook
from fxpipe.runtime.memory import StepMemory, held_state
from fxpipe.runtime.runner import StageRunner
from fxpipe.schedules import describe_schedule


@dataclass(frozen=True)
class Compiler:
    """The compiler's work a pipeline asks for while it runs, handed in by ``fxpipe.factory``
    so that no pipeline or executor imports the compiler or a pass.

    retrace(first, model, args, kwargs, roots_for): the Partitioned of another input
    signature, cut like ``first`` (``fxpipe.compiler.driver.partition_like``; roots_for(s): the
    modules holding stage s's placed parameters). batched_outputs(model, args, kwargs, part):
    which tensor outputs follow the batch, from the call's program ``part`` replayed on fake tensors
    (``fxpipe.batching.batched_outputs``). fake_replay(): a runner of stage modules on fake tensors
    (``FakeReplay(device="cpu")``), with which a distributed pipeline derives edge specs.
    output_like(model, args, kwargs): the model's output for a call as meta tensors, from
    one run on fake tensors (``fxpipe.batching.batched_outputs.output_like``): what a step's loss
    counts are taken from before its micro-batches run. check_call(model, args, kwargs):
    raises what the eager model raises for a call's shapes and dtypes, on fake tensors with
    the dtype rules of real kernels (``fxpipe.batching.batched_outputs.check_call``): an input the
    program was not traced for is named before any stage runs (``fxpipe.runtime.inputs``).
    """

    retrace: Callable[[Any, nn.Module, tuple, dict, Callable[[int], list[nn.Module]]], Any]
    batched_outputs: Callable[[nn.Module, tuple, dict, Any], dict[str, bool]]
    fake_replay: Callable[[], Any]
    output_like: Callable[[nn.Module, tuple, dict], Any]
    check_call: Callable[[nn.Module, tuple, dict], None]


@dataclass
class Program:
    """One input signature's compiled stages, as this process runs them.

    part: the Partitioned of that signature's trace (its stages share the parameters of
    the first; it holds the schedule, ``part.actions(m, train)``, and the edge ends);
    runners: this process's stages by index.
    """

    part: Any
    runners: dict[int, StageRunner]

    def train(self, mode: bool) -> None:
        """Set the stage modules' train/eval mode (a program made for a mode runs in it)."""
        for runner in self.runners.values():
            runner.module.train(mode)


@dataclass
class Batch:
    """One call's micro-batches on this process: flat model inputs and targets per
    micro-batch, their sizes, the samples of the whole step (all replicas), and the
    global index of the first micro-batch here.

    programs: per micro-batch, the compiled stages of its input signature (one program
    for all when the batch was cut; a listed micro-batch of another length may have its
    own); listed: the caller passed the micro-batches as a list, ``calls`` holding each
    one's (args, kwargs); whole / call: the flat inputs before the cut and the call's own
    arguments (a batch that was cut); step: every replica's (inputs, target, size) as far
    as this process knows them (a listed step: this replica's); baked: why a stage may fail
    on these micro-batches' sizes (:func:`_baked_batch`), or "".
    """

    inputs: list[list]
    targets: list[Any]
    sizes: list[int]
    total: int
    first: int = 0
    whole: Any = None
    call: tuple[tuple, dict] = ((), {})
    programs: list[Program] = field(default_factory=list)
    step: list[tuple[list, Any, int]] = field(default_factory=list)
    calls: list[tuple[tuple, dict]] = field(default_factory=list)
    baked: str = ""

    @property
    def listed(self) -> bool:
        """Whether the caller passed the micro-batches as a list (``calls`` holds them)."""
        return bool(self.calls)

    def largest(self) -> tuple[Any, list | None]:
        """The partition to predict this step's memory from, and the flat inputs of its
        largest micro-batch (most elements) when the micro-batches were listed (None when
        cut: pieces of one batch are predicted from their sample count)."""
        if not self.listed:
            return self.program.part, None
        numel = [sum(x.numel() for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor)) for inputs in self.inputs]
        i = numel.index(max(numel))
        return self.programs[i].part, self.inputs[i]

    @property
    def program(self) -> Program:
        """The first micro-batch's program (the only one when the batch was cut)."""
        return self.programs[0]

    def microbatch_runners(self) -> list[dict[int, StageRunner]] | None:
        """Per micro-batch, the runners of its program when the micro-batches use more than one."""
        if all(p is self.programs[0] for p in self.programs):
            return None
        return [p.runners for p in self.programs]

    def build_output(self, i: int, out: Any) -> Any:
        """What the model returns, from micro-batch ``i``'s last-stage output."""
        return self.programs[i].part.build_output(out)

    def input_gradient_leaves(self) -> list[tuple[torch.Tensor, list[torch.Tensor], bool]]:
        """Give every micro-batch piece of an input that requires grad its own autograd leaf.

        Returns (the caller's tensor, its pieces' leaves, whether it was cut or passed whole)
        for :meth:`backward_inputs`. The caller's tensor may be a non-leaf: its graph is then
        backpropagated once, after the step, as eager's single backward does. A listed
        micro-batch's tensors are the caller's own (a tensor in several micro-batches
        gets the sum of their gradients).
        """
        originals = [pytree.tree_leaves(flat) for flat in self.inputs] if self.listed else [pytree.tree_leaves(self.whole)] * len(self.inputs)
        wanted: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        for i, flat in enumerate(self.inputs):
            pieces, spec = pytree.tree_flatten(flat)
            for k, original in enumerate(originals[i]):
                if isinstance(original, torch.Tensor) and original.requires_grad:
                    pieces[k] = pieces[k].detach().requires_grad_()
                    # a cut input's pieces by position; the caller's own tensors by identity
                    wanted.setdefault(id(original) if self.listed else k, (original, []))[1].append(pieces[k])
            self.inputs[i] = pytree.tree_unflatten(pieces, spec)
        return [(original, leaves, leaves[0].shape != original.shape) for original, leaves in wanted.values()]

    @staticmethod
    def backward_inputs(wanted: list[tuple[torch.Tensor, list[torch.Tensor], bool]]) -> None:
        """Backpropagate the pieces' gradients into the caller's tensors (and their graphs)."""
        tensors, grads = [], []
        for original, leaves, cut in wanted:
            pieces = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
            if all(leaf.grad is None for leaf in leaves):
                continue
            tensors.append(original)
            grads.append(torch.cat([g.to(original.device) for g in pieces]) if cut else torch.stack([g.to(original.device) for g in pieces]).sum(0))
        if tensors:
            torch.autograd.backward(tensors, grads)


def _with_signature_context(err: Exception, compiled: Any, call: Any) -> Exception:
    """``err`` (a failed trace for a new input signature) with what differs from the
    compiled signature in front, and the fix for a left-out argument."""
    differences = compiled.differences(call) if compiled is not None else []
    if not differences:
        return err
    left_out = [d.split(":")[0] for d in differences if d.endswith("-> None")]
    fix = (
        f" To run without {', '.join(left_out)}, make the trace work for it (the error below says where "
        f"it failed), or pass {', '.join(left_out)} as at compile time."
        if left_out else ""
    )
    message = (
        f"this call's input signature differs from the compiled one ({'; '.join(differences)}), so fxpipe traced "
        f"the model again for it, and that failed.{fix}\n{err}"
    )
    try:
        wrapped = type(err)(message)
    except Exception:  # noqa: BLE001 - an exception class that takes other arguments
        return err
    wrapped.__dict__.update(err.__dict__)
    return wrapped


def _check_same_edges(programs: list[Program]) -> None:
    """Raise MicrobatchError when two micro-batches' programs cross the stages on other
    edges: one step's messages and hand-offs are planned on one set of edges. The message
    names the values one program's stages receive and the other's do not, and the fix:
    another frontend when only sizes differ, steps of their own when a Python value (a
    constant, a pytree class's context) changed what the stages exchange."""
    def edges(program: Program) -> tuple:
        return tuple(program.part.edge_ends), tuple((tuple(s.recv_ids), tuple(s.send_ids)) for s in program.part.stages)

    first = edges(programs[0])
    for i, program in enumerate(programs):
        if program is not programs[0] and edges(program) != first:
            mine, theirs = programs[0].part, program.part
            fix = (
                "trace once for every size (Plan(frontend='fx'))"
                if _sizes_only(mine.key, theirs.key)
                else "a Python value of the call (a constant, a pytree class's context) changes which values cross the stages"
            )
            raise MicrobatchError(
                f"micro-batch {i}'s input signature ({theirs.key.brief()}) was traced into stages that exchange "
                f"other values than micro-batch 0's ({mine.key.brief()}; {_received_difference(mine, theirs, i)}), so they "
                f"cannot run in one step: {fix}; run them in steps of their own"
            )


def _baked_batch(program: Program, batch: int | None, sizes: list[int]) -> str:
    """Why ``program``'s stages may fail on micro-batches of ``sizes``: its trace holds the
    call's ``batch`` size (dim 0 of its first tensor; torch.export could not keep it
    symbolic and traced every size as the example's) and a micro-batch has another size.
    "" when the trace does not hold it. Said only if a stage fails: a program with no
    shape baked into an operation still runs."""
    key = program.part.key
    shapes = [d.shape for _, _, leaves in (key.arguments if key is not None else ()) for d in leaves if getattr(d, "shape", None)]
    traced = shapes[0][0] if shapes else None
    if traced is None or traced != batch or all(n == traced for n in sizes):
        return ""
    why = [n for n in program.part.notes if "specialised the batch" in n]
    return (
        f"the program of {key.brief()} was traced with the batch size fixed at {traced}"
        f"{' (' + why[0] + ')' if why else ''}, and runs micro-batches of {sorted(set(sizes))} rows: "
        "make torch.export keep dim 0 symbolic (what it specialised on is named above), trace with Plan(frontend='fx'), "
        f"or pass batches that cut into micro-batches of {traced} rows"
    )


def _received_difference(first: Any, other: Any, i: int) -> str:
    """Which values a stage receives under one partition and not the other, by name."""
    def received(part: Any) -> set[tuple[int, str]]:
        return {(s.index, e.name) for s in part.stages for e in s.inputs}

    only = [(received(first) - received(other), "0"), (received(other) - received(first), str(i))]
    said = [f"stage {s} receives {name} for micro-batch {k} only" for names, k in only for s, name in sorted(names)]
    return ", ".join(said) or "the same values, on other edges or in another order"


def _sizes_only(first: Any, other: Any) -> bool:
    """Whether two trace keys differ in tensor sizes only (the fx frontend's program is one for every size)."""
    def sizeless(key: Any) -> tuple:
        return tuple((n, s, tuple(getattr(d, "dtype", d) for d in leaves)) for n, s, leaves in key.arguments)

    return first is not None and other is not None and sizeless(first) == sizeless(other)


def _shape_of(value: Any) -> list[int] | str:
    """A state-dict value's shape as a list (what a non-tensor value is, otherwise)."""
    return list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(the submodule holding buffer ``name``, its attribute name)."""
    path, _, attr = name.rpartition(".")
    return module.get_submodule(path), attr


class PipelineBase(PipelineViews):
    """A compiled model's stages on this process, run on the plan's schedule.

    Subclasses set ``part``, ``plan``, ``loss_fn``, ``frontend``, ``training``,
    ``_params`` (the model's parameter names -> this process's tensors), ``_state`` (every
    state_dict key held here -> tensor), ``_modules`` (the stage modules held here),
    ``replicas``/``replica`` (data parallelism) and ``_partial_state`` (whether other
    processes hold the rest of the model).
    """

    _params: dict[str, nn.Parameter]
    _state: dict[str, torch.Tensor]
    _modules: list[nn.Module]
    _partial_state = False
    replicas = 1
    replica = 0

    def _setup(self, part: Any, loss_fn: Any, model: nn.Module, compiler: Compiler, watched: nn.Module) -> None:
        """``model``: a skeleton of the model as it was traced (``placement.skeleton``, made
        for this pipeline: kept as it is); ``watched``: the user's model, whose plain
        attributes every call holds to their compile-time values."""
        self.part = part
        self._compiler = compiler
        self.plan = part.plan
        self.loss_fn = loss_fn
        self.frontend = part.frontend
        self.training = model.training
        # the model's code and structure without its memory (nor a reference to it): which
        # outputs follow the batch is asked of it on fake tensors
        self._model = model
        self._check_inputs = InputCheck(self._model, (tuple(part.example_inputs), dict(part.example_kwargs)), compiler.check_call)
        self._attributes = AttributeGuard(watched)
        self._batched: dict[tuple, dict[str, bool]] = {}
        self._outputs_like: dict[tuple, Any] = {}  # a listed step's outputs as meta tensors, per input shapes
        self._programs: dict[Any, Program] = {}
        self._last_events: list = []
        # called around every action this process runs (see fxpipe.runtime.interpret.ActionHook)
        self.action_hooks: list[ActionHook] = []
        self._last_memory: tuple | None = None  # the last measured step's (Partitioned, largest listed inputs or None, micro-batch sizes, StepMemory, modules)
        self._measured: set[tuple[int, int]] = set()  # (program, micro-batch count) measured already
        self._random = any("rng_seed" in s.extra_inputs for s in part.stages)

    # ------------------------------------------------------------------ running
    def _first_program(self, program: Program) -> None:
        """Register the compile-time partition's program as the program of its signature."""
        key = (self.part.key.batch_free(), self.training) if self.part.key is not None else None
        self._programs[key] = program

    def _program(self, args: tuple, kwargs: dict) -> Program:
        """The compiled stages for this call's input signature and train/eval mode: cached,
        or traced and cut now (once per signature and mode, so a forward's Python reads of
        ``self.training`` follow ``pipe.eval()``; the stage boundaries and parameters are
        the first's)."""
        if self.part.key_of is None:
            return next(iter(self._programs.values()))
        call_key = self.part.key_of(args, kwargs)
        key = (call_key.batch_free(), self.training)
        if key not in self._programs:
            try:
                program = self._compile_program(args, kwargs)
            except Exception as err:
                raise _with_signature_context(err, self.part.key, call_key) from err
            program.train(self.training)  # a program made for a mode runs in that mode
            self._programs[key] = program
        return self._programs[key]

    def _program_of_rows(self, args: tuple, kwargs: dict, total: int, rows: int) -> Program:
        """The compiled stages for micro-batches of ``rows`` samples of this call, for a
        trace that holds the batch size (``part.batch_lengths``): traced and cut on the
        call's first ``rows`` samples, once per size and mode."""
        key = (self.part.key_of(args, kwargs).batch_free(), self.training, rows)
        if key not in self._programs:
            head = microbatch.first_rows((args, kwargs), total, rows)
            program = self._compile_program(*head)
            program.train(self.training)
            self._programs[key] = program
        return self._programs[key]

    def _compile_program(self, args: tuple, kwargs: dict) -> Program:
        raise NotImplementedError

    @property
    def signatures(self) -> list[str]:
        """The input signatures compiled so far, each with its mode, the compile-time one first."""
        return [
            f"{p.part.key.brief()} ({'train' if key[1] else 'eval'})" if p.part.key is not None else "(any)"
            for key, p in self._programs.items()
        ]

    def summary(self) -> str:
        """The partition's table, the input signatures compiled so far, and once a training
        step has run, its memory per stage, predicted against measured."""
        lines = [self.part.summary(), f"signatures compiled: {len(self._programs)}"]
        lines += [f"  {k}: {sig}" for k, sig in enumerate(self.signatures)]
        lines += self._compiled_lines()
        if self._last_memory is not None:
            lines.append(str(self.memory()))
        return "\n".join(lines)

    def _compiled_lines(self) -> list[str]:
        """``Plan(compile=...)``: per signature, each of this process's stages' compiled
        graphs and seconds (nothing before a stage first runs)."""
        if not self.plan.compile:
            return []
        lines = [f"compiled stages (torch.compile, options {self.plan.compile!r}):"]
        for k, program in enumerate(self._programs.values()):
            for runner in program.runners.values():
                if runner.compiled is not None:
                    lines.append(f"  signature {k}, {runner.compiled.describe()}")
                else:
                    lines.append(f"  signature {k}, stage {runner.index}: eager (checkpoint='selective' runs uncompiled)")
        return lines

    def memory(self) -> MemoryReport:
        """The memory of the last measured training step on this process, one row per
        stage it runs: ``.parameters``, ``.gradients``, ``.buffers``,
        ``.activations_peak`` (measured), ``.predicted_peak`` and ``.measured_peak`` in
        bytes, and on CUDA the allocator's peak; ``print`` it for a table (see
        ``fxpipe.inspection.memory_report``). A step is measured the first time each input
        signature runs with each micro-batch count (its memory repeats after that, and
        measuring costs a hook per saved tensor). Raises RuntimeError before the first
        training step."""
        if self._last_memory is None:
            raise RuntimeError("no training step has run yet: call pipe.step(...) first, then pipe.memory()")
        part, inputs, sizes, step, modules = self._last_memory
        state = {index: held_state(module) for index, module in modules.items()}
        return memory_report(part, sizes, step, state, describe_schedule(self.plan.schedule), inputs)

    def _batch(self, args: tuple, kwargs: dict, target: Any, microbatches: Any, targets: Any, forward_only: bool = False) -> Batch:
        """This process's micro-batches of a call: the batch cut (:meth:`_split`; a forward
        of a batch smaller than ``Plan.microbatches`` runs one micro-batch per sample), or the
        caller's list (:meth:`_listed`). Raises MicrobatchError when both or neither kind is
        given, AttributeChangedError when an attribute of the model changed after compile."""
        self._attributes.check()
        if microbatches is None:
            if targets is not None:
                raise MicrobatchError("targets=[...] goes with microbatches=[...]; a batch's target is passed as target=")
            return self._split(args, kwargs, target, self._forward_count(args, kwargs) if forward_only else self.plan.microbatches)
        if args or kwargs or target is not None:
            raise MicrobatchError(
                "pass either one batch's arguments (cut into Plan.microbatches micro-batches) or microbatches=[...], not "
                "both; with microbatches=, each micro-batch's target goes in targets=[...]"
            )
        return self._listed(microbatches, targets)

    def _forward_count(self, args: tuple, kwargs: dict) -> int:
        """How many micro-batches a forward of this call runs: ``Plan.microbatches``, or as
        many as each replica has samples when that is fewer (eval at batch 1)."""
        n = microbatch.batch_size((args, kwargs))
        if n is None or n >= self.plan.microbatches * self.replicas:
            return self.plan.microbatches
        return max(1, n // self.replicas)

    def _split(self, args: tuple, kwargs: dict, target: Any, m: int) -> Batch:
        """This process's micro-batches of a call (its replica's shard under data parallelism),
        cut into ``m`` per replica, with the compiled stages of the call's signature;
        ``Batch.step`` holds every replica's micro-batches (for the step's loss counts)."""
        microbatch.check_cuttable((args, kwargs), m * self.replicas)
        self._check_inputs(args, kwargs)
        program = self._program(args, kwargs)
        flat = program.part.bind_inputs(args, kwargs)
        total = microbatch.batch_size((flat, target)) or 1
        shards = [(flat, target)]
        if self.replicas > 1:
            pieces, targets, _ = microbatch.split_step(flat, target, self.replicas)
            shards = list(zip(pieces, targets))
        cuts = [microbatch.split_step(f, t, m) for f, t in shards]
        inputs, targets, sizes = cuts[self.replica]
        first = self.replica * len(inputs)
        programs = [program] * len(inputs)
        if program.part.batch_lengths:  # a trace per micro-batch size (it holds the batch)
            programs = [self._program_of_rows(args, kwargs, total, n) for n in sizes]
            _check_same_edges(programs)
        batch = Batch(inputs, targets, sizes, total, first, shards[self.replica][0], (args, kwargs), programs)
        batch.step = [(f, t, n) for cut in cuts for f, t, n in zip(*cut)]
        batch.baked = _baked_batch(program, microbatch.batch_size(flat), sizes)
        return batch

    def _listed(self, entries: Any, targets: Any) -> Batch:
        """The caller's micro-batches (this replica's, under data parallelism), each bound to
        the program of its own input signature (traced once per signature: a length seen
        before costs nothing). ``Batch.total`` is this replica's samples until the step's
        counts are known (:meth:`_listed_counts`). Raises what ``microbatch.listed_calls``
        raises, and MicrobatchError when two micro-batches' programs cut other edges."""
        calls, targets = microbatch.listed_calls(entries, targets, self._model.forward)
        for args, kwargs in calls:
            self._check_inputs(args, kwargs)
        programs = [self._program(args, kwargs) for args, kwargs in calls]
        _check_same_edges(programs)
        inputs = [p.part.bind_inputs(args, kwargs) for p, (args, kwargs) in zip(programs, calls)]
        sizes = [microbatch.batch_size(flat) or 1 for flat in inputs]
        batch = Batch(inputs, targets, sizes, sum(sizes), self.replica * len(inputs), programs=programs, calls=calls)
        batch.step = list(zip(inputs, targets, sizes))
        return batch

    def __call__(self, *args: Any, microbatches: list | None = None, **kwargs: Any) -> Any:
        """Forward through all stages over micro-batches; equals ``model(*args, **kwargs)``.

        ``pipe(microbatches=[...])`` runs the caller's micro-batches instead (each entry a
        tuple of positional arguments, a dict of keyword arguments or a tensor; sizes may
        differ) and returns the list of their outputs. Stages keep autograd history when
        grad mode is on, so ``pipe(x).sum().backward()`` works too (not pipelined; use
        ``step`` for a scheduled backward).
        """
        batch = self._batch(args, kwargs, None, microbatches, None, forward_only=True)
        ctx = StepContext.capture(train=False, microbatch_base=batch.first, random=self._random)
        self._run(batch, ctx)
        return self._output(batch, ctx)

    forward = __call__

    def step(
        self, *args: Any, target: Any = None, loss_fn: Any = None, microbatches: list | None = None, targets: list | None = None, **kwargs: Any
    ) -> torch.Tensor:
        """One training step's forward and backward on the schedule; returns the loss.

        Every parameter's ``.grad`` accumulates exactly what eager
        ``loss_fn(model(*args), target).backward()`` gives on the full batch, however it is
        cut: a token-mean loss (``ignore_index`` padding, class weights), from ``loss_fn`` or
        from the model's own ``labels=`` loss, is the step's sum over the step's count
        (docs/training-loop.md); an input with ``requires_grad`` gets its ``.grad`` as in eager. Without a loss
        function the model's output must be a scalar loss. Gradients are computed under
        ``torch.no_grad()`` too (a step is a backward); the caller's autocast applies to
        every stage and to the loss.

        ``step(microbatches=[...], targets=[...])`` runs the caller's micro-batches, of any
        sizes (no padding), as one step: the loss and gradients are eager's over the same
        micro-batches one after another, a mean loss normalised over the whole step (every
        replica's micro-batches under data parallelism, each replica passing its own list).

        Raises MicrobatchError for more micro-batches than samples, or a list of
        micro-batches that disagree (:func:`fxpipe.batching.microbatch.listed_calls`), PipelineError
        (RankFailedError when distributed) naming the failing stage.
        """
        loss_fn = loss_fn or self.loss_fn
        batch = self._batch(args, kwargs, target, microbatches, targets)
        self._check_loss_call(loss_fn, batch)
        if loss_fn is None:
            self._warn_per_microbatch_terms(batch)
        counts = self._step_counts(loss_fn, batch) if self._holds_last() else None
        loss_of = self._loss_function(loss_fn, batch, counts)
        wanted = batch.input_gradient_leaves()
        ctx = StepContext.capture(train=True, loss_of=loss_of, microbatch_base=batch.first, random=self._random)
        if loss_fn is None and isinstance(counts, loss_scale.StepCounts):  # the model's own loss calls, in its last stage
            ctx.last_stage_scaling = lambda i: counts.scaled(batch.sizes[i])
        runners = batch.program.runners
        # a step's memory repeats (the same code on the same shapes in the same order): it is
        # measured in the first step of each signature (of each listed micro-batch) and micro-batch count only
        measured = (tuple(id(p) for p in batch.programs), len(batch.inputs))
        ctx.memory = StepMemory.start((r.device for r in runners.values()), measured not in self._measured)
        self._run(batch, ctx)
        batch.backward_inputs(wanted)
        if ctx.memory.measured:
            self._measured.add(measured)
            modules = {s: r.module for s, r in runners.items()}
            self._last_memory = (*batch.largest(), batch.sizes, ctx.memory.finish(modules, (r.device for r in runners.values())), modules)
        return self._step_loss(ctx)

    def _check_loss_call(self, loss_fn: Any, batch: Batch) -> None:
        """Before any stage runs: ``loss_fn`` callable, and given a target when it needs one
        (a torch loss always does; another function is asked on the call's output as meta
        tensors, from a fake run of the model). Raises LossFunctionError saying what to pass."""
        if loss_fn is None:
            return
        name = microbatch.loss_name(loss_fn)
        if not callable(loss_fn):
            raise LossFunctionError(
                f"loss_fn = {loss_fn!r} ({type(loss_fn).__name__}) is not callable: pass a function of (output, target) "
                "returning a scalar tensor, e.g. loss_fn=nn.CrossEntropyLoss()"
            )
        if any(t is not None for t in batch.targets):
            return
        fix = (
            f"pipe.step got no target, and loss_fn ({name}) needs one: pass target=t (one row per input sample), "
            "or targets=[...] with microbatches=[...]"
        )
        if isinstance(loss_fn, nn.modules.loss._Loss):
            raise LossFunctionError(fix)
        try:
            output = self._output_like(*(batch.calls[0] if batch.listed else batch.call))
        except Exception:  # noqa: BLE001 - a model fake tensors cannot run: its first micro-batch will say
            return
        try:
            loss_fn(output, None)
        except Exception as err:  # noqa: BLE001 - whatever the loss raises on a None target
            cause = (str(err).strip().splitlines() or [""])[0]
            if "None" in cause:  # the target it was given, not meta tensors (.item()) or the output, is at fault
                raise LossFunctionError(f"{fix} ({type(err).__name__}: {cause})") from err

    def _holds_last(self) -> bool:
        """Whether this process runs the last stage (where the loss is computed)."""
        return True

    def _step_counts(self, loss_fn: Any, batch: Batch) -> loss_scale.StepCounts | loss_scale.Counter | None:
        """How this step's mean losses are normalised (``fxpipe.batching.loss_scale.step_loss``): its
        counts, counted now (a listed step, or a model's own loss), or a counter of
        ``loss_fn``'s calls run on the first micro-batch's output; None when the calls
        cannot be counted (a warning says so, once)."""
        if batch.listed:
            return self._listed_counts(loss_fn, batch)
        if loss_fn is None:
            return self._model_loss_counts(batch)

        def count(template: Any, rows: int) -> loss_scale.StepCounts | None:
            cases = ((loss_scale.meta_like(template, rows, n), t) for _, t, n in batch.step)
            return self._counted(lambda: loss_scale.count_loss_fn(loss_fn, cases, batch.total))

        return count

    def _counted(self, count: Callable[[], loss_scale.StepCounts | None]) -> loss_scale.StepCounts | None:
        """``count()``, or None with a warning (once) when it fails."""
        try:
            return count()
        except Exception as err:  # noqa: BLE001 - any failure: the per-sample rule, said once
            self._warn_normalisation(err)
            return None

    def _model_loss_counts(self, batch: Batch) -> loss_scale.StepCounts | None:
        """The counts of the loss calls a model computing its own loss makes in its last
        stage, over ``batch.step``; None (with a warning, once) when they cannot be known."""
        # every entry of a cut batch's step runs its one program; a listed step's, each its own
        losses = [p.part.model_losses for p in batch.programs] if batch.listed else [batch.program.part.model_losses] * len(batch.step)
        if any(loss is None for loss in losses):
            return None
        return self._counted(lambda: loss_scale.add_counts((c.count(f) for c, (f, _, _) in zip(losses, batch.step)), batch.total))

    def _listed_counts(self, loss_fn: Any, batch: Batch) -> loss_scale.StepCounts | None:
        """A listed step's counts: this replica's micro-batches counted before they run
        (``loss_fn`` on each one's output as meta tensors, from a fake run of the model per
        input signature), then added over the replicas (:meth:`_over_replicas`, which also
        makes ``batch.total`` the step's samples)."""
        if loss_fn is None:
            local = self._model_loss_counts(batch)
        else:
            cases = ((self._output_like(args, kwargs), t) for (args, kwargs), t in zip(batch.calls, batch.targets))
            local = self._counted(lambda: loss_scale.count_loss_fn(loss_fn, cases, batch.total))
        batch.total, counts = self._over_replicas(batch.total, local)
        if counts is None and local is not None:
            self._warn_normalisation(RuntimeError("another replica's micro-batches could not be counted"))
        return counts

    def _output_like(self, args: tuple, kwargs: dict) -> Any:
        """The model's output for a call, as meta tensors; cached per input shapes and mode."""
        key = (microbatch.signature((args, kwargs)), self.training)
        if key not in self._outputs_like:
            self._outputs_like[key] = self._compiler.output_like(self._model, args, kwargs)
        return self._outputs_like[key]

    def _over_replicas(self, total: int, counts: loss_scale.StepCounts | None) -> tuple[int, loss_scale.StepCounts | None]:
        """The step's samples and counts from this replica's (one process: its own)."""
        return total, counts

    def _warn_per_microbatch_terms(self, batch: Batch) -> None:
        """Warn once when the model's own loss adds terms computed per micro-batch (a MoE
        router's load balancing): they are not the full batch's (docs/training-loop.md)."""
        terms = sorted({t for p in batch.programs for t in p.part.loss_terms})
        if not terms or len(batch.inputs) * self.replicas < 2 or getattr(self, "_terms_warned", False):
            return
        self._terms_warned = True
        names = ", ".join(repr(t) for t in terms)
        warnings.warn(
            f"fxpipe: {type(self._model).__name__}'s own loss adds {names} beside its token-mean loss; that term is "
            "computed per micro-batch, over the micro-batch's own statistics, and weighted by the micro-batch's share "
            "of the samples: a term that is not a mean over tokens or samples (MoE load balancing) does not add up to "
            "its full-batch value, so the step's loss and gradients equal eager's accumulated over the same "
            "micro-batches, not one full-batch step. See docs/training-loop.md, 'Loss terms computed per micro-batch'",
            stacklevel=3,
        )

    def _warn_normalisation(self, err: BaseException) -> None:
        if not getattr(self, "_normalisation_warned", False):
            self._normalisation_warned = True
            warnings.warn(loss_scale.fallback_message(err), stacklevel=4)

    def _loss_function(self, loss_fn: Any, batch: Batch, counts: Any) -> Any:
        """``loss_of(i, output)`` for this step: micro-batch i's loss term, normalised as
        ``counts`` (from :meth:`_step_counts`) says."""
        return loss_scale.step_loss(loss_fn, batch.build_output, batch.targets, batch.sizes, batch.total, self.replicas, counts)

    def _merged(self, batch: Batch, outputs: list[Any]) -> Any:
        """The model's output for the whole batch from the last stage's per micro-batch:
        batched tensors concatenated, the others merged as ``Plan.output_merge`` says
        (which outputs are batched is decided once per input structure, on fake tensors).
        A listed call's outputs stay a list, one per micro-batch."""
        values = [batch.build_output(i, out) for i, out in enumerate(outputs)]
        if batch.listed:
            return values
        if len(values) == 1 and not self.plan.output_merge:
            return values[0]
        key = microbatch.structure(batch.whole)
        if key not in self._batched:
            args, kwargs = batch.call
            if batch.program.part.batch_lengths:  # its trace holds a micro-batch's size: ask at that size
                args, kwargs = microbatch.first_rows((args, kwargs), microbatch.batch_size((args, kwargs)), batch.sizes[0])
            self._batched[key] = self._compiler.batched_outputs(self._model, args, kwargs, batch.program.part)
            microbatch.check_output_merge(self.plan.output_merge, self._batched[key])
        once = microbatch.unbatched_paths(values[0], batch.program.part.output_inputs, batch.whole)
        return microbatch.merge(
            values, batch.sizes, self._batched[key], self.plan.output_merge, once, self._own_loss_weights(batch),
            batch_lists=bool(batch.program.part.batch_lengths),
        )

    def _own_loss_weights(self, batch: Batch) -> list[float] | None:
        """Each micro-batch's weight in the model's own loss as ``step`` weighs it: its share
        of the step's count for one mean-reduced loss call (token counts: padding and
        ``ignore_index`` left out), else its share of the samples. None without such a loss."""
        losses = batch.program.part.model_losses
        if losses is None:
            return None
        by_samples = [n / sum(batch.sizes) for n in batch.sizes]
        try:
            parts = [losses.count(flat) for flat in batch.inputs]
        except Exception:  # noqa: BLE001 - not countable: the samples' shares, as step() falls back to
            return by_samples
        if batch.program.part.loss_terms or any(reductions != ["mean"] for reductions, _ in parts):
            return by_samples
        total = sum(counts[0] for _, counts in parts)
        return [counts[0] / total for _, counts in parts] if total > 0 else by_samples

    def _run(self, batch: Batch, ctx: StepContext) -> None:
        """Execute the batch; a failure of micro-batches whose sizes the program did not
        trace (``Batch.baked``) is a MicrobatchError saying so, with the stage's error."""
        try:
            self._execute(batch, ctx)
        except Exception as err:
            if not batch.baked:
                raise
            raise MicrobatchError(f"{batch.baked}. A stage failed on them: {err}") from err

    def _execute(self, batch: Batch, ctx: StepContext) -> None:
        raise NotImplementedError

    def _output(self, batch: Batch, ctx: StepContext) -> Any:
        raise NotImplementedError

    def _step_loss(self, ctx: StepContext) -> torch.Tensor:
        raise NotImplementedError

    def _after_load(self) -> None:
        """Called after ``load_state_dict`` wrote new values."""

    def close(self) -> None:
        """Join the threads this pipeline started; no communication is left pending."""
        raise NotImplementedError

    def __enter__(self) -> PipelineBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ module-like API
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters under the model's names (this process's share when distributed);
        a tied weight once, under its first name."""
        yield from self._params.items()

    def state_dict(self) -> OrderedDict[str, torch.Tensor]:
        """The model's state_dict keys held here (tied weights under every name), detached."""
        return OrderedDict((k, v.detach()) for k, v in self._state.items())

    def load_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load a state dict saved from the model or from a pipeline of it.

        With ``strict``, raises KeyError naming the keys held here that ``state`` lacks and,
        when this process holds the whole model, the keys of ``state`` it does not know.
        """
        missing = [k for k in self._state if k not in state]
        unexpected = [] if self._partial_state else [k for k in state if k not in self._state]
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
        mismatched = [
            f"{k}: {_shape_of(state[k])} given, {list(self._state[k].shape)} in the model"
            for k in self._state if k in state and _shape_of(state[k]) != list(self._state[k].shape)
        ]
        if mismatched:
            raise ValueError(
                f"load_state_dict: {len(mismatched)} tensor(s) of another shape ({'; '.join(mismatched[:5])}): "
                "load a state dict saved from this model's configuration"
            )
        with torch.no_grad():
            for key, tensor in self._state.items():
                if key in state:
                    self._load_value(tensor, state[key])
        self._after_load()

    def _load_value(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        """Copy the whole tensor ``value`` into the held ``tensor``."""
        tensor.copy_(value.to(tensor.device))

    def sharded_state_dict(self) -> OrderedDict[str, torch.Tensor]:
        """The state ``torch.distributed.checkpoint`` saves and loads: the model's
        state_dict keys held here, detached tensors sharing storage with the pipeline's
        (``dcp.load`` fills the pipeline in place); under ``plan.fsdp`` this rank's shards
        (DTensors), so each rank writes and reads only its part, and a checkpoint loads
        into any layout of stages and replicas."""
        return OrderedDict((k, v.detach()) for k, v in self._state.items())

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None
    ) -> torch.Tensor:
        """Clip every parameter's gradient by the norm over the whole model, in place.

        The norm is taken over all parameters of the model: every stage, on every rank
        under torchrun, a weight tied across stages counted once, data-parallel replicas
        (which hold equal gradients after the step) counted once. Returns the total norm
        (the same tensor value on every rank), as ``torch.nn.utils.clip_grad_norm_`` on the
        eager model does; ``norm_type`` may be ``inf``. Raises RuntimeError when the norm is
        not finite and ``error_if_nonfinite``.
        """
        norm_type = float(norm_type)
        counted = self._counted_grads()
        if counted:
            local = torch.nn.utils.get_total_norm(counted, norm_type, foreach=foreach).to(torch.float64)
        else:
            local = torch.zeros((), dtype=torch.float64)
        total = self._global_norm(local, norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is {float(total)}, so they cannot be clipped; "
                "pass error_if_nonfinite=False to clip anyway (Plan(check_finite=True) names the first stage that "
                "produced a non-finite value)"
            )
        held = [p for module in self._modules for p in module.parameters() if p.grad is not None]
        dtype = held[0].grad.dtype if held else (counted[0].dtype if counted else torch.float32)
        if held:
            torch.nn.utils.clip_grads_with_norm_(list({id(p): p for p in held}.values()), max_norm, total, foreach=foreach)
        return total.to(dtype)

    def _counted_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients this process adds to the global norm."""
        return list(self._params.values())

    def _counted_grads(self) -> list[torch.Tensor]:
        """The gradients this process adds to the global norm (of :meth:`_counted_parameters`)."""
        return [p.grad for p in self._counted_parameters() if p.grad is not None]

    def _global_norm(self, local: torch.Tensor, norm_type: float) -> torch.Tensor:
        """The norm over every process's share, from this one's (float64)."""
        return local

    def zero_grad(self, set_to_none: bool = True) -> None:
        for module in self._modules:
            module.zero_grad(set_to_none=set_to_none)

    def train(self, mode: bool = True) -> PipelineBase:
        """Set train/eval mode on every stage, as ``model.train(mode)`` does eagerly."""
        self.training = mode
        self._model.train(mode)
        for module in self._modules:
            module.train(mode)
        for program in self._programs.values():  # later signatures' stage modules share submodules
            program.train(mode)
        return self
