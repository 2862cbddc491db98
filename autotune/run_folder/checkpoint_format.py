"""The layout of a checkpoint: one nested, versioned record, and `migrate` from every older layout.

    {"format": 2,
     "run":      {"id"}   # same_run.py: the run the checkpoint belongs to (None before run ids)
     "core":     {"model", "optimizer", "optimizer_class", "scheduler", "grad_scaler", "injector"}   # step/core.py + the weights
     "tuning":   {"micro_batch_size", "batch_size", "reliefs", "policies", "counters"}   # Tuner.tuning_state
     "progress": {"step", "epoch", "position", "batches_done", "samples_seen", "ooms",
                  "world", "epoch_world", "nonfinite_steps"}   # progress.py (the last three came later: see migrate)
     "rng":      this rank's random states (+ "loader": a caller's DataLoader's position),
                 + "ranks": every rank's, in a checkpoint written under torchrun
     "host":     the host's own part (AutoTrainer: "num_workers", "evaluation", "callbacks"; {} for a Tuner)}

Each section has one writer; nobody merges dicts into one namespace, so no key can shadow another.
`migrate` holds every compatibility rule: it takes any layout autotune has written (format 1, the
flat dict of 0.x, with or without "counters"; format 2) and returns format 2 with every field
present, so the loaders index plainly. A checkpoint from a newer autotune is an error that says so.
An integration's own checkpoint holds the "tuning" section only: `migrate_tuning` is its rule.

Owns the layout and its rules; touches nothing else (no torch, no files).
"""

from __future__ import annotations

from typing import Any

FORMAT = 2
SECTIONS = ("core", "tuning", "progress", "rng", "host")
PROGRESS_FIELDS = ("step", "epoch", "position", "batches_done", "samples_seen", "ooms")  # format 1's
CORE_FIELDS = ("model", "optimizer", "optimizer_class", "scheduler", "grad_scaler", "injector")
HOST_FIELDS = ("num_workers", "evaluation", "callbacks", "input")  # AutoTrainer's (format 1 had the first three)


def build(*, core: dict[str, Any], tuning: dict[str, Any], progress: dict[str, Any], rng: dict[str, Any],
          host: dict[str, Any] | None = None, run_id: str | None = None) -> dict[str, Any]:
    """A checkpoint of today's format from its sections (each from its one writer)."""
    return {"format": FORMAT, "run": {"id": run_id}, "core": core, "tuning": tuning, "progress": progress,
            "rng": rng, "host": host or {}}


def migrate(state: dict[str, Any]) -> dict[str, Any]:
    """`state` in today's format, whatever format autotune wrote it in (a new dict; the tensors
    are shared, not copied). Raises ValueError for a format this version cannot read."""
    if not isinstance(state, dict):
        raise ValueError(f"a checkpoint is a dict, this one is a {type(state).__name__}")
    version = state.get("format", 1)  # the first checkpoints wrote no format
    if not isinstance(version, int) or version < 1:
        raise ValueError(f"the checkpoint says format {version!r}: not one autotune writes")
    if version > FORMAT:
        raise ValueError(f"the checkpoint has format {version}, written by a newer autotune; this one reads "
                         f"formats 1 to {FORMAT}: upgrade autotune to resume it")
    if version == 1:
        state = _from_format_1(state)
    missing = [section for section in SECTIONS if section not in state]
    if missing:
        raise ValueError(f"the checkpoint (format {version}) has no {', '.join(missing)} section")
    host = dict(state["host"])
    if host.get("evaluation"):  # the evaluation's OOM policy state: "calm" and "since_failure" came later,
        evaluation = {"calm": 0, "since_failure": 0, **host["evaluation"]}  # "failed_size" was renamed
        evaluation.setdefault("failed_micro_batch", evaluation.pop("failed_size", None))
        host["evaluation"] = evaluation
    # The job's number of ranks came later: an older checkpoint was made by as many ranks as saved
    # random states (every rank's under torchrun), or one.
    world = len(state["rng"].get("ranks") or [None])
    progress = {"world": world, "epoch_world": world, "nonfinite_steps": 0, **state["progress"]}  # counted later
    core = {"optimizer_class": None, **state["core"]}  # the optimizer's class name came later
    run = state.get("run") or {"id": None}  # so did the run id
    return {**state, "run": run, "core": core, "tuning": migrate_tuning(state["tuning"]), "progress": progress,
            "host": host}


def tuning(knobs: Any, ladder: Any, dispatcher: Any, counters: Any) -> dict[str, Any]:
    """The "tuning" section, from its parts: only what the tuner itself decided (micro-batch,
    batch, reliefs, policy states) and what the run has done so far, so a resumed integration's
    report counts all of it (`Tuner.tuning_state`)."""
    return {"micro_batch_size": knobs.micro_batch_size, "batch_size": knobs.batch_size,
            "reliefs": ladder.state_dict(), "policies": dispatcher.state_dict(),
            "counters": {"samples_seen": counters.samples_seen, "ooms": counters.ooms}}


def restore_tuning(section: dict[str, Any], knobs: Any, ladder: Any, dispatcher: Any, counters: Any) -> None:
    """Put a "tuning" section (of any format) back into its parts: the reliefs first (a pruned
    model's weights fit only a pruned model)."""
    section = migrate_tuning(section)
    ladder.load_state_dict(section["reliefs"])
    knobs.restore(section["micro_batch_size"], batch_size=section["batch_size"])
    counters.restore_totals(**section["counters"])
    dispatcher.load_state_dict(section["policies"])


def migrate_tuning(tuning: dict[str, Any]) -> dict[str, Any]:
    """The "tuning" section (`Tuner.tuning_state`, what an integration's checkpoint holds) with
    every field present."""
    reliefs = dict(tuning.get("reliefs") or {})
    # "pruning_unsafe" was a marker written before 0.2, not a relief that changed the model.
    reliefs["applied"] = [kind for kind in reliefs.get("applied", []) if kind != "pruning_unsafe"]
    reliefs.setdefault("pruning", [])
    reliefs.setdefault("pruned_fraction", 0.0)
    return {"micro_batch_size": tuning["micro_batch_size"], "batch_size": tuning.get("batch_size"),
            "reliefs": reliefs, "policies": tuning.get("policies", {}), "counters": dict(tuning.get("counters", {}))}


def _from_format_1(flat: dict[str, Any]) -> dict[str, Any]:
    # Format 1: every owner's keys merged into one dict, every rank's random states beside them.
    progress = {name: flat[name] for name in PROGRESS_FIELDS}
    core = {"model": flat["model"], "optimizer": flat.get("optimizer"), "scheduler": flat.get("scheduler"),
            "grad_scaler": flat.get("grad_scaler"), "injector": flat["injector"]}
    counters = flat.get("counters", {"samples_seen": progress["samples_seen"], "ooms": progress["ooms"]})
    tuning = {"micro_batch_size": flat["micro_batch_size"], "batch_size": flat.get("batch_size"),
              "reliefs": flat.get("reliefs"), "policies": flat.get("policies", {}), "counters": counters}
    rng = dict(flat["rng"])
    if "rng_ranks" in flat:
        rng["ranks"] = flat["rng_ranks"]
    host = {name: flat[name] for name in HOST_FIELDS if name in flat}
    return build(core=core, tuning=tuning, progress=progress, rng=rng, host=host)


def rank_rng(state: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """This rank's random states in a (migrated) checkpoint: every rank's is saved under torchrun;
    a run alone takes rank 0's. On another number of ranks than saved it, rank r goes on with rank
    r's streams where there was one, else with rank (r mod saved ranks)'s: the same streams on two
    ranks from there (dropout masks, augmentations drawn in the main process), which no
    arrangement of per-rank streams can avoid when ranks are added; the data order does not
    depend on them (data/sampler.py)."""
    rng = state["rng"]
    ranks = rng.get("ranks")
    if ranks is None or (world == 1 and rank == 0 and len(ranks) <= 1):
        return {key: value for key, value in rng.items() if key != "ranks"}
    return ranks[rank % len(ranks)]
