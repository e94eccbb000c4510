"""Training on top of the engine: the training loop (eager, layerwise, ``full_iteration`` and
one-graph runners behind one protocol), the reference model's trainer, data, and the processes
that run the ranks (spawn, supervision, interrupts)."""
