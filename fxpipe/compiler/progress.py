"""One line of progress on stderr for a compile that takes a while; nothing below 2 s.

The compiler names each phase it enters (``phase``) and passes a ``nodes(done, total)``
callback to the passes that walk the graph. A quiet thread redraws one line on a terminal
once the compile has run ``after`` seconds (``fxpipe: compiling GPT2LMHeadModel: costs
3200/10000 nodes, 4.10 s``); elsewhere (logs, CI) one summary line with each phase's time
is written at the end, and only for a compile that took ``after`` seconds or more. A
compile that fails writes nothing more (a terminal's line is erased): the error says what
went wrong, and a note on it, shown with its traceback, says in which phase and when.
``FXPIPE_PROGRESS=0`` in the environment silences both.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import TextIO

from fxpipe.inspection import format as fmt

QUIET_BELOW = 2.0  # seconds: a compile shorter than this prints nothing


class Progress:
    """Progress of one compile of ``what`` (a model name), written to ``stream`` (stderr).

    Use as a context manager; ``tty`` overrides whether ``stream`` is a terminal.
    """

    def __init__(self, what: str, stream: TextIO | None = None, after: float = QUIET_BELOW, every: float = 0.5, tty: bool | None = None) -> None:
        self.what = what
        self.stream = stream if stream is not None else sys.stderr
        self.after = after
        self.every = every
        self.enabled = os.environ.get("FXPIPE_PROGRESS", "1") != "0"
        self.tty = tty if tty is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self._phases: list[tuple[str, float]] = []
        self._done = 0
        self._total = 0
        self._shown = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = 0.0

    def __enter__(self) -> Progress:
        self._start = time.perf_counter()
        if self.enabled and self.tty:
            self._thread = threading.Thread(target=self._redraw, name="fxpipe-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind, value, traceback) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        elapsed = time.perf_counter() - self._start
        if value is not None:
            # the error reports the failure; where the compile was goes with its traceback
            value.add_note(f"fxpipe: compiling {self.what} failed in {self._phase_name()} after {fmt.seconds(elapsed)}")
            if self._shown and self.tty:
                self.stream.write("\r" + " " * 79 + "\r")
                self.stream.flush()
            return
        if not self.enabled or elapsed < self.after and not self._shown:
            return
        self._write(f"fxpipe: compiled {self.what} in {fmt.seconds(elapsed)} ({self._breakdown(elapsed)})", final=True)

    def phase(self, name: str) -> None:
        """The compile enters phase ``name`` (trace, shapes and costs, split, partition...)."""
        with self._lock:
            self._phases.append((name, time.perf_counter()))
            self._done = self._total = 0

    def nodes(self, done: int, total: int) -> None:
        """How far the current phase got through the graph (a pass's progress callback)."""
        self._done, self._total = done, total

    def _phase_name(self) -> str:
        return self._phases[-1][0] if self._phases else "start-up"

    def phase_seconds(self, until: float | None = None) -> dict[str, float]:
        """Each phase's seconds in the order entered, the last one's up to ``until`` (a
        ``time.perf_counter()`` reading; default: now)."""
        ends = [at for _, at in self._phases[1:]] + [time.perf_counter() if until is None else until]
        return {name: end - at for (name, at), end in zip(self._phases, ends)}

    def _breakdown(self, elapsed: float) -> str:
        seconds = self.phase_seconds(self._start + elapsed)
        return ", ".join(f"{name} {fmt.seconds(value)}" for name, value in seconds.items())

    def _redraw(self) -> None:
        while not self._stop.wait(self.every):
            elapsed = time.perf_counter() - self._start
            if elapsed < self.after:
                continue
            with self._lock:
                where = self._phase_name()
                if self._total:
                    where += f" {self._done}/{self._total} nodes"
            self._write(f"fxpipe: compiling {self.what}: {where}, {fmt.seconds(elapsed)}", final=False)

    def _write(self, line: str, final: bool) -> None:
        if self.tty:
            # one line, redrawn in place; the final one ends it
            self.stream.write("\r" + line.ljust(79) + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self._shown = True
