"""Every ``node.meta`` key fxpipe's passes write, and the constants they share.

One home per fact: a pass reads and writes these names only, and documents which at the
top of its module. Nothing here imports anything but the standard library.
"""

from __future__ import annotations

# written by the trace pass
MODULE_PATH = "module_path"  # qualified name of the innermost module whose forward made the node
CUSTOM = "custom"  # torch.fx.traceback annotations; device_guard tags live under TAG_KEY
TAG_KEY = "fxpipe_device"  # node.meta[CUSTOM][TAG_KEY]: the device_guard tag
# written by shape propagation
VAL = "val"  # the node's value on fake tensors (shape, dtype, requires_grad)
# written by the annotate pass (or split="auto")
STAGE = "stage"  # int, 0-based, non-decreasing along every edge
REASON = "stage_reason"  # why the node is in its stage, for explain()
# written by the cost pass / fxpipe.profile
COST = "cost"  # passes.cost.NodeCost
MEASURED = "measured_time"  # a measured (forward, backward) time from fxpipe.profile
# written by the partition pass on send/recv nodes
EDGE = "edge"  # passes.partition.Edge

# the node kinds that compute (placeholders, get_attr and output do not)
COMPUTE_OPS = ("call_module", "call_function", "call_method")
