"""The stage-to-stage data plane (stage_server/dataplane.py) on CPU: a tensor sent through
a shared-memory slot arrives bit-identical; one whose slot header and control message
disagree is refused naming what differs; no segment is left in /dev/shm.

End to end (stage processes) the data plane is checked in test_pipeline.py (PP 2-4 over
shm, the bytes path and its fallback, a stage killed mid-stream, /dev/shm after shutdown)
and test_stage_robustness.py (a mismatched tensor refused by a stage, nothing changed)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ppspec.proto.stubs import pb
from ppspec.stage_server import dataplane as dp


def agreed(reply: pb.AttachReply) -> tuple[str, str]:
    return reply.transport, reply.detail


def ours(link: dp.SlotLink) -> list[str]:
    """This link's segments still in /dev/shm."""
    return [n for n in os.listdir(dp.SHM_DIR) if n.startswith(f"{dp.PREFIX}{os.getpid()}-{link.sender_id}-")]


@pytest.fixture
def link_and_receiver():
    link = dp.SlotLink("shm", "t" + os.urandom(4).hex(), "cpu")
    rx = dp.Receiver("cpu")
    probe, nonce = dp.make_probe(link)
    req = pb.AttachRequest(sender_id=link.sender_id, host_id=dp.host_id(), transport="shm", probe=probe.ref,
                           nonce=nonce)
    assert agreed(rx.attach(req)) == ("shm", "")
    link.done(probe, answered=True)
    yield link, rx
    link.close()
    assert ours(link) == []


def test_tensors_arrive_bit_identical_and_slots_are_reused_or_grown(link_and_receiver):
    link, rx = link_and_receiver
    g = torch.Generator().manual_seed(0)
    for mb, (shape, dtype) in enumerate([((20, 64), torch.float32), ((3, 64), torch.bfloat16),
                                         ((700, 1024), torch.float32), ((1, 64), torch.float16)]):
        t = torch.randn(shape, generator=g).to(dtype)
        sent = link.put(t, mb, 7)
        got = rx.read(sent.ref, mb, 7)
        assert got.dtype == dtype and torch.equal(got, t)
        link.done(sent, answered=True)
    # one relay at a time: one slot, grown once for the 2.8 MB tensor (1 MiB at first)
    assert link.slots == 1 and len(link.free) == 1 and link.free[0].seg.capacity == 4 << 20
    assert ours(link) == []  # the receiver unlinked each segment as soon as it mapped it


def test_slots_in_flight_are_not_reused_and_unanswered_ones_retire(link_and_receiver):
    link, rx = link_and_receiver
    a, b = torch.full((4, 64), 1.0), torch.full((4, 64), 2.0)
    sa, sb = link.put(a, 1, 1), link.put(b, 2, 1)
    assert sa.ref.slot != sb.ref.slot
    assert torch.equal(rx.read(sa.ref, 1, 1), a) and torch.equal(rx.read(sb.ref, 2, 1), b)
    link.done(sa, answered=False)  # no answer: the receiver may still read it
    link.done(sb, answered=True)
    assert [s.index for s in link.free] == [sb.ref.slot]
    sc = link.put(a, 3, 1)
    assert sc.ref.slot == sb.ref.slot
    sd = link.put(b, 4, 1)  # the retired index, on a new segment the receiver maps in its place
    assert sd.ref.slot == sa.ref.slot and sd.ref.shm_name != sa.ref.shm_name
    assert torch.equal(rx.read(sd.ref, 4, 1), b)


def tampered(ref, **change):
    r = pb.TensorRef()
    r.CopyFrom(ref)
    for k, v in change.items():
        if k == "shape":
            del r.shape[:]
            r.shape.extend(v)
        else:
            setattr(r, k, v)
    return r


@pytest.mark.parametrize("change,mb,rnd,fragment", [
    (dict(shape=[10, 128]), 5, 9, "shape [20, 64] in the slot, [10, 128] in the step"),
    (dict(dtype="bfloat16"), 5, 9, "dtype float32 in the slot, 'bfloat16' in the step"),
    ({}, 6, 9, "micro-batch 5 round 9 in the slot, micro-batch 6 round 9 in the step"),
    ({}, 5, 8, "micro-batch 5 round 9 in the slot, micro-batch 5 round 8 in the step"),
    (dict(seq=99), 5, 9, "sequence number"),
    (dict(shm_name="../etc/passwd"), 5, 9, "not a data-plane segment"),
    (dict(shm_name=dp.PREFIX + "1-nosuch-1"), 5, 9, "cannot open slot"),
])
def test_a_tensor_that_does_not_match_its_control_message_is_refused(link_and_receiver, change, mb, rnd, fragment):
    link, rx = link_and_receiver
    t = torch.randn(20, 64)
    sent = link.put(t, 5, 9)
    with pytest.raises(dp.DataPlaneError, match="hidden_ref") as e:
        rx.read(tampered(sent.ref, **change), mb, rnd)
    assert fragment in str(e.value)
    assert torch.equal(rx.read(sent.ref, 5, 9), t)  # the slot is intact: the right step still reads it


def test_a_sender_that_never_attached_is_refused(link_and_receiver):
    link, _ = link_and_receiver
    sent = link.put(torch.zeros(2, 64), 1, 1)
    with pytest.raises(dp.NotAttachedError, match="must attach first"):
        dp.Receiver("cpu").read(sent.ref, 1, 1)


def test_attach_falls_back_to_bytes_and_says_why(link_and_receiver):
    link, rx = link_and_receiver
    probe, nonce = dp.make_probe(link)
    base = dict(sender_id="x", host_id=dp.host_id(), probe=probe.ref, nonce=nonce)
    assert agreed(rx.attach(pb.AttachRequest(**{**base, "host_id": "elsewhere/1"}, transport="shm"))) == (
        "bytes", f"the next stage is on another host ({dp.host_id()}; this stage is on elsewhere/1)")
    assert rx.attach(pb.AttachRequest(**base, transport="cuda_ipc")).detail == "the next stage runs on cpu, not on a CUDA device"
    assert rx.attach(pb.AttachRequest(**{**base, "nonce": b"wrong"}, transport="shm")).transport == "bytes"
    assert agreed(rx.attach(pb.AttachRequest(**base, transport="bytes"))) == ("bytes", "")
    assert "x" not in rx.inboxes
    # another container of this host: another hostname, the same kernel; the probe decides
    probe2, nonce2 = dp.make_probe(link)  # (the wrong nonce's attach mapped and unlinked the first)
    same_kernel = "container-b/" + dp.host_id().rsplit("/", 1)[1]
    assert agreed(rx.attach(pb.AttachRequest(sender_id="x", host_id=same_kernel, probe=probe2.ref, nonce=nonce2,
                                             transport="shm"))) == ("shm", "")
    link.done(probe, answered=True)


def test_close_unlinks_segments_never_opened_and_dead_processes_are_swept():
    link = dp.SlotLink("shm", "u" + os.urandom(4).hex(), "cpu")
    for i in range(3):
        link.put(torch.ones(8, 64), i, 0)  # three in flight, none read
    assert len(ours(link)) == 3
    link.close()
    assert ours(link) == []
    # a sender killed before its receiver mapped a segment: the next stage start removes it
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    name = f"{dp.PREFIX}{dead}-gone-1"
    open(os.path.join(dp.SHM_DIR, name), "wb").close()
    assert name in dp.sweep_dead_segments()
    assert not os.path.exists(os.path.join(dp.SHM_DIR, name))


def test_a_full_dev_shm_fails_the_put_cleanly_and_the_next_put_works(monkeypatch):
    """No room in /dev/shm for a slot: put raises OSError (the stage then sends that step
    as bytes), leaves no segment behind, and a later put gets the slot index back."""
    link = dp.SlotLink("shm", "f" + os.urandom(4).hex(), "cpu")
    real = os.posix_fallocate

    def full(fd, offset, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="No space left"):
        link.put(torch.ones(8, 64), 1, 0)
    assert ours(link) == [] and link.spare == [0]
    monkeypatch.setattr(os, "posix_fallocate", real)
    sent = link.put(torch.ones(8, 64), 2, 0)
    assert sent.ref.slot == 0 and len(ours(link)) == 1
    link.close()
    assert ours(link) == []
