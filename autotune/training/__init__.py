"""What AutoTrainer adds around the Tuner: callbacks, evaluation, the batch in hand.

`callbacks` (the hooks, their state in checkpoints, a stop they ask for), `evaluation` (`Evaluator` and
`EvaluationPlan`), `batch_in_hand` (the batch being loaded or trained, named in an error's note).

Owns the epoch loop's helpers. May import the data pipeline and everything below it, not the Tuner's
rooms; `autotune.trainer` and the integrations import it.
Touches nothing itself: the folder's modules say what each touches.
"""
