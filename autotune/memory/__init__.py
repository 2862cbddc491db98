"""Memory and sizing: what a step needs and what the device or host has.

`figures` (memory figures and clean-up), `demand` (a step's need in the measure the cap binds),
`breakdown` (where the memory went at an OOM), `cadence` (which batches are measured), `history` (the CUDA
allocation history at OOMs), `limits` (caps: RLIMIT_AS, cgroups, the helpers examples use), `onednn`
and `kernel_room` (oneDNN's kernels under an address-space cap).

Owns the numbers a sizing decision is made from. May import `common`, `observe` and `monitor` (the host's
figures); the step, the ranks and everything above may import it.
Touches nothing itself: the folder's modules say what each touches.
"""
