"""The policy machinery: events in, actions out, every decision journaled.

`policy` (the `Policy` protocol and `PolicyBase`), `detectors` (monitor samples into events),
`dispatch` (events to the subscribed policies, conflicts resolved), `knobs` (what policies control: the
only code that changes it), `relief_trigger` (the relief policies' shared skeleton).

Owns the way a decision is made and recorded, not the policies themselves (`autotune.policies`, above it).
May import `common`, `observe` and `memory`.
Touches nothing itself: the folder's modules say what each touches.
"""
