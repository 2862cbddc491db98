"""What a run tells: the run log and its readers.

`records` (the registry of journal record kinds and their fields), `journal` (events.jsonl, steps.jsonl, the
one JSONL reader), `tensorboard_log`, `report` and `report_plot` (`autotune report`).

Owns the run's record. May import only `common`; everything above may import it. Never imports torch at
module level: `autotune report` reads a journal without it.
Touches nothing itself: the folder's modules say what each touches.
"""
