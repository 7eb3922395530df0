"""Calls to a chosen Python function handed to the tracer, however the caller reaches it.

fx records calls to modules and to functions it was told about before tracing
(``fx.wrap``); any other function simply runs and fx traces its body. When fx cannot trace
a function's body, the fx frontend makes *that function* opaque: every later call to it in
the trace becomes one graph node. Callers reach a function through a module global, a
method, a local variable, a dict of implementations (HuggingFace's attention functions),
a decorator's closure; rather than patching each reference, :class:`Interceptor` swaps the
function object's ``__code__`` for a trampoline with the same parameters that hands the
call to the tracer, and puts the code back when the trace ends. Other threads, and the
tracer's own fake runs of the callee (:meth:`Interceptor.suspended`), reach an untouched
copy of the function.

:func:`function_of` finds the function object a traceback frame runs. Writes no
``node.meta`` keys.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

# a call to an intercepted function: (function, positional args, keyword args) -> result
Handler = Callable[[types.FunctionType, tuple, dict], Any]

_MARK = "__fxpipe_dispatch__"
_COPY = "__fxpipe_original__"  # marks the interceptor's own copies of intercepted functions
_NOT_PLAIN = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


def interceptable(fn: Any) -> bool:
    """Whether calls to ``fn`` can be intercepted: a plain Python function (not a generator,
    coroutine, lambda or comprehension, not a dunder method)."""
    if not isinstance(fn, types.FunctionType):
        return False
    name = fn.__code__.co_name
    return not (fn.__code__.co_flags & _NOT_PLAIN or name.startswith("<") or (name.startswith("__") and name.endswith("__")))


def function_of(frame: types.FrameType) -> types.FunctionType | None:
    """The function object whose call ``frame`` runs, or None when it cannot be told
    (several closures of one code whose cells the frame does not pin down)."""
    code = frame.f_code
    found = [f for f in gc.get_referrers(code) if isinstance(f, types.FunctionType) and f.__code__ is code and not hasattr(f, _COPY)]
    if len(found) > 1 and code.co_freevars:
        found = [f for f in found if _closure_matches(f, frame)]
    return found[0] if len(found) == 1 else None


def _closure_matches(fn: types.FunctionType, frame: types.FrameType) -> bool:
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell pins nothing down
            continue
        if name in frame.f_locals and frame.f_locals[name] is not contents:
            return False
    return True


class Interceptor:
    """Functions whose calls go to ``handler`` on this thread while the interceptor is open.

    ``with Interceptor(handler) as calls:``; ``calls.intercept(fn)`` swaps ``fn``'s code for
    a trampoline; on exit every function gets its own code back (also on error). A call
    from another thread, or inside ``calls.suspended()``, runs the original function.
    """

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.originals: dict[types.FunctionType, types.FunctionType] = {}  # fn -> copy with the original code
        self._codes: dict[types.FunctionType, types.CodeType] = {}
        self._thread = threading.get_ident()
        self._suspended = 0

    def __enter__(self) -> Interceptor:
        return self

    def __exit__(self, *exc: Any) -> None:
        for fn, code in self._codes.items():
            fn.__code__ = code
        self._codes.clear()
        self.originals.clear()

    def intercepted(self, fn: Any) -> bool:
        return fn in self._codes

    def intercept(self, fn: types.FunctionType) -> None:
        """Send the calls of ``fn`` to the handler from now on. Raises ValueError when ``fn``
        cannot be intercepted (see :func:`interceptable`)."""
        if fn in self._codes:
            return
        if not interceptable(fn):
            raise ValueError(f"cannot intercept {fn!r}: not a plain Python function")
        code = fn.__code__
        copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        copy.__kwdefaults__ = fn.__kwdefaults__
        copy.__qualname__, copy.__module__ = fn.__qualname__, fn.__module__
        copy.__dict__.update(fn.__dict__)
        setattr(copy, _COPY, True)
        self.originals[fn] = copy
        self._codes[fn] = code
        fn.__code__ = _trampoline(code, lambda args, kwargs: self._dispatch(fn, args, kwargs))

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Calls inside run the original functions (the tracer's fake run of a callee)."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def _dispatch(self, fn: types.FunctionType, args: tuple, kwargs: dict) -> Any:
        if self._suspended or threading.get_ident() != self._thread or fn not in self._codes:
            return self.originals[fn](*args, **kwargs)
        return self.handler(fn, args, kwargs)


def _trampoline(code: types.CodeType, dispatch: Callable[[tuple, dict], Any]) -> types.CodeType:
    """A code object with ``code``'s parameters and free-variable count whose body is
    ``return dispatch(args, kwargs)`` (the call as it was made, defaults applied)."""
    names = code.co_varnames
    positional = list(names[: code.co_argcount])
    keyword_only = list(names[code.co_argcount : code.co_argcount + code.co_kwonlyargcount])
    rest = code.co_argcount + code.co_kwonlyargcount
    star = names[rest] if code.co_flags & inspect.CO_VARARGS else None
    starstar = names[rest + (star is not None)] if code.co_flags & inspect.CO_VARKEYWORDS else None
    params = positional[: code.co_posonlyargcount] + (["/"] if code.co_posonlyargcount else []) + positional[code.co_posonlyargcount :]
    params += [f"*{star}"] if star else (["*"] if keyword_only else [])
    params += keyword_only + ([f"**{starstar}"] if starstar else [])
    args = "(" + "".join(f"{p}, " for p in positional) + (f"*{star}," if star else "") + ")"
    kwargs = "{" + "".join(f"{k!r}: {k}, " for k in keyword_only) + (f"**{starstar}" if starstar else "") + "}"
    free = [f"_fxpipe_free{k}" for k in range(len(code.co_freevars))]
    source = (
        "def _fxpipe_factory():\n"
        + (f"    {' = '.join(free)} = None\n" if free else "")
        + f"    def _fxpipe_trampoline({', '.join(params)}):\n"
        + f"        return {_MARK!r}({args}, {kwargs})\n"
        + (f"        {', '.join(free)}\n" if free else "")  # unreachable: only makes them free variables
        + "    return _fxpipe_trampoline\n"
    )
    namespace: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)  # "'str' object is not callable": replaced below
        exec(compile(source, f"<fxpipe: opaque call to {code.co_name}>", "exec"), namespace)
    inner = namespace["_fxpipe_factory"]().__code__
    consts = tuple(dispatch if c == _MARK else c for c in inner.co_consts)
    names = {"co_name": code.co_name, **({"co_qualname": code.co_qualname} if hasattr(code, "co_qualname") else {})}
    return inner.replace(co_consts=consts, **names)
