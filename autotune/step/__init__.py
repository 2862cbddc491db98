"""The step and its attempt: one batch's forward and backward over micro-batches, then the optimizer.

`core` (`StepCore`: an attempt over micro-batches, precision, torch.compile), `precision` (the autocast
plan), `optimizer_step` (reduce, unscale, clip, step or skip, the scheduler), `losses` (the loss records),
`finite` (the non-finite check), `rewind` and `norm_stats` (a failed attempt leaves no trace; BatchNorm's
statistics from the whole batch), `options` (`StepOptions`: what the user chose for the step, one record).

Owns what happens to the model inside one batch. May import `ranks` and everything below it; the run
folder, the reliefs and the Tuner's rooms import it.
Touches nothing itself: the folder's modules say what each touches.
"""
