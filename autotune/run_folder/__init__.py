"""The run folder: checkpoints, their checksums, the lock, and the run's identity.

`checkpoint` (when checkpoints are due, failed writes, resume), `checkpoint_files` (atomic and background
writes, the last K kept), `checkpoint_format` (the nested, versioned layout and `migrate`), `checksums`,
`sharded_checkpoint` (a sharded checkpoint's folder), `run_lock` (one writer per folder), `same_run` (the
right run's checkpoints), `rng` (the random states saved and restored).

Owns what is written to and trusted from `run_dir`, except the journal (`observe`). May import `step`,
`stops` and everything below; the Tuner, the data pipeline and the front door import it.
Touches nothing itself: the folder's modules say what each touches.
"""
