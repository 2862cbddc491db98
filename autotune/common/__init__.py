"""The vocabulary every layer shares, and the small helpers under everything else.

`events` (the loop's events and the one picture of the loop), `actions` and `snapshot` (what a policy is
shown and what it may ask for), `oom` (what counts as an out-of-memory error; the errors a step raises),
`notices` (what the user must know, on stderr), `units` (sizes read and written), `files` (regular files
only), `validate` (argument checks), `progress` (where a run is), `batching` (splitting a batch by sample),
`stale` and `shared_memory` (files named after a process, /dev/shm room), `model_blocks` (a model's
repeated blocks), `options` (options records: a field that carries its doc, built from keywords by name).

Owns the names every other folder speaks in. Imports nothing of autotune's outside this folder: it is the
bottom layer of the contract in pyproject.toml (`[tool.importlinter]`); any folder may import it.
Touches nothing itself: the folder's modules say what each touches.
"""
