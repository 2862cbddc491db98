"""The Tuner's rooms: what one batch goes through, and what the Tuner is built from.

`batch` (one batch until it is trained: attempts, the agreement), `recovery` (after an OOM), `reactions`
(what follows a batch: its figures, the policies, reliefs carried out), `relief_ladder` (carrying reliefs
out, undoing a failed one, replay on resume), `monitor_link` (the trainer's side of the monitor process),
`run` (what the rooms share), `host_face` (the Protocols between a host and its Tuner), `options` (the
Tuner's options as one record), `arguments`, `config` and `presets` (the arguments documented, resolved and
checked once; presets into policies).

Owns the Tuner's insides. Only `autotune.tuner`, the hosts (`autotune.trainer`, `autotune.integrations`)
and the command line import it.
Touches nothing itself: the folder's modules say what each touches.
"""
