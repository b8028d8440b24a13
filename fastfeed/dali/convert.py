"""DALI outputs to torch tensors: one copy, from DALI's buffer (reused by its next run) into a new tensor.

A CPU output bound for a GPU is copied into a reused pinned buffer instead, and from there to the GPU without
blocking the host (``staging``).
"""

from __future__ import annotations

import ctypes

import torch
from nvidia.dali import types
from nvidia.dali.tensors import TensorListGPU

from .staging import PinnedStaging

TORCH_TYPES = {
    types.DALIDataType.FLOAT: torch.float32,
    types.DALIDataType.FLOAT64: torch.float64,
    types.DALIDataType.FLOAT16: torch.float16,
    types.DALIDataType.UINT8: torch.uint8,
    types.DALIDataType.INT8: torch.int8,
    types.DALIDataType.BOOL: torch.bool,
    types.DALIDataType.INT16: torch.int16,
    types.DALIDataType.INT32: torch.int32,
    types.DALIDataType.INT64: torch.int64,
}


class Converter:
    """Turns a run's outputs into ``{name: tensor}``, trimmed to the real samples of a padded last batch."""

    def __init__(self, names: list[str], device: torch.device | None):
        self.names = names
        self.device = device
        self._staging = PinnedStaging(device) if device is not None and device.type == "cuda" else None

    def __call__(self, outputs, real: int | None) -> dict:
        if len(outputs) != len(self.names):
            raise ValueError(f"the pipeline has {len(outputs)} outputs but output_map names {len(self.names)}: "
                             f"{self.names}")  # fmt: skip
        return {name: self._tensor(name, out, real) for name, out in zip(self.names, outputs)}

    def _tensor(self, name: str, out, real: int | None) -> torch.Tensor:
        if not out.is_dense_tensor():
            shapes = sorted({tuple(s) for s in out.shape()})
            raise ValueError(f"output {name!r} holds samples of different shapes ({shapes[:4]}...): DALILoader "
                             "yields dense tensors, so resize or crop to one shape in the pipeline (or pad with "
                             "fn.pad)")  # fmt: skip
        dtype = TORCH_TYPES.get(out.dtype)
        if dtype is None:
            raise TypeError(f"output {name!r} has DALI type {out.dtype}, which torch has no type for: cast it in the "
                            "pipeline (fn.cast)")  # fmt: skip
        dense = out.as_tensor()
        shape = dense.shape()
        if isinstance(out, TensorListGPU):
            gpu = torch.device("cuda", dense.device_id())
            tensor = torch.empty(shape, dtype=dtype, device=gpu)
            stream = torch.cuda.current_stream(gpu)
            # On the consumer's stream: work queued after this on it sees the batch, without a host sync.
            dense.copy_to_external(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_void_p(stream.cuda_stream),
                                   non_blocking=True)  # fmt: skip
        elif self._staging is not None:

            def fill(host: torch.Tensor) -> None:
                dense.copy_to_external(ctypes.c_void_p(host.data_ptr()))

            return self._staging.copy(name, shape, dtype, fill, real)
        else:
            tensor = torch.empty(shape, dtype=dtype)
            dense.copy_to_external(ctypes.c_void_p(tensor.data_ptr()))
        if real is not None:
            tensor = tensor[:real]
        if self.device is not None and tensor.device != self.device:
            tensor = tensor.to(self.device, non_blocking=self.device.type == "cuda" and tensor.is_pinned())
        return tensor
