"""The agreement's wire format (agreement.py)."""


def test_the_agreements_wire_format_is_made_from_its_fields():
    from autotune.common.actions import PruneChannels
    from autotune.ranks.agreement import Agreement

    rank0 = Agreement(failed_micro_batch=None, micro_batch_size=8, checkpoint_due=2, relief=PruneChannels(0.25, "asked"))
    rank1 = Agreement(failed_micro_batch=16, micro_batch_size=4, stop_signal=15, fatal="optimizer step: out of memory")
    wires = [rank0.to_wire(is_main=True), rank1.to_wire(is_main=False)]
    assert len(wires[0]) == len(wires[1]) == 7  # one int a field, two for the relief
    reduced = [max(values) for values in zip(*wires)]  # what the all-reduce (MAX) makes of them
    texts = [rank0.fatal, rank1.fatal]
    agreed = rank1.from_wire(reduced, is_main=False, gather=lambda _: texts)
    assert agreed == Agreement(failed_micro_batch=16, micro_batch_size=8, stop_signal=15, checkpoint_due=2,
                               relief=agreed.relief, fatal="rank 1: optimizer step: out of memory")
    assert isinstance(agreed.relief, PruneChannels) and agreed.relief.ratio == 0.25  # rank 0's, decoded
    assert rank0.from_wire(reduced, is_main=True, gather=lambda _: texts).relief is rank0.relief
