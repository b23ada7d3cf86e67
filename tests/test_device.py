"""The device layer: the deferring CPU fake (a missing wait reads stale bytes), its fence trace, pinned memory
at exact size under one budget, and the CUDA implementation where a GPU exists."""

import logging

import pytest
import torch

from device.pinned import PinError, PinnedMemory
from device.streams import CudaDevice, FakeDevice, make_device


# --- the fake defers side-stream copies until something orders them -------------------------------------


def test_fake_device_catches_a_missing_wait():
    dev = FakeDevice()
    side = dev.new_stream("side")
    dst = dev.empty(4, torch.float32)
    with dev.use_stream(side):
        dev.copy_(dst, torch.ones(4))
    assert torch.isnan(dst).all()  # the copy has not "landed": reading now is the bug
    ev = dev.new_event()
    with pytest.raises(RuntimeError, match="never recorded"):
        dev.current_stream().wait_event(ev)
    ev.record(side)
    dev.current_stream().wait_event(ev)
    assert torch.equal(dst, torch.ones(4))


def test_a_copy_read_before_its_wait_yields_the_stale_bytes():
    # A host page that already holds an older plan: reading it before the D2H's event is waited on gives the
    # old bytes, exactly what a GPU may give; after the wait it holds the new ones.
    dev = FakeDevice()
    side = dev.new_stream("host")
    page = torch.full((4,), 7.0)
    with dev.use_stream(side):
        dev.copy_(page, torch.arange(4.0))
        copied = side.record_event()
    assert torch.equal(page, torch.full((4,), 7.0))
    dev.current_stream().wait_event(copied)
    assert torch.equal(page, torch.arange(4.0))


def test_an_event_orders_only_the_copies_queued_before_it():
    dev = FakeDevice()
    side = dev.new_stream("side")
    a, b = torch.zeros(2), torch.zeros(2)
    with dev.use_stream(side):
        dev.copy_(a, torch.ones(2))
        first = side.record_event()
        dev.copy_(b, torch.ones(2))
    first.synchronize()
    assert torch.equal(a, torch.ones(2)) and torch.equal(b, torch.zeros(2))  # b was queued after the event
    side.synchronize()
    assert torch.equal(b, torch.ones(2))


@pytest.mark.parametrize("order", ["wait_stream", "device_synchronize"])
def test_waiting_on_a_stream_or_the_device_runs_its_queued_copies(order):
    dev = FakeDevice()
    side = dev.new_stream("side")
    dst = torch.zeros(3)
    with dev.use_stream(side):
        dev.copy_(dst, torch.ones(3))
    if order == "wait_stream":
        dev.current_stream().wait_stream(side)
    else:
        dev.synchronize()
    assert torch.equal(dst, torch.ones(3))


def test_compute_stream_copies_run_at_once():
    dev = FakeDevice()
    dst = torch.zeros(2)
    dev.copy_(dst, torch.ones(2))
    assert torch.equal(dst, torch.ones(2)) and dev.num_copies == 1


def test_the_fake_traces_every_fence():
    log: list[str] = []
    dev = FakeDevice(log=log)
    compute, side = dev.current_stream(), dev.new_stream("host")
    side.wait_stream(compute)
    with dev.use_stream(side):
        dev.copy_(torch.zeros(1), torch.ones(1))  # copies are not fences: not traced
        done = side.record_event()
    compute.wait_event(done)
    done.synchronize()
    side.synchronize()
    assert log == ["host.wait_stream(compute)", "host.record(e1)", "compute.wait_event(e1)", "host.wait(e1)",
                   "host.synchronize()"]
    assert dev.num_waits == 1


def test_fake_device_tensors_are_garbage_until_written():
    dev = FakeDevice()
    assert torch.isnan(dev.empty(3, torch.bfloat16)).all()
    assert (dev.empty(3, torch.int32) == -1).all()
    assert dev.placeholder(torch.float16).numel() == 0


def test_make_device():
    fake = FakeDevice()
    assert make_device(fake) is fake
    assert isinstance(make_device("cpu"), FakeDevice)
    with pytest.raises(ValueError, match="unsupported device meta"):
        make_device("meta")


# --- pinned memory ---------------------------------------------------------------------------------------


def test_pinned_memory_locks_exactly_the_bytes_asked():
    dev = FakeDevice()
    memory = PinnedMemory(dev)
    t = memory.pinned((3, 1000), torch.bfloat16)
    assert t.shape == (3, 1000) and memory.pinned_bytes == dev.locked_bytes == 6000  # not rounded to 8192
    memory.free(t)
    assert memory.pinned_bytes == dev.locked_bytes == 0


def test_pinned_budget_falls_back_to_pageable_with_one_warning(caplog):
    memory = PinnedMemory(FakeDevice(), budget_bytes=1000, owner="test buffers")
    with caplog.at_level(logging.WARNING, logger="device.pinned"):
        results = [memory.allocate((400,), torch.uint8)[1] for _ in range(4)]
        small, pinned = memory.allocate((200,), torch.uint8)  # still fits the budget: pinned again
    assert results == [True, True, False, False] and pinned
    assert memory.pinned_bytes == 1000 and memory.pageable_bytes == 800
    assert len(caplog.records) == 1 and "test buffers: pinned budget of 1000 bytes" in caplog.messages[0]
    with pytest.raises(PinError, match="pinned budget"):
        memory.pinned((1,), torch.uint8)


def test_refused_registration_is_a_pin_error_or_pageable():
    dev = FakeDevice(lockable_bytes=100)
    memory = PinnedMemory(dev)
    with pytest.raises(PinError, match="locked memory limit"):
        memory.pinned((101,), torch.uint8)
    t, pinned = memory.allocate((101,), torch.uint8)
    assert not pinned and t.numel() == 101 and dev.locked_bytes == 0
    assert memory.allocate((100,), torch.uint8)[1]


def test_pinning_off_allocates_pageable_without_asking_the_device():
    dev = FakeDevice(lockable_bytes=0)
    memory = PinnedMemory(dev, pin=False)
    t, pinned = memory.allocate((8,), torch.float32)
    assert not pinned and memory.pageable_bytes == 32
    with pytest.raises(PinError, match="off"):
        memory.lock(t)


def test_lock_and_unlock_memory_allocated_elsewhere():
    dev = FakeDevice()
    memory = PinnedMemory(dev)
    t = torch.zeros(16)
    memory.lock(t)
    assert dev.locked_bytes == memory.pinned_bytes == 64
    memory.unlock(t)
    memory.unlock(t)  # idempotent
    assert dev.locked_bytes == memory.pinned_bytes == 0


def test_registrations_end_with_their_owner():
    dev = FakeDevice()
    memory = PinnedMemory(dev)
    memory.pinned((10,), torch.float32)
    memory.pinned((5,), torch.float32)
    assert dev.locked_bytes == 60
    del memory  # the last reference: the finalizer unlocks what is still registered
    assert dev.locked_bytes == 0


# --- CUDA ------------------------------------------------------------------------------------------------


def test_cuda_copy_waits_and_pinned_pages_round_trip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = CudaDevice("cuda")
    memory = PinnedMemory(dev)
    host = memory.pinned((1 << 20,), torch.float32)
    host.copy_(torch.arange(1 << 20, dtype=torch.float32))
    assert host.is_pinned()
    side = dev.new_stream("copy")
    dst = dev.empty(1 << 20, torch.float32)
    side.wait_stream(dev.current_stream())
    with dev.use_stream(side):
        dev.copy_(dst, host)
        done = side.record_event()
    dev.current_stream().wait_event(done)
    assert torch.equal(dst.cpu(), host)
    memory.free(host)
    assert memory.pinned_bytes == 0
