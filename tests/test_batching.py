import collections

import numpy as np
import pytest
import torch

from autotune.batching import batch_len, check_splittable, micro_batches, slice_batch


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
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6]]


def test_start_skips_samples_already_done():
    assert sizes(torch.zeros(10), 3, start=4) == [3, 3]


def test_lengths_that_disagree_are_an_error():
    with pytest.raises(ValueError, match="disagree"):
        batch_len((torch.zeros(4), torch.zeros(5)))


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

    from autotune.batching import map_tensors

    Pair = namedtuple("Pair", "x y")
    batch = {"a": [torch.ones(2), (torch.zeros(1), "label")], "b": Pair(torch.ones(3), 7)}
    doubled = map_tensors(lambda t: t + 1, batch)
    assert isinstance(doubled["b"], Pair) and doubled["b"].y == 7 and torch.equal(doubled["b"].x, torch.full((3,), 2.0))
    assert torch.equal(doubled["a"][0], torch.full((2,), 2.0)) and doubled["a"][1][1] == "label"
    assert isinstance(doubled["a"][1], tuple) and torch.equal(doubled["a"][1][0], torch.ones(1))
