"""A sharded model's checkpoint: a folder that `torch.distributed.checkpoint` (DCP) writes, each
rank its own shards, so no rank ever holds the whole model.

    step-000000012/
      .metadata            DCP's index: which file holds which slice of which tensor
      __0_0.distcp ...     every rank's shards of the weights and the optimizer state
      rest.pt              the rest (counters, sizes, policies, every rank's random state), rank 0's

Only the tensors of the model and the optimizer go through DCP. DCP stores anything else as a
pickle and loads it with `weights_only=False`; everything else is in `rest.pt`, where a tensor
DCP holds stands as `IN_DCP` and which `torch.load(weights_only=True)` reads: a checkpoint
still holds tensors and plain data, never code. DCP's own `.metadata` is a pickle its reader
loads whole; here it is read by `_MetadataUnpickler`, which builds DCP's metadata classes, torch's
sizes and dtypes, and paths, each named one by one, and refuses any other name, dotted ones included
(a planted payload never runs).

Loading needs somewhere to put the shards: the state of the model as it is now (its DTensors,
the optimizer's state), which DCP fills in place, each rank reading the slices it owns. (DCP
could reshard onto another number of ranks; a run resumes on as many as it had, since every
rank's random state is saved as that rank's: `checkpoint_format.rank_rng`.)

The DCP keys are "model/<name>" and "optimizer/<path>" in every format: format 2 keeps the two
entries in its "core" section, format 1 at the top (checkpoint_format.py), and both are read alike.

Owns: the folder's layout (DCP's files and rest.pt), and the state a checkpoint is read into. Touches
nothing else.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

SHARDED_ENTRIES = ("model", "optimizer")  # the entries of a state whose tensors are sharded
IN_DCP = "<a tensor in the .distcp files>"
REST = "rest.pt"


def _map(value: Any, where: str, leaf: Callable[[Any, str], Any]) -> Any:
    # `value` rebuilt with `leaf(item, path)` for every item that is not a dict, list or tuple.
    if isinstance(value, dict):
        return {key: _map(item, f"{where}/{key}", leaf) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map(item, f"{where}/{index}", leaf) for index, item in enumerate(value))
    return leaf(value, where)


def _in_dcp(value: Any) -> bool:
    return isinstance(value, str) and value == IN_DCP


def _entries(state: dict[str, Any]) -> dict[str, Any]:
    # The dict holding the sharded entries: format 2's "core" section, or the state itself (format 1).
    core = state.get("core")
    return core if isinstance(core, dict) and any(key in core for key in SHARDED_ENTRIES) else state


def _map_entries(state: dict[str, Any], leaf: Callable[[Any, str], Any]) -> dict[str, Any]:
    # `state` with `leaf` mapped over its sharded entries' items, wherever the format keeps them.
    holder = _entries(state)
    entries = {key: _map(value, key, leaf) if key in SHARDED_ENTRIES else value for key, value in holder.items()}
    return {**state, "core": entries} if holder is not state else entries


def split(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the sharded entries' tensors by path, the state with `IN_DCP` in their place)."""
    tensors: dict[str, torch.Tensor] = {}

    def take(value: Any, where: str) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        tensors[where] = value
        return IN_DCP

    rest = _map_entries(state, take)
    return tensors, rest


def join(rest: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The state `split` took apart, each `IN_DCP` replaced by its tensor."""

    def put(value: Any, where: str) -> Any:
        return tensors[where] if _in_dcp(value) else value

    return _map_entries(rest, put)


def needed(rest: dict[str, Any]) -> list[str]:
    """The paths of the tensors `rest` says DCP holds."""
    found: list[str] = []
    entries = _entries(rest)
    for key in SHARDED_ENTRIES:
        if key in entries:
            _map(entries[key], key, lambda value, where: found.append(where) if _in_dcp(value) else None)
    return found


def write_shards(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """Every rank at once: its shards into `folder` (DCP's coordinator, rank 0, writes the index
    last, once every rank's files are written and fsynced)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(tensors, checkpoint_id=folder)


def read_rest(folder: Path) -> dict[str, Any]:
    """The non-sharded part of the checkpoint in `folder`."""
    return torch.load(folder / REST, map_location="cpu", weights_only=True)


def read_shards(folder: Path, rest: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    """Every rank at once: the whole state, its shards read from `folder` into `template`'s
    tensors (the state now, of a model sharded as the one that was saved, or otherwise)."""
    import torch.distributed.checkpoint as dcp

    places, _ = split(template)
    paths = needed(rest)
    missing = [path for path in paths if path not in places]
    if missing:
        raise ValueError(f"{folder} holds {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}, "
                         "which this model and optimizer have no place for: is it the same model?")
    wanted = {path: places[path] for path in paths}
    dcp.load(wanted, storage_reader=_data_only_reader(folder))
    return join(rest, wanted)


# Every (module, name) a DCP `.metadata` pickle may name, each a class or function that builds data.
# Listed one by one, never a whole module: from pickle protocol 4 a name may be dotted
# ("os.mkdir" looked up in a module that imports os), so a module-wide rule lets code in.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_METADATA_NAMES = frozenset({
    *((_DCP_METADATA, name) for name in ("BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex",
                                         "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                                         "_MEM_FORMAT_ENCODING")),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
})


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes and plain data only: any other name, and any dotted one, is refused,
    naming it."""

    path: Path

    def find_class(self, module: str, name: str) -> Any:
        allowed = "." not in name and ((module, name) in _METADATA_NAMES
                                       or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not allowed:
            raise pickle.UnpicklingError(f"{self.path} names {module}.{name}, which is not checkpoint metadata: "
                                         "refused (a checkpoint holds data, never code)")
        return super().find_class(module, name)


def _data_only_reader(folder: Path) -> Any:
    """DCP's file reader, with its `.metadata` read by `_MetadataUnpickler`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class DataOnlyReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = folder / ".metadata"
            with open(path, "rb") as f:
                unpickler = _MetadataUnpickler(f)
                unpickler.path = path
                metadata = unpickler.load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return DataOnlyReader(folder)


def template_for_shards(state: dict[str, Any], model: nn.Module,
                        optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """`state` (a host's state now) as where a sharded checkpoint's shards are read into: the weights
    and the optimizer state by parameter name, as the sharded job wrote them. One process reads
    whole tensors there (DCP assembles each from every rank's shards); a sharded job its own shards
    (what its state holds already: ranks/sharded.py's `sharded_state`)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state["core"]["model"] = get_model_state_dict(model)
    state["core"]["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state
