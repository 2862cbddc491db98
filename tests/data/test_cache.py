"""The shared-memory sample cache: exact samples, random transforms after it, one copy for
all workers, a byte budget."""

import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset
from torchvision import datasets, transforms as T

from autotune.data.cache import (CachedDataset, NotCacheable, SampleCache, cache_budget, profile_input,
                                 split_for_caching)
from autotune.common.shared_memory import NoRoom
from tests.small_tmpfs import full_shm, small_shm  # noqa: F401  (fixtures)

AUGMENT = T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.ToTensor()])


@pytest.fixture
def cache_for():
    made = []

    def make(n, budget=64 * 2**20):
        made.append(SampleCache(n, budget))
        return made[-1]

    yield make
    for cache in made:
        cache.close()
        assert not cache.path.exists()


def test_a_cached_image_equals_the_decoded_one_bit_for_bit(jpeg_folder, cache_for):
    dataset = datasets.ImageFolder(jpeg_folder, transform=AUGMENT, target_transform=lambda t: t + 10)
    split = split_for_caching(dataset)
    cache = cache_for(len(dataset))
    cached = CachedDataset(split, cache)
    for index in (0, 5, 31):
        cached[index]  # a miss: loads, stores, transforms
        image, target = cache.get(index)
        fresh_image, fresh_target = datasets.ImageFolder(jpeg_folder)[index]
        assert image.mode == fresh_image.mode and image.size == fresh_image.size
        assert np.array_equal(np.asarray(image), np.asarray(fresh_image)) and target == fresh_target
    assert dataset.transform is AUGMENT  # the user's dataset is untouched: the split is a copy


@pytest.mark.parametrize("sample", [
    (torch.arange(12, dtype=torch.float32).reshape(3, 4), 1),
    (np.arange(10, dtype=np.uint8), "label"),
    {"tokens": torch.tensor([3, 1, 4]), "meta": {"id": 7}},
    (torch.tensor([1.5], dtype=torch.bfloat16), None),  # no numpy dtype: torch's own pickling
])
def test_tensors_arrays_and_other_objects_round_trip(sample, cache_for):
    cache = cache_for(1)
    assert cache.put(0, sample)
    got = cache.get(0)
    flat = lambda s: list(s.values()) if isinstance(s, dict) else list(s)  # noqa: E731
    for a, b in zip(flat(got), flat(sample)):
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b)
        elif isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        else:
            assert a == b


def test_random_transforms_still_differ_between_epochs(jpeg_folder, cache_for):
    dataset = datasets.ImageFolder(jpeg_folder, transform=AUGMENT)
    cached = CachedDataset(split_for_caching(dataset), cache_for(len(dataset)))
    torch.manual_seed(0)
    first, _ = cached[3]
    second, _ = cached[3]  # a hit
    assert cached.cache.stats()["hits"] == 1
    assert not torch.equal(first, second)
    torch.manual_seed(1)
    hit, _ = cached[3]
    torch.manual_seed(1)
    uncached, _ = dataset[3]
    assert torch.equal(hit, uncached)  # the same random draw gives the same sample: nothing else changed


def test_only_what_is_declared_safe_is_cached():
    class Plain(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.rand(2), i  # random output: caching it would freeze the randomness

    with pytest.raises(NotCacheable, match="cacheable = True"):
        split_for_caching(Plain())
    assert not profile_input(Plain()).cacheable

    class Declared(Plain):
        cacheable = True

    assert split_for_caching(Declared()).after is None

    class Split(Plain):
        def load(self, i):
            return torch.full((2,), float(i))

        def augment(self, x):
            return x + torch.rand(2), 0

    split = split_for_caching(Subset(Split(), [2, 3]))
    assert torch.equal(split.raw[1], torch.full((2,), 3.0)) and split.after is not None


def test_the_budget_is_respected_and_the_rest_is_read_as_before(cache_for):
    data = TensorDataset(torch.arange(100, dtype=torch.float32).repeat_interleave(1024).reshape(100, 1024))
    data.cacheable = True
    cache = cache_for(100, budget=30 * 4096)  # room for about 29 of 100 samples
    cached = CachedDataset(split_for_caching(data), cache)
    for _ in range(2):
        assert all(torch.equal(cached[i][0], data[i][0]) for i in range(100))
    stats = cache.stats()
    assert stats["full"] and 20 <= stats["entries"] < 30 and stats["bytes"] <= 30 * 4096
    assert stats["hits"] == stats["entries"]  # the second pass hit every cached sample
    assert os.stat(cache.path).st_blocks * 512 <= 30 * 4096 + 2 * 4096 + 100 * 16 + 4096  # pages used


def test_the_budget_is_the_tightest_limit(tmp_path):
    budget, limit = cache_budget(max_bytes=1000)
    assert (budget, limit) == (1000, "max_bytes")
    budget, limit = cache_budget(room_bytes=4000, shm_dir=str(tmp_path))
    assert (budget, limit) == (2000, "room under the memory cap x 0.5")
    budget, limit = cache_budget(available_fraction=1e-9)
    assert limit.startswith("MemAvailable") and budget < 2**20


def _private_anonymous(pid):
    """Private memory of a process in its heap and anonymous mappings (where a copy of a read
    sample would live), from /proc/PID/smaps; file and shared-memory mappings are left out
    (the cache region, and the shared memory batches travel to the main process in)."""
    total, counted = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
                counted = len(fields) < 6 or fields[5] == "[heap]"
            elif fields[0] in ("Private_Clean:", "Private_Dirty:") and counted:
                total += int(fields[1]) * 1024
    return total


def _read_all(dataset, workers):
    """Read every sample with `workers` workers; each worker's private anonymous memory after
    its first batch and just before the workers exit."""
    # Samples are dropped in the worker (the collate returns their count): only the reading counts.
    it = iter(DataLoader(dataset, batch_size=8, num_workers=workers, collate_fn=len))
    first = last = None
    for i, _ in enumerate(it):
        if i == 0:
            first = [_private_anonymous(w.pid) for w in it._workers]
        if i == len(it) - 2 * workers - 1:  # every worker has done nearly all its share, none has exited
            last = [_private_anonymous(w.pid) for w in it._workers]
    del it
    return first, last


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 4 workers on a 2-core machine, on purpose
def test_one_copy_for_all_workers(tmp_path_factory):
    """Read a filled cache with 1 and with 4 workers: the region is one and the same size, and
    no worker's own memory grows more than when it decodes the same images (no private copies)."""
    from tests.data.conftest import write_jpegs

    root = write_jpegs(tmp_path_factory.mktemp("big") / "train", classes=2, per_class=100, size=320)
    dataset = datasets.ImageFolder(root)
    split = split_for_caching(dataset)
    region_bytes = {}
    for workers in (1, 4):
        cache = SampleCache(len(dataset), 256 * 2**20)
        try:
            cached = CachedDataset(split, cache)
            _read_all(cached, workers)  # fills it
            assert cache.stats()["entries"] == len(dataset)
            first, last = _read_all(cached, workers)  # all hits
            plain_first, plain_last = _read_all(dataset, workers)  # the same, decoding
            region_bytes[workers] = os.stat(cache.path).st_blocks * 512
            stored = cache.stats()["bytes"]
        finally:
            cache.close()
        # A worker's memory grows while it reads (batches in flight, allocator caches) as much
        # as when it decodes; a private copy of its share would add stored / workers more.
        growth = [end - start for start, end in zip(first, last)]
        plain_growth = [end - start for start, end in zip(plain_first, plain_last)]
        for cached_growth, decoding_growth in zip(growth, plain_growth):
            assert cached_growth - decoding_growth < stored / workers / 4, (workers, growth, plain_growth, stored)
    assert stored > 50 * 2**20  # ~59 MiB of decoded pixels
    assert region_bytes[1] == region_bytes[4] and region_bytes[1] < stored + 2**20


@pytest.mark.slow
def test_spawned_workers_reopen_the_same_region(jpeg_folder):
    dataset = datasets.ImageFolder(jpeg_folder)
    cache = SampleCache(len(dataset), 16 * 2**20, context="spawn")
    try:
        cached = CachedDataset(split_for_caching(dataset), cache)
        # One worker fills the region; two fresh ones read it back, each what another process wrote.
        for workers in (1, 2):
            for _ in DataLoader(cached, batch_size=8, num_workers=workers, multiprocessing_context="spawn",
                                collate_fn=len):
                pass
        stats = cache.stats()
        assert stats["entries"] == len(dataset) and stats["hits"] == len(dataset), stats  # filled, then all hits
    finally:
        cache.close()


def test_a_killed_runs_region_is_removed_by_the_next_cache(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", f"from autotune.data.cache import SampleCache; "
                           f"c = SampleCache(4, 4096, directory={str(tmp_path)!r}); print(c.path); "
                           "import os; os._exit(0)"], capture_output=True, text=True, check=True)
    left = tmp_path / os.path.basename(proc.stdout.strip())
    assert left.exists()  # os._exit: no clean-up ran
    cache = SampleCache(4, 4096, directory=str(tmp_path))
    try:
        assert not left.exists() and cache.path.exists()
    finally:
        cache.close()


# -- a full /dev/shm (a container's 64 MiB): a real 1 MiB tmpfs (tests/small_tmpfs.py)

def test_a_cache_in_a_full_shared_memory_folder_is_an_error_when_made(full_shm):
    with pytest.raises(NoRoom) as raised:  # before: made sparse, and SIGBUS at its first write
        SampleCache(256, 512 * 2**10)
    assert raised.value.errno == errno.ENOSPC and str(full_shm) in str(raised.value)
    assert [p.name for p in full_shm.iterdir()] == ["fill"]  # nothing half-made left


FILL_UP = """
import sys
import torch
from torch.utils.data import DataLoader, Dataset
from autotune.data import cache as cache_module
from autotune.data.cache import CachedDataset, SampleCache, split_for_caching
from tests.small_tmpfs import fill

cache_module.GROW_BYTES = 64 * 2**10  # reserved 64 KiB at a time, so it grows inside a 1 MiB tmpfs


class Rows(Dataset):
    cacheable = True

    def __len__(self):
        return 64

    def __getitem__(self, index):
        return torch.full((4096,), float(index))  # 16 KiB a sample: 1 MiB in all


cache = SampleCache(64, 4 * 2**20)  # a budget the tmpfs had room for when it was set
fill(cache.path.parent, leave=256 * 2**10)  # then something else takes all but 256 KiB of it
cached = CachedDataset(split_for_caching(Rows()), cache)
for epoch in range(2):  # filled by the forked workers, then read back
    for batch in DataLoader(cached, batch_size=8, num_workers=2, multiprocessing_context="fork"):
        assert all(torch.equal(row, torch.full((4096,), float(row[0]))) for row in batch)
stats = cache.stats()
print(stats["entries"], stats["hits"], stats["no_room"], stats["full"])
cache.close()
"""


@pytest.mark.slow
def test_a_cache_that_meets_a_full_shared_memory_folder_stops_filling_with_a_word(small_shm):
    proc = subprocess.run([sys.executable, "-c", FILL_UP], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    # Before: a worker's write into a page tmpfs could not back was SIGBUS ("DataLoader worker ... killed
    # by signal: Bus error"), the run's end.
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    entries, hits, no_room, full = proc.stdout.split()
    assert 8 <= int(entries) < 24 and int(hits) == int(entries) and no_room == full == "True", proc.stdout
    assert proc.stderr.count("the sample cache stops filling") == 1, proc.stderr
    assert "could be reserved (no room" in proc.stderr
