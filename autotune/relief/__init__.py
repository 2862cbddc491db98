"""Memory reliefs that change the model: activation checkpointing, channel pruning, one file each.

The ladder that carries them out, undoes a failed one and replays them on resume is a Tuner room
(`autotune.tuning.relief_ladder`), the only caller; the autocast relief is the step's precision
(`autotune.step.precision`). Each file touches what its docstring says.

Owns the model transformations; may import only `common`; the ladder imports it.
"""
