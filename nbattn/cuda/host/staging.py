"""Pinned staging for host-to-device copies: the host half of the launch layer.

    HostToDevice   asynchronous copies out of one pinned int32 array, with an event
                   that says when the array may be written again
    Span           words of a staged device array, as a bound launch's argument
    Staged         one slot: a pinned array, the device array it is copied into,
                   and the event after the last kernel that reads it
    StagingRing    slots for calls that upload and launch at once, so a loop of
                   calls never waits for the call before it

The copies and events go through the driver library the launches use
(:func:`nbattn.cuda.host.driver.libcuda`).  In the simulator the staging array is
plain memory and a copy is synchronous.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np
from numba import cuda

from ..blocks.primitives import SIMULATOR
from .driver import data_ptr, libcuda

__all__ = ["HostToDevice", "Span", "Staged", "StagingRing"]


class HostToDevice:
    """Asynchronous copies out of one pinned staging array (``self.host``, int32),
    ordered on the caller's stream; the next :meth:`begin` waits until the last
    copies have read the staging array, so it can be rewritten.  In the simulator
    the staging array is plain memory and a copy is synchronous."""

    def __init__(self, n_words: int):
        if SIMULATOR:
            self.host = np.zeros(n_words, np.int32)
            return
        self.host = cuda.pinned_array(n_words, np.int32)
        self._base = self.host.ctypes.data
        self._lib = libcuda()
        self._event = ctypes.c_void_p()
        self._pending = False
        err = self._lib.event_create(ctypes.byref(self._event), 2)     # CU_EVENT_DISABLE_TIMING
        if err:
            raise RuntimeError(f"nbattn: cuEventCreate failed with CUDA error {err}")

    def begin(self) -> None:
        """Wait (rarely: only if still in flight) for the previous copies to read the staging array."""
        if not SIMULATOR and self._pending:
            self._lib.event_sync(self._event)
            self._pending = False

    def in_flight(self) -> bool:
        """Whether the last copies (and what the stream ran before the event) may still run."""
        if SIMULATOR or not self._pending:
            return False
        if self._lib.event_query(self._event) == 0:          # CUDA_SUCCESS: reached
            self._pending = False
        return self._pending

    def copy(self, dst, first: int, last: int, stream: int = 0, dst_ptr: int | None = None) -> None:
        """``host[first:last]`` into ``dst[first:last]`` (``dst``: an int32 device array,
        whose address ``dst_ptr`` the caller may know already)."""
        if SIMULATOR:
            dst[first:last].copy_to_device(self.host[first:last])
            return
        base = data_ptr(dst) if dst_ptr is None else dst_ptr
        err = self._lib.memcpy_htod_async(base + 4 * first, self._base + 4 * first,
                                          4 * (last - first), stream)
        if err:
            raise RuntimeError(f"nbattn: cuMemcpyHtoDAsync failed with CUDA error {err}")

    def end(self, stream: int = 0) -> None:
        if not SIMULATOR:
            self._lib.event_record(self._event, stream)
            self._pending = True


class Span:
    """Words ``[off, off + n)`` of a device int32 array ``buf`` (at address ``ptr``),
    as an argument of a :class:`~nbattn.cuda.host.driver.BoundLaunch`: on a GPU its address, in the
    simulator its view (read as ``dtype`` and ``shape`` when given)."""
    __slots__ = ("buf", "ptr", "off", "n", "dtype", "shape")

    def __init__(self, buf, ptr: int, off: int, n: int, dtype=None, shape=None):
        self.buf, self.ptr, self.off, self.n = buf, ptr, off, n
        self.dtype, self.shape = dtype, shape

    def data_ptr(self) -> int:
        return self.ptr + 4 * self.off

    def view(self):
        v = self.buf[self.off:self.off + max(self.n, 1)]
        if self.dtype is not None and np.dtype(self.dtype) != np.int32:
            v = v.view(self.dtype)
        return v if self.shape is None else v.reshape(self.shape)


class Staged:
    """One slot of a :class:`StagingRing`: a pinned host int32 array ``host``, the
    device int32 array ``dev`` it is copied into (at address ``dev_ptr``) and an
    event recorded after the last kernel that reads ``dev``."""

    def __init__(self, n_words: int):
        self.host = HostToDevice(n_words)
        self.dev = cuda.device_array(n_words, np.int32)
        self.dev_ptr = 0 if SIMULATOR else data_ptr(self.dev)

    def busy(self) -> bool:
        """Whether a kernel that reads ``dev`` may still be running."""
        return self.host.in_flight()

    def send(self, n_words: int, stream: int) -> None:
        """``host[:n_words]`` into ``dev[:n_words]``, ordered on ``stream``."""
        self.host.copy(self.dev, 0, n_words, stream, self.dev_ptr)

    def done(self, stream: int) -> None:
        """Mark the slot in use until ``stream`` reaches this point (call after the
        launches that read ``dev``)."""
        self.host.end(stream)


class StagingRing:
    """Staging for calls that upload their metadata and launch at once.

    :meth:`take` returns a slot whose device array no queued kernel still reads:
    the first idle one, else a new one (up to ``most``), else, when all are in
    flight, the next in turn once its kernels are done.  So a loop of calls runs
    ahead of the GPU the way torch's own asynchronous copies do, instead of each
    call waiting for the kernels of the call before it (one staging array would
    make it wait).  Slots live on the device that was current when they were
    made: one GPU per process, as :func:`sm_count` assumes."""

    def __init__(self, most: int = 32):
        self.most = most
        self._slots: list[Staged] = []
        self._last = -1                 # the slot taken last
        # A call holds this from take() to done(): the slot, and the shared bound
        # launches it patches, are then its own even when threads call at once.
        self.lock = threading.Lock()

    def stage(self, arrays, stream: int) -> tuple[Staged, list[Span]]:
        """Pack ``arrays`` into one slot, each at a 16-byte aligned offset, and send
        them with one copy on ``stream``: integer arrays as int32, a float32 array
        as its bits.  Returns the slot (call :meth:`Staged.done` after the launches
        that read it) and a :class:`Span` per array (its dtype and shape kept
        where they are not 1-D int32)."""
        words = [(a.view(np.int32) if a.dtype == np.float32 else np.asarray(a, np.int32)).reshape(-1)
                 for a in arrays]
        offs = np.cumsum([0] + [max(w.size, 1) + (-max(w.size, 1)) % 4 for w in words])
        slot = self.take(int(offs[-1]))
        for w, o in zip(words, offs[:-1]):
            slot.host.host[o:o + w.size] = w
        slot.send(int(offs[-1]), stream)
        return slot, [Span(slot.dev, slot.dev_ptr, int(o), int(a.size),
                           None if a.dtype != np.float32 else a.dtype, a.shape if a.ndim != 1 else None)
                      for a, o in zip(arrays, offs[:-1])]

    def take(self, n_words: int) -> Staged:
        # Look at the slots oldest-first (from the one after the last taken): in a loop
        # of calls the oldest is the one most likely done, so one event query is the rule.
        n = len(self._slots)
        for k in range(n):
            i = (self._last + 1 + k) % n
            slot = self._slots[i]
            if slot.host.host.size >= n_words and not slot.busy():
                self._last = i
                return slot
        if n < self.most:
            size = max(n_words, 1 << 14, max((x.host.host.size for x in self._slots), default=0))
            self._slots.append(Staged(size))
            self._last = n
            return self._slots[-1]
        i = self._last = (self._last + 1) % n             # every slot in flight: wait for the oldest
        slot = self._slots[i]
        slot.host.begin()
        if slot.host.host.size < n_words:
            slot = self._slots[i] = Staged(n_words)
        return slot
