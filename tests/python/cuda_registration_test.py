#!/usr/bin/python3
"""The CUDA registration of apply mode's shared-memory buffers (muon_offload.cuda_pinning, and
ParameterOffload._pinned/close) against FakeCudaRuntime, a registrar that behaves like the CUDA
runtime, on host memory from torch.empty: no GPU and no daemon.

Usage: cuda_registration_test.py [unittest names...]
  - PinnedHostRangesTest: two buffers back to back with the boundary inside a page, a refused
    registration, a view pinned twice, read-only buffers next to writable ones, empty views.
  - ParameterOffloadPinningTest: a session's four buffers through _pinned and close(); on the
    CPU nothing is registered.
"""
import mmap
import os
import sys
import unittest
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client",
                                "python"))

import torch  # noqa: E402

from muon_offload.apply_mode import ParameterOffload  # noqa: E402
from muon_offload.zero import Partition  # noqa: E402
from muon_offload.cuda_pinning import (CUDA_HOST_REGISTER_READ_ONLY,  # noqa: E402
                                       HostRegistrar, PinnedHostRanges)

PAGE = mmap.PAGESIZE
# cudaError_t codes the fake returns.
INVALID_VALUE = 1
MEMORY_ALLOCATION = 2  # what a registration over RLIMIT_MEMLOCK or out of memory reports
ALREADY_REGISTERED = 712
NOT_REGISTERED = 713


class FakeCudaRuntime(HostRegistrar):
    """cudaHostRegister/Unregister/GetLastError as CUDA behaves: registrations pin whole pages, one
    that touches a page of another is refused with 712 (cudaErrorHostMemoryAlreadyRegistered),
    unregistering a pointer that starts no registration with 713; every failure stays pending
    until clear_error(). refuse(ptr, size, flags) -> a code injects failures (0: none)."""

    def __init__(self):
        self.registrations = {}  # ptr -> (size, flags)
        self.calls = []  # ("register", ptr, size, flags, code) / ("unregister", ptr, code)
        self.pending = 0
        self.refuse = lambda ptr, size, flags: 0

    @staticmethod
    def pages(ptr, size):
        return ptr // PAGE, (ptr + size - 1) // PAGE

    def register(self, ptr, size, flags):
        first, last = self.pages(ptr, size)
        if size == 0:
            code = INVALID_VALUE
        elif any(first <= b and a <= last for a, b in
                 (self.pages(p, s) for p, (s, _) in self.registrations.items())):
            code = ALREADY_REGISTERED
        else:
            code = self.refuse(ptr, size, flags)
        if code == 0:
            self.registrations[ptr] = (size, flags)
        else:
            self.pending = code
        self.calls.append(("register", ptr, size, flags, code))
        return code

    def unregister(self, ptr):
        code = 0 if self.registrations.pop(ptr, None) is not None else NOT_REGISTERED
        if code:
            self.pending = code
        self.calls.append(("unregister", ptr, code))
        return code

    def clear_error(self):
        code, self.pending = self.pending, 0
        return code

    def registered_calls(self):
        """(ptr, size, flags) of every registration CUDA accepted, in call order."""
        return [c[1:4] for c in self.calls if c[0] == "register" and c[4] == 0]

    def failed_calls(self):
        return [c for c in self.calls if c[-1] != 0]

    def unregistered(self):
        return [c[1] for c in self.calls if c[0] == "unregister"]


def page_aligned_memory(pages):
    """(tensor, address): `pages` pages of host memory starting on a page boundary, as a mapping
    does (the tensor keeps them alive)."""
    raw = torch.empty((pages + 1) * PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE
    return raw, raw.data_ptr() + skip


# Bytes of one buffer: 64-byte aligned, so the second of two back to back starts inside a page.
BUFFER = PAGE + 192


class PinnedHostRangesTest(unittest.TestCase):

    def setUp(self):
        self.cuda = FakeCudaRuntime()
        self.pins = PinnedHostRanges(self.cuda, page_size=PAGE)
        self.memory, self.base = page_aligned_memory(8)

    def assertReleasesExactlyWhatItRegistered(self):
        accepted = [ptr for ptr, _, _ in self.cuda.registered_calls()]
        before = len(self.cuda.calls)
        self.pins.release()
        self.assertEqual(sorted(self.cuda.unregistered()), sorted(accepted))
        self.assertEqual([c for c in self.cuda.calls[before:] if c[-1] != 0], [])
        self.assertEqual(self.cuda.registrations, {})
        self.assertEqual(self.pins.ranges(), [])
        self.assertEqual(self.cuda.pending, 0)

    def assertPageAlignedAndDisjoint(self):
        ranges = self.pins.ranges()
        self.assertEqual(ranges, sorted((p, s, f) for p, (s, f) in
                                        self.cuda.registrations.items()))
        for (ptr, size, _), nxt in zip(ranges, ranges[1:] + [None]):
            self.assertEqual(ptr % PAGE, 0)
            self.assertEqual(size % PAGE, 0)
            if nxt is not None:
                self.assertLessEqual(ptr + size, nxt[0])

    def test_back_to_back_buffers_with_the_boundary_inside_a_page(self):
        first, second = self.base, self.base + BUFFER
        self.assertNotEqual(second % PAGE, 0)
        self.assertTrue(self.pins.pin(first, BUFFER))
        self.assertTrue(self.pins.pin(second, BUFFER))
        self.assertEqual(self.cuda.failed_calls(), [])
        self.assertEqual(self.cuda.pending, 0)
        self.assertTrue(self.pins.registered(first, BUFFER))
        self.assertTrue(self.pins.registered(second, BUFFER))
        self.assertPageAlignedAndDisjoint()
        # Pages 0-1 for the first buffer, page 2 (the rest of the second) after it.
        self.assertEqual(self.pins.ranges(), [(self.base, 2 * PAGE, 0), (self.base + 2 * PAGE,
                                                                          PAGE, 0)])
        self.assertReleasesExactlyWhatItRegistered()
        self.assertEqual(len(self.cuda.unregistered()), 2)

    def test_refused_registration_is_cleared_warned_once_and_not_recorded(self):
        self.cuda.refuse = lambda ptr, size, flags: MEMORY_ALLOCATION
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertFalse(self.pins.pin(self.base, BUFFER))
            self.assertFalse(self.pins.pin(self.base, BUFFER))  # not retried
            self.assertFalse(self.pins.pin(self.base + 4 * PAGE, BUFFER))  # refused too
        self.assertEqual(self.cuda.pending, 0, "the failure was left pending")
        self.assertEqual(len(caught), 1, [str(w.message) for w in caught])
        self.assertIn("cudaHostRegister", str(caught[0].message))
        self.assertIn(f"cudaError {MEMORY_ALLOCATION}", str(caught[0].message))
        self.assertEqual(len([c for c in self.cuda.calls if c[0] == "register"]), 2)
        self.assertEqual(self.pins.ranges(), [])
        self.assertFalse(self.pins.registered(self.base, BUFFER))
        self.pins.release()
        self.assertEqual(self.cuda.unregistered(), [])
        self.assertEqual(self.cuda.pending, 0)

    def test_refusal_of_one_buffer_leaves_the_other_registered(self):
        refused = self.base + 4 * PAGE
        self.cuda.refuse = lambda ptr, size, flags: MEMORY_ALLOCATION if ptr == refused else 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertTrue(self.pins.pin(self.base, BUFFER))
            self.assertFalse(self.pins.pin(refused, BUFFER))
        self.assertEqual(len(caught), 1)
        self.assertEqual(self.cuda.pending, 0)
        self.assertEqual(self.pins.ranges(), [(self.base, 2 * PAGE, 0)])
        self.assertReleasesExactlyWhatItRegistered()
        self.assertEqual(self.cuda.unregistered(), [self.base])

    def test_a_view_pinned_twice_and_a_view_inside_it_register_once(self):
        for ptr, size in ((self.base + 64, BUFFER), (self.base + 64, BUFFER),
                          (self.base + 64 + 256, 1024), (self.base + 64, BUFFER // 2)):
            self.assertTrue(self.pins.pin(ptr, size))
        self.assertEqual(self.cuda.registered_calls(), [(self.base, 2 * PAGE, 0)])
        self.assertEqual(self.cuda.failed_calls(), [])
        self.assertReleasesExactlyWhatItRegistered()
        self.assertEqual(self.cuda.unregistered(), [self.base])

    def test_read_only_buffer_after_a_writable_one_sharing_a_page(self):
        writable, read_only = self.base, self.base + BUFFER
        self.assertTrue(self.pins.pin(writable, BUFFER))
        self.assertTrue(self.pins.pin(read_only, BUFFER, read_only=True))
        self.assertEqual(self.cuda.failed_calls(), [])
        # The shared page stays writable; the read-only buffer's own page is read-only.
        self.assertEqual(self.pins.ranges(), [(self.base, 2 * PAGE, 0),
                                              (self.base + 2 * PAGE, PAGE,
                                               CUDA_HOST_REGISTER_READ_ONLY)])
        self.assertPageAlignedAndDisjoint()
        self.assertReleasesExactlyWhatItRegistered()

    def test_writable_buffer_after_a_read_only_one_sharing_a_page(self):
        read_only, writable = self.base, self.base + BUFFER
        self.assertTrue(self.pins.pin(read_only, BUFFER, read_only=True))
        self.assertEqual(self.pins.ranges(), [(self.base, 2 * PAGE, CUDA_HOST_REGISTER_READ_ONLY)])
        self.assertTrue(self.pins.pin(writable, BUFFER))
        self.assertEqual(self.cuda.failed_calls(), [])
        # The read-only registration gives way to one writable registration of its pages and
        # the writable buffer's.
        self.assertEqual(self.cuda.unregistered(), [self.base])
        self.assertEqual(self.pins.ranges(), [(self.base, 3 * PAGE, 0)])
        self.assertTrue(self.pins.registered(read_only, BUFFER))
        self.assertTrue(self.pins.registered(writable, BUFFER))
        self.assertPageAlignedAndDisjoint()
        self.assertReleasesExactlyWhatItRegistered()

    def test_read_only_buffers_on_pages_of_their_own_stay_read_only(self):
        # A session's update buffers are a mapping of their own, as here pages 4-7.
        read_only = self.base + 4 * PAGE
        self.assertTrue(self.pins.pin(self.base, BUFFER))
        self.assertTrue(self.pins.pin(read_only, 2 * BUFFER, read_only=True))
        self.assertTrue(self.pins.pin(read_only + BUFFER, BUFFER, read_only=True))
        self.assertEqual(self.pins.ranges(), [(self.base, 2 * PAGE, 0),
                                              (read_only, 3 * PAGE, CUDA_HOST_REGISTER_READ_ONLY)])
        self.assertEqual(self.cuda.failed_calls(), [])
        self.assertReleasesExactlyWhatItRegistered()

    def test_empty_views_register_nothing(self):
        empty = torch.empty(0, dtype=torch.float32)
        for ptr in (empty.data_ptr(), self.base, self.base + BUFFER):
            self.assertTrue(self.pins.pin(ptr, 0))
            self.assertTrue(self.pins.pin(ptr, 0, read_only=True))
            self.assertTrue(self.pins.registered(ptr, 0))
        self.assertEqual(self.cuda.calls, [])
        # An empty view at the start of a buffer does not count as that buffer registered.
        self.assertFalse(self.pins.registered(self.base, BUFFER))
        self.assertTrue(self.pins.pin(self.base, BUFFER))
        self.assertEqual(self.cuda.registered_calls(), [(self.base, 2 * PAGE, 0)])
        self.assertReleasesExactlyWhatItRegistered()


class FakeSession:
    """What ParameterOffload needs of a session, with a gradient and an update "mapping" of two
    back-to-back buffers each (update views read-only in a real session), on the gRPC side of the
    constructor (host flat buffers, no layout check)."""
    is_shm = False
    job_id = "pinning"

    def __init__(self, elements):
        self.bytes = elements * 4
        self.spans = [(0, 0, elements, 0)]
        pages = 2 * (-(-2 * self.bytes // PAGE)) + 1
        self.memory, base = page_aligned_memory(pages)
        update = base + (pages // 2) * PAGE
        self.regions = {"gradient": base, "update": update}

    def raw_view(self, kind, step):
        at = self.regions[kind] - self.memory.data_ptr() + (step % 2) * self.bytes
        return self.memory[at:at + self.bytes]

    def view(self, kind, step, dtype=torch.float32):
        return self.raw_view(kind, step).view(dtype)


class ParameterOffloadPinningTest(unittest.TestCase):
    ELEMENTS = (PAGE + 192) // 4  # a buffer_bytes with the buffers' boundary inside a page

    def offload(self, session):
        param = torch.zeros(self.ELEMENTS)
        return ParameterOffload(session, [Partition(0, session.spans, self.ELEMENTS)], 0, [param])

    def test_session_buffers_are_registered_as_two_ranges_and_released(self):
        session = FakeSession(self.ELEMENTS)
        offload = self.offload(session)
        cuda = FakeCudaRuntime()
        offload._cuda = True  # the registration of a CUDA trainer, on a fake runtime
        offload._pins = PinnedHostRanges(cuda, page_size=PAGE)
        for step in (0, 1, 2):
            grads = session.view("gradient", step)
            self.assertIs(offload._pinned(grads), grads)
            offload._pinned(session.raw_view("gradient", 0))  # the init view: buffer 0
            updates = session.view("update", step)
            self.assertIs(offload._pinned(updates, read_only=True), updates)
        self.assertEqual(cuda.failed_calls(), [])
        pair = -(-2 * session.bytes // PAGE) * PAGE
        self.assertEqual(cuda.registered_calls(), [
            (session.regions["gradient"], pair, 0),
            (session.regions["update"], pair, CUDA_HOST_REGISTER_READ_ONLY)])
        offload.close()
        self.assertEqual(cuda.unregistered(), [session.regions["gradient"],
                                               session.regions["update"]])
        self.assertEqual(cuda.registrations, {})
        self.assertEqual(cuda.failed_calls(), [])
        self.assertEqual(cuda.pending, 0)
        offload.close()  # twice: nothing more
        self.assertEqual(len(cuda.calls), 4)

    def test_cpu_parameters_register_nothing(self):
        session = FakeSession(self.ELEMENTS)
        offload = self.offload(session)
        grads, updates = session.view("gradient", 0), session.view("update", 0)
        self.assertIs(offload._pinned(grads), grads)
        self.assertIs(offload._pinned(updates, read_only=True), updates)
        self.assertIsNone(offload._pins)
        offload.close()
        self.assertIsNone(offload._pins)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v", *sys.argv[1:]])
