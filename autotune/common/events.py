"""The events of the training loop: where each fires, and what a policy subscribed to it is asked.

The loop, and where each `Event` fires: the one copy of this picture (trainer.py's `AutoTrainer`
runs all of it; a custom loop's `Tuner.step` and the integrations' `Tuner.accumulate` run one
batch of it, with FIT_START at their first batch and FIT_END at `Tuner.end`)::

    fit():                                          FIT_START; callbacks.on_fit_start
      for epoch:                                    EPOCH_START
        for batch in loader:                        (time blocked in next() = data wait)
          measured = cadence says so (cadence.py)   # a changing run: every batch; steady: 1 in 32
          while the batch is not done (batch.py):   # retry the same batch until it fits
            measured: the step's peak memory from here (demand.py's StepDemand)
            sharded (FSDP2): every rank takes rank 0's micro-batch first (sharded.py)
            attempt (step/core.py):
              for micro in split(batch, micro_batch_size):
                loss = step(model, micro) * len(micro) / len(batch)   # or by items: (loss, n_items)
                loss.backward()
              except OOM: note the size that failed (keep no reference to the exception)
              (sharded: a check before each FSDP2 exchange; another rank's failure stops this one there)
            agree (distributed.py): under torchrun every rank joins one small all-reduce,
              failed or not (a quiet one rides in the gradients' all-reduce); alone, the
              agreement is this process's own proposal
            no failure (optimizer_step.py): average gradients (torchrun; by items when the step counts them);
              a NaN/inf gradient: skip the step (journaled, said once) or stop (on_nonfinite);
              unscale, clip; optimizer.step(); zero_grad()
            failure (recovery.py): clean up outside `except`: zero_grad(set_to_none), gc, empty_cache
              CUDA, the batch's first OOM at the size the last batch completed at: that size once more
                                                    OOM -> policies -> e.g. SetMicroBatch(n // 2)
              at the smallest size, a relief if a policy asked (checkpoint first), else
              raise autotune.OutOfMemory with the figures (checkpoint first); the retry is measured
          a quiet batch (not measured, nobody hears BATCH_END, no relief waiting, no new monitor
            sample, no log line due) skips the four lines below: nothing in them could act
                                                    BATCH_END
          measured: the step's need and room        BATCH_MEASURED
          a relief a policy asked for (tuning/relief_ladder.py): autocast, checkpointing, pruning
          monitor samples, step timing -> detectors MEMORY_HIGH | MEMORY_PRESSURE | IO_BOUND
          a policy changed workers or caching: rebuild the loader at this position
          a signal (agreed by all ranks): checkpoint and stop
                                                    callbacks.on_step_end
          every `eval_every` steps: evaluate()      (evaluation.py; callbacks.on_evaluate)
          a due checkpoint (agreed by all ranks)
          a callback asked to stop: checkpoint, end the fit
                                                    EPOCH_END
        eval_every="epoch": evaluate(); per-epoch scheduler step; callbacks.on_epoch_end
                                                    FIT_END; callbacks.on_fit_end
      any other error on the way: checkpoint the last completed step, note the batch, raise

Owns the events' names. Touches nothing.
"""

from __future__ import annotations

import enum


class Event(str, enum.Enum):
    """A point in the training loop where policies are consulted (the picture above)."""

    FIT_START = "fit_start"
    EPOCH_START = "epoch_start"
    OOM = "oom"
    BATCH_END = "batch_end"  # after every batch
    BATCH_MEASURED = "batch_measured"  # after a batch whose memory was measured (cadence.py): the step's need
    MEMORY_HIGH = "memory_high"
    MEMORY_PRESSURE = "memory_pressure"
    IO_BOUND = "io_bound"
    EPOCH_END = "epoch_end"
    FIT_END = "fit_end"
