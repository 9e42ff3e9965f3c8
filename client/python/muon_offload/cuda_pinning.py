"""Host memory registered with CUDA (cudaHostRegister) in whole pages, for apply mode's
shared-memory buffers (apply_mode.ParameterOffload).

CUDA pins whole pages and refuses a registration that touches a page of an earlier one
(cudaErrorHostMemoryAlreadyRegistered). A session's buffers are only 64-byte aligned and sit back
to back in one mapping, so neighbouring buffers share a page: PinnedHostRanges rounds every range
out to whole pages and registers only the pages no earlier registration covers, and remembers
exactly what CUDA accepted, so that release() unregisters that and nothing else.

A failed cudaHostRegister leaves its error pending in the CUDA runtime, where the next kernel
launch (torch checks cudaGetLastError after each) would report it as its own; the failure is
cleared at once, warned about once, and its pages are left unregistered (copies to and from them
are synchronous, with the same results) and never retried.

HostRegistrar is the interface to the runtime (register, unregister, clear the pending error);
CudaRuntimeRegistrar is CUDA's, and a test swaps in a fake that behaves like it.

Thread-safety: none; one thread at a time (CUDA's pending error is per thread, and is cleared on
the thread whose registration failed, within the same call).
"""
import ctypes
import glob
import mmap
import os
import warnings

import torch

# cudaHostRegisterReadOnly: the device only reads the memory (needed for a read-only mapping).
CUDA_HOST_REGISTER_READ_ONLY = 8
CUDA_SUCCESS = 0


class HostRegistrar:
    """The CUDA runtime's host registration, as PinnedHostRanges uses it. Every call returns a
    cudaError_t code (0: success); a failed call leaves that code pending until clear_error()."""

    def register(self, ptr, size, flags):
        """cudaHostRegister(ptr, size, flags): pins the pages of [ptr, ptr + size)."""
        raise NotImplementedError

    def unregister(self, ptr):
        """cudaHostUnregister(ptr): REQUIRES ptr is the start of a registration."""
        raise NotImplementedError

    def clear_error(self):
        """cudaGetLastError(): returns the pending error (0: none) and clears it; None when the
        runtime cannot be asked (the error, if any, stays pending)."""
        raise NotImplementedError

    def describe(self, code):
        """The runtime's name of error `code`, for messages."""
        return f"cudaError {code}"


class CudaRuntimeRegistrar(HostRegistrar):
    """The libcudart that torch uses: cudaHostRegister/Unregister through torch.cuda.cudart(),
    cudaGetLastError through ctypes (torch 1.13 binds no cudaGetLastError). The pending error
    lives in one runtime instance, so clear_error() calls the libcudart already loaded in this
    process, then one in torch's lib directory; a runtime linked statically into torch has no
    such library, and there the error stays pending (clear_error() returns None)."""

    def __init__(self):
        self._cudart = None
        self._get_last_error = None  # the ctypes function; False: no libcudart found

    def _runtime(self):
        if self._cudart is None:
            self._cudart = torch.cuda.cudart()
        return self._cudart

    def register(self, ptr, size, flags):
        return int(self._runtime().cudaHostRegister(ptr, size, flags))

    def unregister(self, ptr):
        return int(self._runtime().cudaHostUnregister(ptr))

    def clear_error(self):
        if self._get_last_error is None:
            self._get_last_error = _load_get_last_error() or False
        return int(self._get_last_error()) if self._get_last_error else None

    def describe(self, code):
        try:
            cudart = self._runtime()
            return f"{cudart.cudaGetErrorString(cudart.cudaError(code))} (cudaError {code})"
        except Exception:  # a name only for the message: the code says what failed
            return super().describe(code)


def _load_get_last_error():
    """cudaGetLastError of the libcudart this process loaded (torch's), or None."""
    candidates = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split(None, 5)[-1].strip()
                if os.path.basename(path).startswith("libcudart") and path not in candidates:
                    candidates.append(path)
    except OSError:
        pass
    candidates += sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib",
                                                "libcudart*.so*")))
    for path in candidates:
        try:
            fn = ctypes.CDLL(path).cudaGetLastError
        except (OSError, AttributeError):
            continue
        fn.restype, fn.argtypes = ctypes.c_int, []
        return fn
    return None


class PinnedHostRanges:
    """The page ranges this object registered through `registrar`, disjoint and page aligned.

    pin() registers what a range needs; release() unregisters everything it registered. A page
    is registered read-only (CUDA_HOST_REGISTER_READ_ONLY) only while every range pinned over it
    was read-only: a writable range that touches a read-only registration unregisters it and
    registers it again writable. REQUIRES: no copy to or from that registration is in flight
    then (ParameterOffload waits for its copies before the next step's buffers are pinned). The
    writable and read-only buffers of a session are separate mappings, which share no page, so
    with them this never happens.
    """

    def __init__(self, registrar, page_size=mmap.PAGESIZE):
        self._registrar = registrar
        self._page = page_size
        self._ranges = {}  # start -> (end, flags): what the registrar accepted
        self._refused = []  # (start, end): what it refused; never retried, never unregistered
        self._warned = False

    def ranges(self):
        """[(start, size, flags)] registered now, by address."""
        return [(s, e - s, f) for s, (e, f) in sorted(self._ranges.items())]

    def pin(self, ptr, size, read_only=False):
        """Registers the pages of [ptr, ptr + size) that no registration of this object covers
        yet. Returns whether every one of them is registered now (True for size 0); False when
        CUDA refused some (warned once; those pages stay unregistered, and copies using them
        are synchronous)."""
        if size <= 0:
            return True
        lo, hi = self._pages(ptr, size)
        flags = CUDA_HOST_REGISTER_READ_ONLY if read_only else 0
        ok = True
        if not read_only:
            for start, (end, f) in self._overlapping(lo, hi):
                if f & CUDA_HOST_REGISTER_READ_ONLY:
                    if self._unregister(start):
                        lo, hi = min(lo, start), max(hi, end)  # all of it again, writable
                    else:
                        ok = False
        for start, end in self._uncovered(lo, hi):
            if not self._register(start, end, flags):
                ok = False
        return ok and self.registered(ptr, size)

    def registered(self, ptr, size):
        """Whether every page of [ptr, ptr + size) lies in a registration of this object."""
        if size <= 0:
            return True
        lo, hi = self._pages(ptr, size)
        return not self._uncovered(lo, hi, include_refused=False)

    def release(self):
        """Unregisters everything this object registered (before the memory is unmapped); a
        failure is cleared and warned about. Afterwards the object holds nothing."""
        for start in sorted(self._ranges):
            self._unregister(start)
        self._ranges.clear()
        self._refused.clear()

    # ----- bookkeeping -----

    def _pages(self, ptr, size):
        return ptr // self._page * self._page, -(-(ptr + size) // self._page) * self._page

    def _overlapping(self, lo, hi):
        return [(s, v) for s, v in sorted(self._ranges.items()) if s < hi and v[0] > lo]

    def _uncovered(self, lo, hi, include_refused=True):
        """The runs of [lo, hi) in no registration (nor refused range), in address order."""
        taken = [(s, e) for s, (e, _) in self._ranges.items()]
        if include_refused:
            taken += self._refused
        runs, at = [], lo
        for s, e in sorted(taken):
            if e <= at or s >= hi:
                continue
            if s > at:
                runs.append((at, s))
            at = max(at, e)
        if at < hi:
            runs.append((at, hi))
        return runs

    def _register(self, start, end, flags):
        code = self._registrar.register(start, end - start, flags)
        if code == CUDA_SUCCESS:
            self._ranges[start] = (end, flags)
            return True
        self._failed(code, f"cudaHostRegister of {end - start} bytes at {start:#x} (flags "
                           f"{flags})", "device copies to and from those pages are synchronous")
        self._refused.append((start, end))
        return False

    def _unregister(self, start):
        """cudaHostUnregister of the registration at `start`; it is forgotten unless the call
        failed with it still registered (kept, so that release() tries again)."""
        code = self._registrar.unregister(start)
        if code == CUDA_SUCCESS:
            del self._ranges[start]
            return True
        self._failed(code, f"cudaHostUnregister at {start:#x}", "the pages stay registered")
        return False

    def _failed(self, code, what, consequence):
        pending = self._registrar.clear_error()
        if self._warned:
            return
        self._warned = True
        left = "" if pending is not None else \
            "; the CUDA runtime could not be asked to clear the error, which stays pending"
        warnings.warn(f"muon_offload: {what} failed: {self._registrar.describe(code)}; "
                      f"{consequence}{left} (further failures are not reported)",
                      RuntimeWarning, stacklevel=4)
