import collections

import numpy as np
import pytest
import torch

from autotune.common.batching import Fields, PerSample, batch_len, check_splittable, map_tensors, micro_batches, slice_batch


def sizes(batch, size, start=0, split_fn=None):
    return [n for _, n in micro_batches(batch, size, start=start, split_fn=split_fn)]


def test_tensor_is_split_into_views_along_dim0():
    batch = torch.arange(10).reshape(10, 1)
    parts = [m for m, _ in micro_batches(batch, 4)]
    assert [p.shape[0] for p in parts] == [4, 4, 2]
    assert torch.equal(torch.cat(parts), batch)
    assert parts[0].data_ptr() == batch.data_ptr()  # a view, no copy


def test_tuple_list_dict_and_nesting_keep_structure():
    x, y = torch.randn(6, 3), torch.arange(6)
    batch = {"inputs": (x, [y, y * 2]), "meta": {"ids": y}}
    parts = [m for m, _ in micro_batches(batch, 4)]
    assert isinstance(parts[0]["inputs"], tuple) and isinstance(parts[0]["inputs"][1], list)
    assert torch.equal(parts[1]["inputs"][1][1], y[4:] * 2)
    assert torch.equal(parts[1]["meta"]["ids"], y[4:])


def test_namedtuple_keeps_its_type():
    Pair = collections.namedtuple("Pair", "x y")
    part = slice_batch(Pair(torch.arange(5), torch.arange(5)), 1, 3)
    assert isinstance(part, Pair) and part.x.tolist() == [1, 2]


def test_strings_and_ints_are_split_as_lists():
    batch = (torch.randn(5, 2), ["a", "b", "c", "d", "e"], [0, 1, 2, 3, 4])
    parts = [m for m, _ in micro_batches(batch, 2)]
    assert parts[1][1] == ["c", "d"] and parts[2][2] == [4]


def test_numpy_arrays_are_split():
    parts = [m for m, _ in micro_batches(np.arange(7), 3)]
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4], [5, 6]]


def test_start_skips_samples_already_done():
    assert sizes(torch.zeros(10), 3, start=4) == [3, 3]


def test_lengths_that_disagree_are_an_error():
    with pytest.raises(ValueError, match="disagree"):
        batch_len({"x": torch.zeros(4), "y": torch.zeros(5)})


def test_unknown_types_ask_for_split_fn():
    with pytest.raises(TypeError, match="split_fn"):
        check_splittable({"x": torch.zeros(3), "obj": object()})
    with pytest.raises(TypeError, match="split_fn"):
        batch_len(3.5)


def test_custom_type_with_split_fn():
    class Graphs:
        def __init__(self, items):
            self.items = items

        def __len__(self):
            return len(self.items)

    def split(batch, size):
        return [Graphs(batch.items[i:i + size]) for i in range(0, len(batch), size)]

    batch = Graphs(list(range(7)))
    with pytest.raises(TypeError, match="split_fn"):
        check_splittable(batch)
    assert sizes(batch, 3, split_fn=split) == [3, 3, 1]
    assert sizes(batch, 2, start=4, split_fn=split) == [2, 1]
    with pytest.raises(ValueError, match="line up"):
        sizes(batch, 3, start=4, split_fn=split)


def test_micro_batch_size_must_be_positive():
    with pytest.raises(ValueError):
        list(micro_batches(torch.zeros(3), 0))


def test_map_tensors_reaches_every_tensor_and_keeps_the_structure():
    from collections import namedtuple

    import torch

    from autotune.common.batching import map_tensors

    Pair = namedtuple("Pair", "x y")
    batch = {"a": [torch.ones(2), (torch.zeros(1), "label")], "b": Pair(torch.ones(3), 7)}
    doubled = map_tensors(lambda t: t + 1, batch)
    assert isinstance(doubled["b"], Pair) and doubled["b"].y == 7 and torch.equal(doubled["b"].x, torch.full((3,), 2.0))
    assert torch.equal(doubled["a"][0], torch.full((2,), 2.0)) and doubled["a"][1][1] == "label"
    assert isinstance(doubled["a"][1], tuple) and torch.equal(doubled["a"][1][0], torch.ones(1))


def test_mappings_of_any_kind_are_split_and_keep_their_type():
    from collections import UserDict, defaultdict

    from transformers import BatchEncoding

    ids = torch.arange(12).reshape(6, 2)
    for batch in (BatchEncoding({"input_ids": ids, "labels": ids}), UserDict({"input_ids": ids}),
                  defaultdict(list, {"input_ids": ids})):
        parts = [m for m, _ in micro_batches(batch, 4)]
        assert [type(p) for p in parts] == [type(batch)] * 2
        assert torch.equal(parts[1]["input_ids"], ids[4:])
    moved = map_tensors(lambda t: t + 1, BatchEncoding({"input_ids": ids, "nested": {"m": ids}}))
    assert isinstance(moved, BatchEncoding) and torch.equal(moved["nested"]["m"], ids + 1)


def test_detection_collate_is_split_by_sample():
    # torchvision's detection references: collate_fn = lambda batch: tuple(zip(*batch))
    images = tuple(torch.rand(3, 20 + i, 30 - i) for i in range(4))
    targets = tuple({"boxes": torch.rand(k, 4), "labels": torch.ones(k, dtype=torch.int64)} for k in (1, 3, 2, 1))
    batch = (images, targets)
    assert batch_len(batch) == 4
    parts = [m for m, _ in micro_batches(batch, 3)]
    assert [len(p[0]) for p in parts] == [2, 2] and isinstance(parts[0], tuple)  # 3 and 1: two of two
    assert parts[1][0][1] is images[3] and parts[1][1][1] is targets[3]
    # same-size images, a box each: reads as fields; PerSample says what it is
    same = (tuple(torch.rand(3, 8, 8) for _ in range(3)), tuple({"boxes": torch.rand(1, 4)} for _ in range(3)))
    marked = tuple(PerSample(part) for part in same)
    assert batch_len(marked) == 3
    first = slice_batch(marked, 0, 1)
    assert isinstance(first[0], PerSample) and first[0][0].shape == (3, 8, 8)


def test_a_tuple_of_fields_is_never_read_as_samples():
    x, y = torch.randn(2, 5), torch.randn(2, 5)  # two fields of 2 samples; also 2 items alike
    assert batch_len((x, y)) == 2
    assert torch.equal(slice_batch((x, y), 1, 2)[1], y[1:])
    pair = Fields((torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)))
    assert batch_len(pair) == 3 and slice_batch(pair, 0, 1)[2].shape == (1, 4)


def test_parts_that_read_no_way_are_an_error_naming_them():
    with pytest.raises(ValueError, match="disagree.*'y'"):
        batch_len({"x": torch.zeros(4), "y": torch.zeros(5)})
    with pytest.raises(ValueError, match="disagree"):
        batch_len((torch.zeros(4, 2), torch.zeros(5, dtype=torch.int64)))


def test_no_micro_batch_is_left_with_one_sample_where_more_were_asked_for():
    """BatchNorm in training refuses one sample: a batch of 65 at 32 ran 32, 32, 1 and died
    ("Expected more than 1 value per channel"), where the plain loop's 65 ran. At 2, an odd batch
    cannot be split without one."""
    assert sizes(torch.zeros(65), 32) == [32, 17, 16]
    assert sizes(torch.zeros(9), 4, start=4) == [3, 2]
    assert sizes(torch.zeros(5), 1) == [1] * 5 and sizes(torch.zeros(1), 4) == [1]
    for n in range(1, 40):
        for size in range(1, 12):
            parts = sizes(torch.zeros(n), size)
            assert sum(parts) == n and max(parts) <= size and len(parts) == -(-n // size), (n, size, parts)
            assert 1 not in parts or size <= 2 or n == 1, (n, size, parts)  # at 2, an odd batch has one
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    for micro, _ in micro_batches(torch.randn(65, 4), 32):
        model(micro)
