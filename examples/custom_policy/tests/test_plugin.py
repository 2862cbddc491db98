"""The plug-in's own test: installed, autotune finds it by name, and it decides as documented."""

from autotune import EmptyCache, Event, Snapshot
from autotune.tuning.presets import installed_policies, resolve_policy
from autotune_example_policy import EmptyCacheEveryEpoch


def test_autotune_finds_the_installed_plugin_by_its_entry_point_name():
    assert "empty_cache_every_epoch" in installed_policies()
    assert resolve_policy("empty_cache_every_epoch") is EmptyCacheEveryEpoch


def test_it_asks_for_a_clean_up_every_nth_epoch():
    policy = EmptyCacheEveryEpoch(every=2)
    at = lambda epoch: Snapshot(step=0, epoch=epoch, batch_size=8, micro_batch_size=8, device="cpu")  # noqa: E731
    assert policy.decide(Event.EPOCH_END, at(1)) == []
    (action,) = policy.decide(Event.EPOCH_END, at(2))
    assert isinstance(action, EmptyCache)
