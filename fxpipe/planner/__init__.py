"""The planner: predictions made before anything runs on the hardware. The cost model and
its calibration from measured nodes, per-stage time and memory estimates, the simulated
timeline of a schedule, ``split="auto"``, and ``checkpoint="auto"`` / ``offload="auto"``.
It imports no runtime."""
