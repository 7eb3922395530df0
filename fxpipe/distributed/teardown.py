"""Ending a rank's process when one of fxpipe's threads is still blocked in torch's C++.

After a distributed failure, a receive posted to a peer that failed never completes, and
the thread waiting on it (a watchdog's ``fxpipe-comm-wait``, or a heartbeat inside a call
to a stopped store host) stays blocked in C++ with the GIL released. If it wakes while the
interpreter finalises (the peer's process ends, its connection drops, the wait returns
with an error), CPython 3.11 ends the thread with ``pthread_exit``, whose forced unwinding
through pybind11's ``gil_scoped_release`` destructor (noexcept) calls ``std::terminate``:
"terminate called without an active exception", exit code 134 (SIGABRT). A 2-rank gloo
script whose daemon thread waits on an ``irecv`` from a live peer when the script ends
aborts in every run; the same script without the thread exits 0.

Such a thread cannot be woken: gloo completes a send or receive only inside ``wait()``
(``is_completed()`` stays False until then), and neither ``ProcessGroup.abort()`` nor
``destroy_process_group()`` ends a pending wait. So fxpipe joins its threads at exit
(:func:`retire`) and, when one is still blocked or a distributed failure happened in this
process (:func:`note_failure`), ends the process without finalising the interpreter
(:func:`end_at_exit`): standard streams and logging flushed, exit status as Python would
give it (1 after an uncaught exception, else 0). Skipping the teardown after a failure
also ends the rank promptly: finalising torch's modules took 4-5 s on a loaded 2-core
machine. The atexit handlers registered before fxpipe's (those of modules imported before
fxpipe) do not run then.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref

_BLOCKED: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_FAILED: list[str] = []  # the first distributed failure this process saw


def note_failure(message: str) -> None:
    """Remember that a distributed failure happened in this process: at exit it ends
    without interpreter teardown (see the module docstring)."""
    if not _FAILED:
        _FAILED.append(message)


def retire(thread: threading.Thread | None, timeout: float) -> bool:
    """Join ``thread`` for up to ``timeout`` seconds; True when it ended (or is None or the
    calling thread). A thread still running is remembered for :func:`end_if_blocked`."""
    if thread is None or thread is threading.current_thread():
        return True
    thread.join(timeout)
    if thread.is_alive():
        _BLOCKED.add(thread)
        return False
    return True


def blocked() -> list[threading.Thread]:
    """fxpipe's threads that did not end when retired and are still running."""
    return [thread for thread in _BLOCKED if thread.is_alive()]


def exit_status() -> int:
    """The status Python is about to exit with, as far as an atexit handler can tell: 1
    after an uncaught exception (``sys.last_value``), else 0 (a ``sys.exit(n)`` code is not
    visible to atexit handlers)."""
    return 1 if getattr(sys, "last_value", None) is not None else 0


@atexit.register
def end_at_exit() -> None:
    """At exit: end the process now, without finalising the interpreter, when a thread of
    fxpipe's is still blocked in C++ or a distributed failure happened (see the module
    docstring); otherwise return. Registered when this module is imported, before the
    modules that retire threads register theirs, so it runs after them."""
    if not _FAILED and not blocked():
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream: nothing more to write
            pass
    os._exit(exit_status())
