"""The ranks: one process alone or many under torchrun, and how the model is spread over them.

`process` (the `Process` Protocol: the one name for a process's place in the job), `distributed`
(`Solo` and `Ranks`: the collectives, the agreement after every attempt), `job` (the `Job`
strategy Protocol, every answer a behaviour), `whole_model` (`Single` alone, `Replicated` for
DDP), `sharded` (FSDP2's `Sharded`), `agreement` (its wire format), `gradient_bucket` (flat
all-reduce buffers), `world_change` (a resume on another number of ranks).

Owns every collective. May import `common`, `observe`, `memory` and `decisions` (the knobs a resume
restores); the step and everything above may import it.
Touches nothing itself: the folder's modules say what each touches.
"""
