"""The ``dist`` data plane (stage_server/dataplane_dist.py) on CPU: a gloo group per link
over loopback. Tensors arrive bit-identical whatever order the steps read them in; one
whose header and control message disagree is refused naming what differs and stays for
the right step; a link whose sender went away says so (the sender attaches again); the
attach turns a slot offer from another host into ``dist``.

End to end (stage processes acting as if on two hosts) in test_pipeline.py,
``test_stages_on_two_hosts_go_dist``."""
from __future__ import annotations

import pytest
import torch

from ppspec.proto.stubs import pb
from ppspec.stage_server import dataplane as dp
from ppspec.stage_server import dataplane_dist as dd
from test_dataplane import tampered


def connect(rx: dp.Receiver, sender_id: str, **req) -> dd.DistLink:
    """Attach ``sender_id`` to ``rx`` on ``dist`` and join the group the reply names."""
    reply = rx.attach(pb.AttachRequest(sender_id=sender_id, host_id="elsewhere/1", dist_backend="gloo", **req))
    assert (reply.transport, reply.detail) == ("dist", "") and reply.store_port > 0
    return dd.DistLink(sender_id, "cpu", "127.0.0.1", reply.store_port)


@pytest.fixture
def link_and_receiver():
    rx = dp.Receiver("cpu", dist_inbox=dd.DistInbox)
    link = connect(rx, "s1", transport="dist")
    yield link, rx
    link.close()


def test_tensors_arrive_bit_identical_in_any_read_order(link_and_receiver):
    link, rx = link_and_receiver
    g = torch.Generator().manual_seed(0)
    shapes = [((20, 64), torch.float32), ((3, 64), torch.bfloat16), ((700, 1024), torch.float32),
              ((1, 64), torch.float16), ((0, 64), torch.float32)]
    sent = [(mb, torch.randn(shape, generator=g).to(dtype)) for mb, (shape, dtype) in enumerate(shapes)]
    refs = [(mb, t, link.put(t, mb, 3).ref) for mb, t in sent]
    assert [r.seq for _, _, r in refs] == [1, 2, 3, 4, 5]
    for mb, t, ref in reversed(refs):  # the steps reach the receiver in another order than sent
        got = rx.read(ref, mb, 3)
        assert got.dtype == t.dtype and torch.equal(got, t)
    assert rx.inboxes["s1"].got == {}  # each read took its tensor


@pytest.mark.parametrize("change,mb,rnd,fragment", [
    (dict(shape=[10, 128]), 5, 9, "shape [20, 64] in the header, [10, 128] in the step"),
    (dict(dtype="bfloat16"), 5, 9, "dtype float32 in the header, 'bfloat16' in the step"),
    ({}, 6, 9, "micro-batch 5 round 9 in the header, micro-batch 6 round 9 in the step"),
    ({}, 5, 8, "micro-batch 5 round 9 in the header, micro-batch 5 round 8 in the step"),
])
def test_a_tensor_that_does_not_match_its_control_message_is_refused(link_and_receiver, change, mb, rnd, fragment):
    link, rx = link_and_receiver
    t = torch.randn(20, 64)
    ref = link.put(t, 5, 9).ref
    with pytest.raises(dp.DataPlaneError, match="hidden_ref: tensor 1 of the dist link is not the step's") as e:
        rx.read(tampered(ref, **change), mb, rnd)
    assert fragment in str(e.value)
    assert torch.equal(rx.read(ref, 5, 9), t)  # still there: the right step reads it


def test_a_tensor_read_twice_or_never_sent_is_refused(link_and_receiver):
    link, rx = link_and_receiver
    ref = link.put(torch.ones(2, 64), 1, 1).ref
    rx.read(ref, 1, 1)
    with pytest.raises(dp.DataPlaneError, match="tensor 1 of the dist link was read already or dropped"):
        rx.read(ref, 1, 1)
    with pytest.raises(dp.DataPlaneError, match="tensor 7 did not arrive on the dist link within 0s"):
        rx.inboxes["s1"].read(tampered(ref, seq=7), 1, 1, timeout=0.2)


def test_a_sender_that_went_away_must_attach_again_and_a_fresh_group_works():
    rx = dp.Receiver("cpu", dist_inbox=dd.DistInbox)
    link = connect(rx, "s2", transport="dist")
    ref = link.put(torch.ones(2, 64), 1, 1).ref
    old = rx.inboxes["s2"]
    link.close()  # the sending stage's process ended: its sockets close
    old.thread.join(10)
    with pytest.raises(dp.NotAttachedError, match=r"the dist link from stage instance s2 is broken .*AttachDataPlane"):
        rx.read(tampered(ref, seq=2), 1, 1)
    link = connect(rx, "s2", transport="dist")  # it attaches again: a new group, seq from 1
    assert rx.inboxes["s2"] is not old
    t = torch.randn(4, 64)
    assert torch.equal(rx.read(link.put(t, 2, 1).ref, 2, 1), t)
    link.close()


def test_attach_offers_dist_across_hosts_only_and_says_why_not():
    rx = dp.Receiver("cpu", dist_inbox=dd.DistInbox)
    # --data-plane auto from another host: the shm offer becomes dist
    link = connect(rx, "s3", transport="shm", dist_if_remote=True)
    assert rx.inboxes["s3"].transport == "dist"
    link.close()
    # another host without dist_if_remote (--data-plane shm): bytes, as before
    reply = rx.attach(pb.AttachRequest(sender_id="s4", host_id="elsewhere/1", transport="shm"))
    assert reply.transport == "bytes" and reply.detail.startswith("the next stage is on another host")
    # a CUDA sender (NCCL) to a CPU stage: bytes, and why
    reply = rx.attach(pb.AttachRequest(sender_id="s5", host_id="elsewhere/1", transport="dist", dist_backend="nccl"))
    assert (reply.transport, reply.detail) == ("bytes", "the next stage cannot host a dist link: the next stage runs "
                                                        "on cpu, which cannot take nccl")
    assert "s4" not in rx.inboxes and "s5" not in rx.inboxes
    # a receiver built without dist links (no DistInbox given): bytes, and why
    reply = dp.Receiver("cpu").attach(pb.AttachRequest(sender_id="s7", host_id="elsewhere/1", transport="dist",
                                                        dist_backend="gloo"))
    assert (reply.transport, reply.detail) == ("bytes", "the next stage hosts no dist links")


def test_a_sender_that_cannot_reach_the_store_fails_fast(monkeypatch):
    monkeypatch.setattr(dd, "CONNECT_TIMEOUT", 1.0)
    with pytest.raises(RuntimeError, match="127.0.0.1"):  # DistStoreError; the stage then falls back to bytes
        dd.DistLink("s6", "cpu", "127.0.0.1", free_port())


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_peer_host_reads_grpc_addresses_and_peers():
    assert [dd.peer_host(a) for a in ["ipv4:10.0.0.5:41000", "ipv6:%5B::1%5D:41000", "ipv6:[fd00::5]:1",
                                      "stage-1.ppspec:50051", "dns:///stage-1:50051"]] == [
        "10.0.0.5", "::1", "fd00::5", "stage-1.ppspec", "stage-1"]

