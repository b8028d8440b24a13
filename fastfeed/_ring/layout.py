"""How a batch is laid into a slot (worker side) and read back (main side).

The batch structure is pickled with every tensor leaf replaced by a persistent
id, so any container a collate function returns (dicts, namedtuples, custom
mappings, dataclasses) comes back with its own type. The leaves' bytes are
written once, straight into slot memory; the main process rebuilds them as
zero-copy views of that memory.
"""

from __future__ import annotations

import io
import math
import pickle

import torch
from torch.utils.data._utils.collate import collate, default_collate_fn_map

from .._native import C
from .leaf import Leaf

ALIGN = 64  # cache-line alignment keeps every dtype view legal and copies fast
# Leaves at least this large are copied by the native gather (streaming stores);
# below it, torch.stack is as fast and the per-sample checks would dominate.
GATHER_MIN_SAMPLE_BYTES = 16 * 1024


class Stack:
    """A batch of equal tensors that will be stacked straight into the slot.

    It stands for ``torch.stack(tensors)`` until the slot is known, so the
    default collate never allocates a tensor of its own.
    """

    __slots__ = ("tensors", "shape", "dtype")

    def __init__(self, tensors):
        elem = tensors[0]
        self.tensors = tensors
        self.shape = (len(tensors), *elem.shape)
        self.dtype = elem.dtype


def _stack_later(batch, *, collate_fn_map=None):
    elem = batch[0]
    # Same checks and messages as torch's collate_tensor_fn.
    if elem.is_nested:
        raise RuntimeError(
            "Batches of nested tensors are not currently supported by the default collate_fn; "
            "please provide a custom collate_fn to handle them appropriately."
        )
    if elem.layout != torch.strided:
        raise RuntimeError(
            "Batches of sparse tensors are not currently supported by the default collate_fn; "
            "please provide a custom collate_fn to handle them appropriately."
        )
    return Stack(batch)


# torch's own map and traversal, with only the tensor rule changed: containers,
# numpy arrays, numbers and strings behave exactly as in default_collate.
_slot_collate_fn_map = dict(default_collate_fn_map)
_slot_collate_fn_map[torch.Tensor] = _stack_later


def slot_collate(batch):
    """``default_collate`` whose tensors are stacked later, into the slot."""
    return collate(batch, collate_fn_map=_slot_collate_fn_map)


def _is_plain(t: torch.Tensor) -> bool:
    # Only dense CPU tensors live in slots; anything else pickles as torch does.
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and t.device.type == "cpu"
        and not t.is_nested
        and not t.is_quantized
        and (not t.requires_grad or t.is_leaf)
    )


class _LeafPickler(pickle.Pickler):
    def __init__(self, file, leaves):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.leaves = leaves
        self.seen = {}  # id -> leaf index, so a tensor used twice stays one tensor

    def persistent_id(self, obj):
        if type(obj) is Stack or (isinstance(obj, torch.Tensor) and _is_plain(obj)):
            key = id(obj)
            pid = self.seen.get(key)
            if pid is None:
                pid = self.seen[key] = len(self.leaves)
                self.leaves.append(obj)
            return pid
        return None


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _dense_order(t: torch.Tensor) -> tuple | None:
    """The dimension order in which a dense, non-contiguous tensor is contiguous, else None.

    A transposed or channels_last tensor keeps its strides through the slot at
    no extra cost. A sliced or expanded one is copied contiguous: matching its
    strides would mean shipping the whole storage it views.
    """
    if t.is_contiguous():
        return None
    strides = t.stride()
    order = tuple(sorted(range(t.dim()), key=lambda d: -strides[d]))
    return order if t.permute(order).is_contiguous() else None


def plan(batch):
    """Pickle the structure and place every leaf.

    Returns:
        (payload, leaf objects, layout as a list of ``Leaf``, total bytes)
    """
    buf = io.BytesIO()
    objs: list = []
    _LeafPickler(buf, objs).dump(batch)
    layout = []
    offset = 0
    for obj in objs:
        if type(obj) is Stack:
            shape, dtype, grad, order = obj.shape, obj.dtype, False, None
        else:
            shape, dtype, grad, order = tuple(obj.shape), obj.dtype, obj.requires_grad, _dense_order(obj)
        offset = -(-offset // ALIGN) * ALIGN
        layout.append(Leaf(offset, dtype, shape, grad, order))
        offset += _nbytes(shape, dtype)
    return buf.getvalue(), objs, layout, offset


def view(base: torch.Tensor, leaf: Leaf) -> torch.Tensor:
    """The tensor ``leaf`` describes, as a view of the uint8 slot tensor ``base``."""
    n = _nbytes(leaf.shape, leaf.dtype)
    flat = base[leaf.offset : leaf.offset + n].view(leaf.dtype)
    if leaf.perm is None:
        return flat.view(leaf.shape)
    inverse = sorted(range(len(leaf.perm)), key=leaf.perm.__getitem__)
    return flat.view([leaf.shape[d] for d in leaf.perm]).permute(inverse)


def _gatherable(stack: Stack) -> bool:
    """Whether every sample is plain contiguous CPU memory of the batch's dtype and shape.

    Anything else goes through torch.stack, which casts, or raises torch's own error
    (a sample that requires grad cannot be stacked into ``out=``, as in torch's workers).
    """
    shape, dtype = stack.shape[1:], stack.dtype
    return all(
        _is_plain(t)
        and not t.requires_grad
        and t.dtype == dtype
        and t.shape == shape
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
        for t in stack.tensors
    )


def fill(base: torch.Tensor, objs, layout) -> None:
    """Write every leaf into slot memory: the batch's one and only copy."""
    for obj, leaf in zip(objs, layout):
        dest = view(base, leaf)
        if type(obj) is not Stack:
            dest.copy_(obj.detach())
        elif obj.tensors[0].nbytes >= GATHER_MIN_SAMPLE_BYTES and _gatherable(obj):
            C.gather(dest.data_ptr(), [(t.data_ptr(), t.nbytes) for t in obj.tensors])
        else:
            torch.stack(obj.tensors, 0, out=dest)


MAX_PIECES = 512  # a gathering send takes at most IOV_MAX (1024) buffers a call; many more are small samples anyway


def pieces(objs, layout, nbytes: int) -> list[memoryview] | None:
    """The slot's bytes as the memory they are in, in order, padding included: what ``fill`` would lay down, for a
    gathering send (``sendmsg``) that reads them where they are. A leaf that is not plain contiguous memory, or
    whose samples are too small to be worth a buffer each, is laid out by ``fill`` in a buffer of its own. None
    where that would still be more than ``MAX_PIECES`` buffers: ``fill`` the whole batch instead."""
    out: list[memoryview] = []
    at = 0
    for obj, leaf in zip(objs, layout):
        if leaf.offset > at:
            out.append(memoryview(bytes(leaf.offset - at)))
        size = _nbytes(leaf.shape, leaf.dtype)
        if type(obj) is Stack:
            direct = obj.tensors if obj.tensors[0].nbytes >= GATHER_MIN_SAMPLE_BYTES and _gatherable(obj) else None
        else:
            direct = (obj,) if _is_plain(obj) and obj.is_contiguous() else None
        if direct is not None and not any(t.is_conj() or t.is_neg() for t in direct):  # lazy: memory is not value
            out += [memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()) for t in direct if t.nbytes]
        elif size:
            own = torch.empty(size, dtype=torch.uint8)
            fill(own, (obj,), (leaf._replace(offset=0),))
            out.append(memoryview(own.numpy()))
        at = leaf.offset + size
        if len(out) > MAX_PIECES:
            return None
    return out if at == nbytes else None


def unpack(payload: bytes, layout, base: torch.Tensor | None):
    """Rebuild the batch: tensor leaves become views of ``base``."""
    if base is None:  # a batch without tensor bytes
        views = [view(torch.empty(0, dtype=torch.uint8), leaf) for leaf in layout]
    else:
        views = [view(base, leaf) for leaf in layout]
    for v, leaf in zip(views, layout):
        if leaf.requires_grad:
            v.requires_grad_()
    unpickler = pickle.Unpickler(io.BytesIO(payload))
    unpickler.persistent_load = views.__getitem__
    return unpickler.load()
