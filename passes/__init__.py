"""fxpipe's compiler passes: pure functions over torch.fx graphs.

Each pass documents the ``node.meta`` keys it reads and writes at the top of its module.
Passes import torch and networkx, never fxpipe's executors or torch.distributed.
"""
