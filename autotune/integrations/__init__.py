"""autotune inside trainers you already use: `transformers.AutoTuneTrainer`, `lightning`.

Each is thin: the batch a trainer hands to its training step goes through the same
`Tuner.accumulate` (split, retry on OOM, accumulate) that `AutoTrainer` and custom loops use;
the trainer keeps its optimizer, schedule, precision, logging and checkpoints.

Owns nothing. Each integration owns its framework's side and touches the Tuner only through its
host face (tests/test_faces.py). The top layer but for the command line: it may import the Tuner and
everything below; nothing in autotune imports it (your code does).
"""
