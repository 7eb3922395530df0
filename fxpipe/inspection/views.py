"""What every pipeline shows of itself, local or distributed: the partition and timelines.

Both ``Pipeline`` and ``DistributedPipeline`` mix this in; it reads only ``self.part``
(the Partitioned), ``self._last_events`` and ``self.num_workers``, so neither pipeline
imports the other.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from torch import nn

from fxpipe.inspection.timeline import Timeline


class PipelineViews:
    """Inspection and module-like conveniences shared by the pipelines."""

    part: object
    _last_events: list
    num_workers: int

    @property
    def graph(self):
        """The whole partitioned program: one fx.Graph with explicit send/recv nodes."""
        return self.part.graph

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def eval(self):
        return self.train(False)

    def summary(self) -> str:
        return self.part.summary()

    def explain(self) -> str:
        return self.part.explain()

    def to_dot(self, level: str = "auto") -> str:
        return self.part.to_dot(level)

    def simulate(self, microbatches: int | None = None):
        """Predicted Timeline of one step under the schedule; see ``Partitioned.simulate``."""
        return self.part.simulate(microbatches)

    def draw(self, path: str | Path, level: str = "auto", renderer: str = "auto") -> Path:
        """Writes the partition drawing to ``path``; see ``Partitioned.draw``."""
        return self.part.draw(path, level=level, renderer=renderer)

    def timeline(self):
        """Measured Timeline of the last call or step, every worker of this process."""
        if not self._last_events:
            raise RuntimeError("no step has run yet: call pipe.step(...) or pipe(...) first")
        return Timeline(self._last_events, num_workers=self.num_workers, kind="measured", deps=self.part.deps)
