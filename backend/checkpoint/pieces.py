"""A rank's share of global tensors as DCP sees it, and what DCP's plans say about a checkpoint's bytes.

    state = {"model.w": Pieces(size, dtype)}; state["model.w"].add(offsets, view, writes=True)
    dcp.save(state, checkpoint_id=path, planner=save_planner())

Pieces hands DCP the rectangles this rank holds of one global tensor, each a view into the rank's own flat state,
so DCP writes from them and loads into them in place whatever mesh saved the checkpoint. The planners find a Pieces'
data by its offsets (DCP's own lookup knows only torch.Tensor subclasses); recording_planner keeps the load plan, which
read_map turns into a resharding map: which saved file's bytes each new rank reads.
"""
from __future__ import annotations

from pathlib import Path

import torch


def recording_planner():
    """DCP's default load planner, keeping the plan it made for this rank (the reads the load performs), and loading
    into Pieces (found by their offsets)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class Recording(DefaultLoadPlanner):
        local_plan = None

        def create_local_plan(self):
            self.local_plan = super().create_local_plan()
            return self.local_plan

        def lookup_tensor(self, index):
            return lookup(self.state_dict, index)

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            pieces = {k: v for k, v in state_dict.items() if isinstance(v, Pieces)}
            super().set_up_planner(state_dict, metadata, is_coordinator)  # (its _init_state_dict makes them None)
            state_dict.update(pieces)
            self.state_dict.update(pieces)

    return Recording()


def _saved_rank(relative_path: str) -> int:
    """DCP's file names are __<rank>_<i>.distcp: the rank that wrote it."""
    return int(relative_path.split("_")[2])


def _chunk(entry, index):
    """The saved chunk (piece of a global tensor) a MetadataIndex names, by its offsets."""
    offset = tuple(index.offset or (0,) * len(entry.size))
    return next(c for c in entry.chunks if tuple(c.offsets) == offset)


def _nbytes(entry, sizes) -> int:
    """Bytes of a piece of `sizes` of a saved tensor (`entry`: its metadata)."""
    return entry.properties.dtype.itemsize * int(torch.Size(sizes).numel())


def key_layout(metadata) -> dict[str, tuple[int, int]]:
    """Each saved tensor's [start, end) in bytes when the checkpoint's tensors are laid end to end by name: the
    one axis on which a resharding map is drawn."""
    out, at = {}, 0
    for key in sorted(metadata.state_dict_metadata):
        entry = metadata.state_dict_metadata[key]
        if hasattr(entry, "chunks"):
            out[key] = (at, at + _nbytes(entry, entry.size))
            at = out[key][1]
    return out


def read_map(items, metadata, rank: int) -> list[dict]:
    """The resharding map of one rank's load: for each of its plan's reads, the saved file (so the saved rank) it
    reads from, the key, and the bytes [from, from + bytes) of the key it copies, as byte offsets in key_layout.
    DCP plans a read wherever a saved chunk overlaps a chunk this rank holds; a non-tensor item is left out."""
    layout, rows = key_layout(metadata), []
    for item in items:
        entry = metadata.state_dict_metadata[item.storage_index.fqn]
        if not hasattr(entry, "chunks"):
            continue
        chunk, info = _chunk(entry, item.storage_index), metadata.storage_data[item.storage_index]
        first = [c + o for c, o in zip(chunk.offsets, item.storage_offsets)]
        strides = [int(torch.Size(entry.size[i + 1:]).numel()) for i in range(len(entry.size))]
        at = layout[item.storage_index.fqn][0] + _nbytes(entry, [sum(f * s for f, s in zip(first, strides))])
        rows.append({"new rank": rank, "key": item.storage_index.fqn, "saved rank": _saved_rank(info.relative_path),
                     "file": info.relative_path, "from byte": at, "bytes": _nbytes(entry, item.lengths)})
    return rows


def staged_copy(state: dict) -> dict:
    """A copy of the state for a save that writes while training goes on: Pieces over cloned views, tensors cloned
    (DCP's own stager cannot copy a Pieces)."""
    return {k: v.staged() if isinstance(v, Pieces) else v.detach().clone() for k, v in state.items()}


class Stager:
    """DCP's AsyncStager protocol, staging by staged_copy (the call async_save makes before it returns)."""
    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return staged_copy(state_dict)

def pieces(path: Path) -> list[dict]:
    """Every tensor piece a checkpoint's files hold, from DCP's metadata: file, the rank that wrote it, key, bytes."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(path)).read_metadata()
    out = []
    for index, info in md.storage_data.items():
        entry = md.state_dict_metadata[index.fqn]
        if hasattr(entry, "chunks"):
            out.append({"file": info.relative_path, "rank": _saved_rank(info.relative_path), "key": index.fqn,
                        "bytes": _nbytes(entry, _chunk(entry, index).sizes)})
    return out


class Pieces:
    """One global tensor (a reference parameter, or Adam's m or v of one) as this rank holds it: rectangles at their
    offsets in the global tensor, each a view into the rank's own flat state, so DCP writes from it and loads into it
    in place. DCP reads the chunk metadata from it: __create_chunk_list__ (what a load must fill: every piece) and
    __create_write_items__ (what a save writes: the pieces this rank is the writer of); DCP's load plan then reads
    each saved chunk where it overlaps a piece, whatever mesh saved it. Looked up by offsets through lookup."""

    def __init__(self, size, dtype: torch.dtype):
        self._size, self.dtype = torch.Size(size), dtype
        self.pieces: list[tuple[torch.Size, torch.Tensor, bool]] = []  # (offsets, view, written by this rank)

    def add(self, offsets, view: torch.Tensor, writes: bool) -> None:
        self.pieces.append((torch.Size(offsets), view, writes))

    def size(self) -> torch.Size:
        return self._size

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=o, sizes=v.size()) for o, v, _ in self.pieces]

    def __create_write_items__(self, fqn: str, _obj):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, o), type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=o, sizes=v.size()),
                    properties=TensorProperties.create_from_tensor(v), size=self._size))
                for o, v, writes in self.pieces if writes]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        return next(v for o, v, _ in self.pieces if o == torch.Size(index.offset))

    def local_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for _, v, _ in self.pieces)

    def staged(self) -> "Pieces":
        """A copy whose views are cloned (an async save writes it while training goes on)."""
        out = Pieces(self._size, self.dtype)
        out.pieces = [(o, v.clone(), w) for o, v, w in self.pieces]
        return out


def local_bytes(value) -> int:
    """Bytes of a state dict's value this rank holds: a Pieces' pieces, or a plain tensor."""
    return value.local_bytes() if isinstance(value, Pieces) else value.numel() * value.element_size()


def lookup(state_dict: dict, index):
    """DCP's find_state_dict_object, which finds a piece only in a torch.Tensor subclass, extended to Pieces."""
    from torch.distributed.checkpoint.utils import find_state_dict_object

    obj = state_dict.get(index.fqn)
    return obj.__get_tensor_shard__(index) if isinstance(obj, Pieces) else find_state_dict_object(state_dict, index)


def save_planner():
    """DCP's default save planner, finding the data of a Pieces' write item by its offsets; an item several ranks hold
    (a replicated tensor, identical chunks of dp replicas) is written by the lowest of them (dedup_save_to_lowest_rank),
    not by whichever plan is smallest so far, so each rank's share of the files follows from the plan alone."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class PiecesSavePlanner(DefaultSavePlanner):
        def lookup_object(self, index):
            return lookup(self.state_dict, index)

    return PiecesSavePlanner(dedup_save_to_lowest_rank=True)
