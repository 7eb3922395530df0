"""Every ``node.meta`` key fxpipe's passes write, and the constants they share.

One home per fact: a pass reads and writes these names only, and documents which at the
top of its module. Nothing here imports anything but the standard library.
"""

from __future__ import annotations

# written by the trace pass
MODULE_PATH = "module_path"  # qualified name of the innermost module whose forward made the node
CUSTOM = "custom"  # torch.fx.traceback annotations; device_guard tags live under TAG_KEY
TAG_KEY = "fxpipe_device"  # node.meta[CUSTOM][TAG_KEY]: the device_guard tag
TAG_SOURCE = "fxpipe_device_source"  # node.meta[CUSTOM][TAG_SOURCE]: what set a tag that no device_guard set (a move in forward)
OPAQUE = "opaque"  # passes.opaque.OpaqueCallee on a call the fx frontend runs whole (fx could not trace into it)
OPAQUE_DRAWS = "opaque_draws"  # bool on such a call: whether it drew random numbers in its fake run
BLOCK = "block"  # str: the module path of the repeated block (a layer traced once, stamped for the others) the node is in
# written by shape propagation
VAL = "val"  # the node's value on fake tensors (shape, dtype, requires_grad)
REAL_RUN = "real_run"  # str on a node that could not run on fake tensors and ran for real at compile time: why
# written by the annotate pass
STAGE = "stage"  # int, 0-based, non-decreasing along every edge
REASON = "stage_reason"  # why the node is in its stage, for explain()
# written by the cost pass / fxpipe.profile
COST = "cost"  # passes.node_costs.NodeCost
MEASURED = "measured_time"  # a measured (forward, backward) time from fxpipe.profile
# written by the partition pass on send/recv nodes
EDGE = "edge"  # passes.partition.Edge
# written by the rng pass (number_random_ops) on the whole graph, before partitioning
RNG_KEY = "rng_key"  # int: the random node's position among the graph's random nodes

# the placeholder a stage with random nodes takes last: the seed of one (step, micro-batch)
RNG_SEED = "fxpipe_rng_seed"

# the node kinds that compute (placeholders, get_attr and output do not)
COMPUTE_OPS = ("call_module", "call_function", "call_method")
