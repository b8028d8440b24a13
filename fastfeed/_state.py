"""Random-number-generator and dataset states, for ``DataLoader.state_dict()``.

Snapshots are taken often (workers take one after every task), so ``snapshot`` only
copies the states; ``to_plain`` turns one into plain Python and tensors (what
``torch.save`` and ``torch.load(weights_only=True)`` accept) when it is asked for.
"""

from __future__ import annotations

import array
import copy
import ctypes
import random
import sys

import torch


def is_stateful_dataset(dataset) -> bool:
    """An IterableDataset whose position we save and restore through its own methods."""
    return isinstance(dataset, torch.utils.data.IterableDataset) and all(
        callable(getattr(dataset, name, None)) for name in ("state_dict", "load_state_dict")
    )


def _numpy():
    return sys.modules.get("numpy")  # numpy's RNG matters only where numpy was imported


# random.getstate() and numpy.random.get_state() build tuples of 624 ints (9 and 32 us):
# too slow to take after every task. The same bytes are copied straight from the two
# generator objects instead (under 1 us), at offsets checked once against getstate().
_PY_OFFSET = 16  # _random.Random: PyObject_HEAD, then int index, uint32 state[624]
_MT_BYTES = 4 + 624 * 4
_NP_STATE_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624], int pos


def _py_fast():
    inst = random._inst
    return ctypes.string_at(id(inst) + _PY_OFFSET, _MT_BYTES), inst.gauss_next


def _py_plain(fast) -> tuple:
    raw, gauss_next = fast
    key = array.array("I")
    key.frombytes(raw[4:])
    return (3, (*key, int.from_bytes(raw[:4], sys.byteorder)), gauss_next)


def _find_np_gauss_offset(rs) -> int | None:
    # RandomState holds its bitgen_t (5 pointers) followed by aug_bitgen_t {bitgen_t *, int has_gauss, double gauss}.
    base = id(rs)
    for offset in range(16, type(rs).__basicsize__ - 24, 8):
        if ctypes.c_void_p.from_address(base + offset).value == base + offset - 40:
            return offset
    return None


class _NumpyFast:
    def __init__(self, np):
        self.rs = np.random.mtrand._rand
        self.state_address = self.rs._bit_generator.ctypes.state_address
        self.gauss_offset = _find_np_gauss_offset(self.rs)

    def take(self):
        base = id(self.rs)
        return (
            ctypes.string_at(self.state_address, _NP_STATE_BYTES),
            ctypes.c_int.from_address(base + self.gauss_offset + 8).value,
            ctypes.c_double.from_address(base + self.gauss_offset + 16).value,
        )


def _np_plain(fast) -> tuple:
    import numpy as np

    raw, has_gauss, gauss = fast
    keys = np.frombuffer(raw[: 624 * 4], dtype=np.uint32).copy()
    pos = int.from_bytes(raw[624 * 4 :], sys.byteorder, signed=True)
    return ("MT19937", keys, pos, has_gauss, gauss)


def _same_np(a, b) -> bool:
    return a[0] == b[0] and (a[1] == b[1]).all() and a[2:] == b[2:]


_fast = {}  # "random": bool, "numpy": _NumpyFast | None, decided on first use


def _fast_paths():
    if "random" not in _fast:
        try:
            _fast["random"] = _py_plain(_py_fast()) == random.getstate()
        except Exception:  # noqa: BLE001 - any surprise means: use getstate()
            _fast["random"] = False
    np = _numpy()
    if np is not None and "numpy" not in _fast:
        fast = None
        try:
            saved = np.random.get_state()
            candidate = _NumpyFast(np)
            if candidate.gauss_offset is not None:
                np.random.normal()  # caches a gaussian: the check covers has_gauss and gauss too
                if _same_np(_np_plain(candidate.take()), np.random.get_state()):
                    fast = candidate
            np.random.set_state(saved)
        except Exception:  # noqa: BLE001
            fast = None
        _fast["numpy"] = fast
    return _fast


def snapshot() -> tuple:
    """The process's global RNG states (torch, random, numpy), copied cheaply."""
    fast = _fast_paths()
    np = _numpy()
    py_state = ("fast", _py_fast()) if fast["random"] else random.getstate()
    if np is None:
        np_state = None
    elif fast.get("numpy") is not None and np.random.mtrand._rand is fast["numpy"].rs:
        np_state = ("fast", fast["numpy"].take())
    else:
        np_state = np.random.get_state()
    return torch.get_rng_state(), py_state, np_state


def rngs_to_plain(snap: tuple) -> dict:
    torch_state, py_state, np_state = snap
    if py_state[0] == "fast":
        py_state = _py_plain(py_state[1])
    if np_state is not None and np_state[0] == "fast":
        np_state = _np_plain(np_state[1])
    plain = {"torch": torch_state, "random": py_state, "numpy": None}
    if np_state is not None:
        name, keys, pos, has_gauss, gauss = np_state
        plain["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))
    return plain


def restore_rngs(plain: dict) -> None:
    """Set the global RNGs to a state made by ``rngs_to_plain``."""
    torch.set_rng_state(plain["torch"])
    random.setstate(plain["random"])
    np = _numpy()
    if plain["numpy"] is not None:
        if np is None:
            import numpy as np
        name, keys, pos, has_gauss, gauss = plain["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def main_rngs(generator) -> dict:
    """The main process's RNG states: global ones plus the loader's generator."""
    plain = rngs_to_plain(snapshot())
    plain["generator"] = None if generator is None else generator.get_state()
    return plain


def restore_main_rngs(plain: dict, generator) -> None:
    restore_rngs(plain)
    if generator is not None and plain["generator"] is not None:
        generator.set_state(plain["generator"])


def sampler_rngs(generator) -> dict:
    """What a sampler draws from: the global torch RNG and the loader's generator."""
    return {"torch": torch.get_rng_state(), "generator": None if generator is None else generator.get_state()}


def restore_sampler_rngs(plain: dict, generator) -> None:
    torch.set_rng_state(plain["torch"])
    if generator is not None and plain["generator"] is not None:
        generator.set_state(plain["generator"])


def dataset_state(dataset):
    """A stateful dataset's state, copied so that later changes to the dataset do not alter it."""
    return copy.deepcopy(dataset.state_dict())
