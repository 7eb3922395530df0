"""The stage runtime both executors share.

- :mod:`~fxpipe.runtime.context`: what a call asks of every stage (train or not, the
  caller's grad mode and autocast, the loss), captured once per call.
- :mod:`~fxpipe.runtime.runner`: :class:`StageRunner`, one stage's forward and backward for
  one micro-batch; it returns the values to hand on instead of sending them.
- :mod:`~fxpipe.runtime.interpret`: the action loop both executors run (the one F/B/I/W
  dispatch), over a ``Transport`` that says how values move, with hooks around actions.
- :mod:`~fxpipe.runtime.local`: the local executor, threads and mailboxes around the loop.
- :mod:`~fxpipe.runtime.pipeline_base`: :class:`PipelineBase`, the module-like API, micro-batch
  split and program cache of both pipelines.
- :mod:`~fxpipe.runtime.streams`: CUDA streams and events on hand-offs (no-ops on CPU).
- :mod:`~fxpipe.runtime.placement`: stage copies on their devices, tied weights, the model's
  own parameter names.
- :mod:`~fxpipe.runtime.local_pipeline`: :class:`Pipeline`, the one-process pipeline.

The distributed executor (``fxpipe.distributed.executor``) runs the same loop with
point-to-point communication. Nothing here imports a compiler pass.
"""
