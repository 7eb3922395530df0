"""Training semantics over micro-batches: how a call is cut into micro-batches, how their
outputs merge back, and how a step's losses are normalised so that they equal the full
batch's."""
