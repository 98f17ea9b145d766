"""Device memory that gives its physical pages back and takes new ones at the same address.

CUDA graphs hold the addresses of the buffers they read and write. A buffer freed through
PyTorch's allocator while training runs comes back elsewhere, and every graph on it must be
captured again. `StableBuffer` reserves a range of virtual addresses once and maps physical
memory into it; `release` unmaps that memory and returns it to the driver (the range stays
reserved, so PyTorch's allocator can use the memory meanwhile); `restore` maps new memory at the
same addresses. Tensors made by `view` keep their `data_ptr` through both, so graphs captured on
them stay valid. This is how the native engine frees its KV cache for training and keeps its
decode graphs (engine/rollout/model.py's `KVCache`).

Invariants:
- while released, nothing may read or write the buffer's tensors (the device would fault);
  owners check `mapped` first;
- after `restore` the contents are undefined: an owner that needs zeros writes them;
- `mapped_bytes()` is what all buffers of this process hold now. PyTorch's allocator statistics
  do not see this memory, so peak-memory reports use `peak_bytes()`, which adds it.

The CUDA driver's virtual memory calls (cuMemAddressReserve, cuMemCreate, cuMemMap,
cuMemSetAccess, cuMemUnmap, cuMemRelease), reached through ctypes: PyTorch does not expose them,
and the libraries that do tie a build to one CUDA major version.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

_MAPPED = [0]  # bytes mapped by every StableBuffer of this process


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_PINNED, _ON_DEVICE, _READ_WRITE, _OUT_OF_MEMORY = 1, 1, 3, 2


@functools.cache
def _driver() -> Any:
    return ctypes.CDLL("libcuda.so.1")


def _check(result: int, call: str, nbytes: int = 0) -> None:
    if result == 0:
        return
    text = ctypes.c_char_p()
    _driver().cuGetErrorString(result, ctypes.byref(text))
    message = f"{call} failed: {(text.value or b'').decode()} (CUresult {result})"
    if result == _OUT_OF_MEMORY:
        raise torch.OutOfMemoryError(f"{message}, mapping {nbytes / 2**30:.2f} GiB")
    raise RuntimeError(message)


class _Range:
    """A reserved address range and the physical memory mapped into it, if any. Seen by torch as
    `__cuda_array_interface__`; every tensor viewing it keeps it alive, and the last one to go
    unmaps it and frees the range."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.nbytes = ptr, nbytes
        self.handle: int | None = None
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}

    def map(self, prop: _Prop) -> None:
        """New physical memory of `prop` at the range's addresses, readable and writable there."""
        cuda, at, size = _driver(), ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.nbytes)
        handle = ctypes.c_uint64()
        _check(cuda.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(prop), ctypes.c_uint64(0)),
               "cuMemCreate", self.nbytes)
        try:
            _check(cuda.cuMemMap(at, size, ctypes.c_size_t(0), handle, ctypes.c_uint64(0)), "cuMemMap")
            access = _Access(prop.location, _READ_WRITE)
            _check(cuda.cuMemSetAccess(at, size, ctypes.byref(access), ctypes.c_size_t(1)), "cuMemSetAccess")
        except RuntimeError:
            cuda.cuMemUnmap(at, size)
            cuda.cuMemRelease(handle)
            raise
        self.handle = handle.value
        _MAPPED[0] += self.nbytes

    def unmap(self) -> None:
        if self.handle is None:
            return
        _check(_driver().cuMemUnmap(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.nbytes)), "cuMemUnmap")
        _check(_driver().cuMemRelease(ctypes.c_uint64(self.handle)), "cuMemRelease")
        self.handle = None
        _MAPPED[0] -= self.nbytes

    def __del__(self) -> None:
        try:
            torch.cuda.synchronize()
            self.unmap()
            _driver().cuMemAddressFree(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.nbytes))
        except Exception:  # noqa: BLE001 - at interpreter exit the driver may be gone before us
            pass


def mapped_bytes() -> int:
    """Bytes the StableBuffers of this process hold on the device now."""
    return _MAPPED[0]


def peak_bytes() -> int:
    """The CUDA peak a phase reports: PyTorch's allocator peak plus what the StableBuffers (the
    native engine's KV cache and weights) hold now, which that allocator does not see."""
    return torch.cuda.max_memory_allocated() + mapped_bytes()


class StableBuffer:
    """`nbytes` (rounded up to the driver's granularity) at fixed device addresses, mapped on construction."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device = device
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.empty(0, device=device)  # the device's primary context, current on this thread
        self._prop = _Prop(type=_PINNED, location=_Location(_ON_DEVICE, index))
        grain = ctypes.c_size_t()
        _check(_driver().cuMemGetAllocationGranularity(ctypes.byref(grain), ctypes.byref(self._prop), 0),
               "cuMemGetAllocationGranularity")
        self.nbytes = -(-max(nbytes, 1) // grain.value) * grain.value
        ptr = ctypes.c_uint64()
        _check(_driver().cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(self.nbytes), ctypes.c_size_t(0),
                                             ctypes.c_uint64(0), ctypes.c_uint64(0)), "cuMemAddressReserve")
        self._range = _Range(ptr.value, self.nbytes)
        self.restore()
        self._bytes = torch.as_tensor(self._range, device=device)  # uint8 [nbytes]

    @property
    def mapped(self) -> bool:
        return self._range.handle is not None

    def view(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
        """A tensor of `shape` and `dtype` at byte `offset`: the same address for the buffer's life."""
        n = torch.Size(shape).numel() * dtype.itemsize
        assert offset % dtype.itemsize == 0 and offset + n <= self.nbytes, (offset, n, self.nbytes)
        return self._bytes[offset:offset + n].view(dtype).view(shape)

    def restore(self) -> None:
        """Map new physical memory at the buffer's addresses (no-op while mapped)."""
        if self.mapped:
            return
        if torch.cuda.mem_get_info(self.device)[0] < self.nbytes:
            torch.cuda.empty_cache()  # PyTorch's cached blocks are memory the driver cannot give us
        self._range.map(self._prop)

    def release(self) -> None:
        """Give the physical memory back to the driver once queued work on it is done (no-op if released)."""
        if not self.mapped:
            return
        torch.cuda.synchronize(self.device)  # kernels still queued may read or write it
        self._range.unmap()
