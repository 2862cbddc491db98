"""AutoTuneTrainer: HF's Trainer under a real memory cap (RLIMIT_AS, in a subprocess)."""

import json
from pathlib import Path

import pytest

from tests.conftest import journal, run_python, skip_if_uncalibrated, torchrun

pytest.importorskip("transformers")
EXAMPLES = Path(__file__).parents[2] / "examples"

SCRIPT = """
import sys, torch
sys.path.insert(0, EXAMPLES)
from autotune.memory.limits import calibrate_headroom, fix_mmap_threshold, cap_address_space, lift_address_space_cap
from hf_causal_lm import build
from transformers import Trainer, TrainingArguments
from autotune.integrations.transformers import AutoTuneTrainer

def make(cls, out, max_steps, **kw):
    model, train, _, collator = build(64)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=16, gradient_accumulation_steps=2,
                             max_steps=max_steps, optim="sgd", learning_rate=0.1, max_grad_norm=1.0,
                             lr_scheduler_type="constant", report_to="none", use_cpu=True, save_strategy="steps",
                             save_steps=1, logging_steps=1, seed=0, data_seed=0, disable_tqdm=True)
    return model, cls(model=model, args=args, train_dataset=train, data_collator=collator, **kw)

# Big blocks mmapped (and unmapped on free) from the start, as under the cap: otherwise glibc's
# threshold rises during HF's own run, its freed activations stay mapped in the heap, and the
# cap set after it (virtual size + budget) leaves room for more than the budget.
fix_mmap_threshold()
plain_model, plain = make(Trainer, "plain", 2)  # HF's own, no cap: what the capped runs must end at
plain.train()
first_model, first = make(AutoTuneTrainer, OUT_DIR, 1, tuner_options={"monitor": False})
_, train, _, collator = build(64)

def probe(size):  # forward and backward at micro-batch `size` (every batch is padded to 64 tokens)
    try:
        first_model(**collator([train[i] for i in range(size)])).loss.backward()
    finally:
        first_model.zero_grad(set_to_none=True)

calibration = calibrate_headroom(probe, fits=4, fails=16)  # HF's 16 must not fit, a quarter of it must
if calibration.headroom_bytes is None:
    save({"uncalibrated": str(calibration)})
    raise SystemExit(0)
cap_address_space(calibration.headroom_bytes)
first.train()  # stops after one optimizer step, with a checkpoint
second_model, second = make(AutoTuneTrainer, OUT_DIR, 2, tuner_options={"monitor": False})
second.train(resume_from_checkpoint=True)
lift_address_space_cap()
diff = max((a - b).abs().max().item() for a, b in zip(plain_model.state_dict().values(),
                                                     second_model.state_dict().values()))
save({"settled": first.micro_batch_size, "first_ooms": first.tuner.ooms, "first_samples": first.tuner.samples_seen,
      "second_samples": second.tuner.samples_seen, "diff": diff, "cap": str(calibration)})
"""


@pytest.mark.slow
def test_hf_trainer_survives_ooms_resumes_at_the_settled_micro_batch_with_hfs_weights(tmp_path):
    out = tmp_path / "out"
    settings = f"EXAMPLES={str(EXAMPLES)!r}\nOUT_DIR={str(out)!r}\n"
    proc, result = run_python(settings + SCRIPT, tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    skip_if_uncalibrated(result)
    assert result["first_ooms"] >= 1 and result["settled"] < 16
    # 2 batches of 16 per optimizer step, each sample once; then the resumed run does the second
    # step, and counts on from the first run's (the report's figure is the whole run's)
    assert result["first_samples"] == 32 and result["second_samples"] == 64
    from autotune.observe.report import summarize
    assert summarize(out)["samples_seen"] == 64
    assert result["diff"] < 1e-5  # the same weights as HF's Trainer without OOMs
    records = journal(out)
    resumed = [r for r in records if r["kind"] == "resume"]
    assert resumed and resumed[0]["micro_batch_size"] == result["settled"]
    after = records.index(resumed[0])
    first_oom = [r for r in records[:after] if r["kind"] == "oom"][0]
    assert first_oom["micro_batch_size"] == 16 and first_oom["step"] == 0
    # the resumed run starts at the settled size, not at HF's 16 again
    assert all(r["micro_batch_size"] <= result["settled"] for r in records[after:] if r["kind"] == "oom")
    assert (out / "checkpoint-1" / "autotune.pt").is_file() and (out / "checkpoint-2" / "autotune.pt").is_file()
    assert [r["kind"] for r in records].count("fit_end") == 2  # `autotune report OUT_DIR` reads both runs


EVAL_SCRIPT = """
import json, sys, torch
sys.path.insert(0, EXAMPLES)
from autotune.memory.limits import calibrate_headroom, fix_mmap_threshold, cap_address_space, lift_address_space_cap
from hf_causal_lm import build
from transformers import Trainer, TrainingArguments
from autotune.integrations.transformers import AutoTuneTrainer

fix_mmap_threshold()
model, _, evals, collator = build(256)  # 64 evaluation samples: 2 batches of 32
args = TrainingArguments(output_dir=OUT_DIR, per_device_eval_batch_size=32, report_to="none", use_cpu=True,
                         disable_tqdm=True)
plain = Trainer(model=model, args=args, eval_dataset=evals, data_collator=collator)
reference = plain.evaluate()["eval_loss"]  # HF's own, no cap
tuned = AutoTuneTrainer(model=model, args=args, eval_dataset=evals, data_collator=collator,
                        tuner_options={"monitor": False})

def probe(size):  # an evaluation forward at `size` (the logits, 64 tokens x 4096, dominate)
    with torch.no_grad():
        model(**collator([evals[i] for i in range(size)]))

calibration = calibrate_headroom(probe, fits=4, fails=32)
if calibration.headroom_bytes is None:
    save({"uncalibrated": str(calibration)})
    raise SystemExit(0)
cap_address_space(calibration.headroom_bytes)
capped = tuned.evaluate()["eval_loss"]
result = {"reference": reference, "capped": capped, "ooms": tuned.evaluator.ooms,
          "micro": tuned.evaluator.micro_batch_size, "cap": str(calibration)}
save(result)
try:  # HF's own under the same cap (last: it may take the process with it)
    plain.evaluate()
    result["plain"] = "finished"
except Exception as exc:
    result["plain"] = f"{type(exc).__name__}: {str(exc)[:200]}"
save(result)
"""


@pytest.mark.slow
def test_an_hf_evaluation_that_does_not_fit_finishes_with_the_uncapped_eval_loss(tmp_path):
    settings = f"EXAMPLES={str(EXAMPLES)!r}\nOUT_DIR={str(tmp_path / 'out')!r}\n"
    proc, result = run_python(settings + EVAL_SCRIPT, tmp_path, timeout=240)
    skip_if_uncalibrated(result)
    assert result is not None and "capped" in result, proc.stderr[-3000:]
    assert result["ooms"] >= 1 and result["micro"] < 32, result
    assert abs(result["capped"] - result["reference"]) < 1e-6, result
    # HF's Trainer under the same cap does not get through it (an error, or the process lost).
    assert result.get("plain", "lost") != "finished", result
    oom = [r for r in journal(tmp_path / "out") if r["kind"] == "eval_oom"]
    assert oom and oom[0]["micro_batch_size"] == 32


DDP_SCRIPT = """
import json, os, sys, torch
import torch.distributed as dist
sys.path.insert(0, os.environ["EXAMPLES"])
from autotune.memory.limits import calibrate_headroom, fix_mmap_threshold, cap_address_space, lift_address_space_cap
from hf_causal_lm import build
from transformers import Trainer, TrainingArguments
from autotune.integrations.transformers import AutoTuneTrainer

out = sys.argv[1]
rank = int(os.environ["RANK"])

def save(result):
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)

def make(cls, folder, **kw):
    model, train, evals, collator = build(128)  # 32 evaluation samples: one batch of 16 a rank
    args = TrainingArguments(output_dir=os.path.join(out, folder), per_device_train_batch_size=16,
                             per_device_eval_batch_size=16, gradient_accumulation_steps=2, max_steps=2, optim="sgd",
                             learning_rate=0.1, max_grad_norm=1.0, lr_scheduler_type="constant", report_to="none",
                             use_cpu=True, ddp_backend="gloo", save_strategy="no", logging_steps=1, seed=0,
                             data_seed=0, disable_tqdm=True)
    return model, cls(model=model, args=args, train_dataset=train, eval_dataset=evals, data_collator=collator, **kw)

fix_mmap_threshold()
plain_model, plain = make(Trainer, "plain")  # HF's own DDP run, no cap: what the capped job must end at
plain.train()
plain_eval = plain.evaluate()["eval_loss"]
tuned_model, tuned = make(AutoTuneTrainer, "tuned", tuner_options={"monitor": False})
_, train, _, collator = build(128)

def probe(size):  # forward and backward at micro-batch `size` (every batch is padded to 64 tokens)
    try:
        tuned_model(**collator([train[i] for i in range(size)])).loss.backward()
    finally:
        tuned_model.zero_grad(set_to_none=True)

box = [None]
if rank == 1:  # only rank 1 is capped: HF's 16 a rank must not fit there, a quarter of it must
    calibration = calibrate_headroom(probe, fits=4, fails=16)
    box = [None if calibration.headroom_bytes is None else str(calibration)]
dist.broadcast_object_list(box, src=1)
if box[0] is None:
    save({"uncalibrated": "rank 1's cap"})
    raise SystemExit(0)
if rank == 1:
    cap_address_space(calibration.headroom_bytes)
tuned.train()
tuned_eval = tuned.evaluate()["eval_loss"]
lift_address_space_cap()
diff = max((a - b).abs().max().item() for a, b in zip(plain_model.state_dict().values(),
                                                     tuned_model.state_dict().values()))
logged = lambda trainer: [r["loss"] for r in trainer.state.log_history if "loss" in r]
save({"diff": diff, "ooms": tuned.tuner.ooms, "settled": tuned.micro_batch_size, "samples": tuned.tuner.samples_seen,
      "steps": tuned.state.global_step, "plain_losses": logged(plain), "losses": logged(tuned),
      "plain_eval": plain_eval, "eval": tuned_eval, "cap": box[0]})
"""


@pytest.mark.slow
def test_hf_under_torchrun_with_one_rank_capped_ends_at_plain_hf_ddps_weights(tmp_path, monkeypatch):
    # Two gloo ranks, HF's DDP; only rank 1 runs out of memory, and both retry at its size.
    script = tmp_path / "train.py"
    script.write_text(DDP_SCRIPT)
    results = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    monkeypatch.setenv("EXAMPLES", str(EXAMPLES))
    torchrun(script, [str(tmp_path)], results)
    ranks = [json.loads(path.read_text()) for path in results]
    skip_if_uncalibrated(ranks[0])
    for result in ranks:
        assert result["ooms"] >= 1 and result["settled"] < 16, result  # rank 1's OOMs, agreed by rank 0
        assert result["diff"] < 1e-6, result  # plain HF DDP's weights
        assert result["samples"] == 128 and result["steps"] == 2  # 2 steps of 2 batches of 16, on 2 ranks
        # the logged training loss is HF's: a retry is counted once, on the rank that did not fail too
        assert result["losses"] == pytest.approx(result["plain_losses"], abs=1e-4), result
        # Evaluated in pieces where the cap refuses the whole batch: the sum in another order, a few
        # float32 ulps of a loss near 10 (on an AVX512_BF16 machine 1.9e-6, two ulps, was seen).
        assert result["eval"] == pytest.approx(result["plain_eval"], rel=1e-6, abs=0), result
    assert ranks[0]["settled"] == ranks[1]["settled"]
    oom = [r for r in journal(tmp_path / "tuned") if r["kind"] == "oom"]
    assert oom and oom[0]["micro_batch_size"] == 16


GIVE_UP_SCRIPT = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from autotune import OutOfMemory
from autotune.integrations.transformers import AutoTuneTrainer
from autotune.memory.limits import cap_address_space, fix_mmap_threshold, least_headroom, lift_address_space_cap

fix_mmap_threshold()
torch.manual_seed(0)
# Long sequences on a small model: one sample's logits (1024 tokens x 16384) need far more than
# the weights, so a cap can refuse micro-batch 1 and still leave room to save them.
model = GPT2LMHeadModel(GPT2Config(vocab_size=16384, n_positions=1024, n_embd=64, n_layer=2, n_head=2))
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, 16384, (32, 1024), generator=g)
train = [{"input_ids": row, "labels": row} for row in ids]
args = TrainingArguments(output_dir=OUT_DIR, per_device_train_batch_size=8, max_steps=2, optim="sgd",
                         learning_rate=0.1, report_to="none", use_cpu=True, bf16=True, gradient_checkpointing=True,
                         save_strategy="no", disable_tqdm=True)
trainer = AutoTuneTrainer(model=model, args=args, train_dataset=train, tuner_options={"monitor": False})

def probe():
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids[:1], labels=ids[:1]).loss.backward()
    finally:
        model.zero_grad(set_to_none=True)

model.gradient_checkpointing_enable()
need = least_headroom(probe, 2**30)
if need is None or need // 2 < 40 * 2**20:
    save({"uncalibrated": f"micro-batch 1 needs {need} bytes of headroom: too little to refuse it and keep 40 MiB"})
    raise SystemExit(0)
cap_address_space(need // 2)  # micro-batch 1 does not fit; HF's save of 4 MB of weights does
try:
    trainer.train()
    save({"raised": None})
except OutOfMemory as exc:
    lift_address_space_cap()
    save({"raised": str(exc)[:300]})
"""


@pytest.mark.slow
def test_hf_where_nothing_fits_raises_out_of_memory_after_one_checkpoint(tmp_path):
    out = tmp_path / "out"
    proc, result = run_python(f"OUT_DIR={str(out)!r}\n" + GIVE_UP_SCRIPT, tmp_path, timeout=240)
    skip_if_uncalibrated(result)
    assert proc.returncode == 0 and result is not None, proc.stderr[-3000:]  # no signal, no abort
    assert result["raised"] and "even at micro-batch 1" in result["raised"], result
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-0"]
    reasons = [r["reason"] for r in journal(out) if r["kind"] == "checkpoint"]
    assert reasons == ["out_of_memory"], reasons  # once, and no "before_relief" where reliefs are off


def test_hfs_save_is_skipped_with_a_word_where_the_memory_left_cannot_hold_it(tmp_path, capfd):
    import sys

    sys.path.insert(0, str(EXAMPLES))
    from hf_causal_lm import build
    from transformers import TrainingArguments

    from autotune.integrations.transformers import AutoTuneTrainer

    model, train, _, collator = build(16)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, report_to="none",
                             use_cpu=True, disable_tqdm=True)
    # A soft cap far below what the process holds: no room is left for the copy HF's save makes.
    trainer = AutoTuneTrainer(model=model, args=args, train_dataset=train, data_collator=collator,
                              tuner_options={"monitor": False, "memory_cap": "1MiB"})
    assert trainer.checkpoint_now("out_of_memory") is None
    assert not list((tmp_path / "out").glob("checkpoint-*"))
    skipped = [r for r in journal(tmp_path / "out") if r["kind"] == "checkpoint_skipped"]
    assert skipped and skipped[0]["room_bytes"] < skipped[0]["need_bytes"]
    assert "not writing HF's checkpoint before the out-of-memory error" in capfd.readouterr().err
    trainer.tuner.close()
