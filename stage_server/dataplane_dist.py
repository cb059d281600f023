"""``dist``: hidden states by ``torch.distributed`` point-to-point, for stages on different hosts.

A 2-rank process group per link (the sender rank 0, the receiver rank 1), built directly
from a ``TCPStore`` the receiver hosts on a port it picks and answers in the attach
(``AttachReply.store_port``; the sender dials it on the host of the next stage's gRPC address):
``ProcessGroupGloo`` between CPU stages, ``ProcessGroupNCCL`` between CUDA stages (NCCL over
TCP sockets or InfiniBand, as NCCL finds them). Not the process-global
``init_process_group``: a re-attach after a stage restart builds a fresh group and the old
one is dropped with its link.

Point-to-point messages arrive in the order they were sent, but steps can reach the
receiver's compute thread in another order (async rounds, a verify that waits for its
commit). So each tensor goes as two messages, a fixed-size header (seq, micro_batch_id,
round, dtype, shape) and then the payload, and a thread per link receives continuously
into a buffer keyed by seq. The headers always go through gloo (host memory: the receiving
thread learns each payload's size without waiting on the device); between CUDA stages the
payloads go through a second group, NCCL, device to device (as vLLM sends a tensor dict's
metadata on its CPU group and the tensors on its device group). :meth:`DistInbox.read`
(the compute thread) waits for the seq its step names and checks the header against the
step's control data, as the slot transports do (a mismatch: :class:`DataPlaneError`,
nothing changed).

A broken link (the peer gone, a transport error) makes the next read raise
:class:`NotAttachedError`: the sender then attaches again (a fresh group, or bytes).
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import urllib.parse

import torch
import torch.distributed as dist

from ppspec.proto.stubs import pb

from .dataplane import DTYPES, DataPlaneError, NotAttachedError, Sent

log = logging.getLogger("ppspec.dataplane")

CONNECT_TIMEOUT = 20.0  # seconds for the two ranks to meet (the store, the gloo mesh, NCCL's bootstrap)
SEND_TIMEOUT = 60.0  # seconds a put may wait for the receiver to take its tensor
READ_TIMEOUT = 60.0  # seconds a step waits for its tensor to arrive
IDLE = datetime.timedelta(days=365)  # a receive posted while no step comes: not a timeout
MAX_UNREAD = 64  # tensors kept for steps that have not come (a relay that failed never reads its own)
_MAGIC = 0x5050535044495354  # "PPSPDIST"
_HEADER_LEN = 10  # int64: magic, seq, micro_batch_id, round, dtype index, ndim, shape[4]


def backend_for(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def peer_host(address: str) -> str:
    """The host of a gRPC address or peer: ``ipv4:10.0.0.5:41000``, ``ipv6:[fd00::5]:41000``,
    ``stage-1.ppspec:50051``, ``dns:///stage-1:50051`` -> ``10.0.0.5``, ``fd00::5``, ``stage-1.ppspec``, ``stage-1``."""
    address = urllib.parse.unquote(address)  # gRPC writes an IPv6 peer as ipv6:%5B::1%5D:port
    for scheme in ("ipv4:", "ipv6:", "dns:///", "dns:"):
        address = address.removeprefix(scheme)
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 or address.startswith("[") else address
    return host.strip("[]")


def _local_address(peer_host: str) -> str:
    """The address of this host's interface that routes to ``peer_host`` (no packet is
    sent: a UDP socket's connect only picks the route)."""
    family = socket.AF_INET6 if ":" in peer_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((peer_host, 9))
        return s.getsockname()[0]


def _groups(store, rank: int, backend: str, device: torch.device, peer_host: str) -> tuple:
    """The link's 2-rank process groups ``(headers, payloads)``: gloo for the headers (and
    the payloads between CPU stages), NCCL for the payloads between CUDA stages. Gloo
    connects both ways here (blocks until the peer joins); NCCL's communicator comes up at
    the first send / receive."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=CONNECT_TIMEOUT)
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    opts._devices = [dist.ProcessGroupGloo.create_device(interface=iface) if iface else
                     dist.ProcessGroupGloo.create_device(hostname=_local_address(peer_host))]
    headers = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, 2, opts)
    if backend == "gloo":
        return headers, headers
    torch.cuda.set_device(device)  # the NCCL communicator's device (this thread's current one)
    nccl = dist.ProcessGroupNCCL.Options()
    nccl._timeout = IDLE  # the watchdog must not end a receive that waits for the next step
    return headers, dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, 2, nccl)


def _header(seq: int, micro_batch_id: int, round_: int, dtype: torch.dtype, shape) -> torch.Tensor:
    if len(shape) > 4:
        raise DataPlaneError(f"hidden_states of {len(shape)} dimensions cannot travel on the data plane")
    dims = list(shape) + [0] * (4 - len(shape))
    return torch.tensor([_MAGIC, seq, micro_batch_id, round_, DTYPES.index(dtype), len(shape), *dims],
                        dtype=torch.int64)


def _payload_bytes(dtype: torch.dtype, shape) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


class DistLink:
    """Sender side (rank 0) of a ``dist`` link.

    Args:
        sender_id: this stage's instance_id.
        device: where the hidden states are (``cpu``: gloo; ``cuda:N``: NCCL).
        host: the next stage's host (of its gRPC address); ``port``: its store's.
    """

    transport = "dist"

    def __init__(self, sender_id: str, device: str, host: str, port: int):
        self.sender_id, self.device = sender_id, torch.device(device)
        self.backend = backend_for(device)
        store = dist.TCPStore(host, port, 2, False, timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT))
        self.headers, self.payloads = _groups(store, 0, self.backend, self.device, host)
        self.seq = 0
        self._send(0, 0, 0, torch.zeros(1, device=self.device))  # the probe: NCCL connects here
        if self.backend == "nccl":
            torch.cuda.current_stream(self.device).synchronize()  # a communicator that cannot connect raises

    def _send(self, seq: int, micro_batch_id: int, round_: int, t: torch.Tensor) -> None:
        headers, payloads = self.headers, self.payloads  # a re-attach may close this link meanwhile
        if headers is None:
            raise RuntimeError("the link was closed (the next stage restarted)")
        wait = datetime.timedelta(seconds=SEND_TIMEOUT)
        # gloo: returns once the receiver has the bytes; NCCL: the current stream waits for the
        # send (the tensor stays alive until then), the host goes on
        head = headers.send([_header(seq, micro_batch_id, round_, t.dtype, t.shape)], 1, 0)
        body = payloads.send([t.reshape(-1).view(torch.uint8)], 1, 0) if t.numel() else None
        head.wait(wait)
        if body is not None and self.backend == "nccl":
            body.wait()  # with a timeout NCCL's wait would block the host too
        elif body is not None:
            body.wait(wait)

    def put(self, t: torch.Tensor, micro_batch_id: int, round_: int):
        """Send ``t`` to the next stage (on the compute thread, after the step that made it)."""
        t = t.detach().contiguous()
        if t.dtype not in DTYPES:
            raise DataPlaneError(f"hidden_states dtype {t.dtype} cannot travel on the data plane")
        self.seq += 1
        try:
            self._send(self.seq, micro_batch_id, round_, t)
        except RuntimeError as e:  # the peer gone, a timeout: this step goes as bytes (server._run)
            raise DataPlaneError(f"dist send to the next stage failed: {e}") from None
        return Sent(ref=pb.TensorRef(sender_id=self.sender_id, seq=self.seq, dtype=str(t.dtype).removeprefix("torch."),
                                     shape=list(t.shape)))

    def done(self, sent, answered: bool) -> None:
        pass  # the receiver has its own copy once the send completed

    def close(self) -> None:
        payloads, self.headers, self.payloads = self.payloads, None, None
        if payloads is not None and self.backend == "nccl":
            payloads.abort()  # gloo closes its sockets when dropped; the receiver's thread then ends
        del payloads


class DistInbox:
    """Receiver side (rank 1) of a ``dist`` link: hosts the store, and a thread that
    receives every tensor in send order into :attr:`got` (seq -> header, tensor, ready event).

    Args:
        sender_id: the sending stage's instance_id; ``backend``: the sender's (gloo / nccl).
        device: this stage's device; ``peer_host``: the sender's address, as the attach came.
    """

    transport = "dist"

    def __init__(self, sender_id: str, backend: str, device: str, peer_host: str):
        if backend != backend_for(device):
            raise DataPlaneError(f"the next stage runs on {device}, which cannot take {backend}")
        self.sender_id, self.backend, self.device = sender_id, backend, torch.device(device)
        self.store = dist.TCPStore("0.0.0.0", 0, 2, True, timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT),
                                   wait_for_workers=False)
        self.port = self.store.port
        self.cond = threading.Condition()
        self.got: dict[int, tuple] = {}
        self.last = 0  # the highest seq received
        self.error = ""  # why the link broke ("" while it works)
        self.headers = self.payloads = None
        self.thread = threading.Thread(target=self._receive, args=(peer_host,), daemon=True,
                                       name=f"dist-from-{sender_id}")
        self.thread.start()

    def _receive(self, peer_host: str) -> None:
        try:
            self.headers, self.payloads = _groups(self.store, 1, self.backend, self.device, peer_host)
            while True:
                head = torch.empty(_HEADER_LEN, dtype=torch.int64)
                self.headers.recv([head], 0, 0).wait(IDLE)
                magic, seq, mb, rnd, code, ndim, *dims = head.tolist()
                if magic != _MAGIC or code >= len(DTYPES) or ndim > 4:
                    raise DataPlaneError(f"the dist link from {self.sender_id} carried no tensor header")
                dtype, shape = DTYPES[code], tuple(dims[:ndim])
                buf = torch.empty(_payload_bytes(dtype, shape), dtype=torch.uint8, device=self.device)
                if buf.numel():  # (NCCL's wait with a timeout holds this thread until it landed)
                    self.payloads.recv([buf], 0, 0).wait(IDLE)
                ready = None
                if self.device.type == "cuda":  # the step's stream waits for this, not the host
                    ready = torch.cuda.Event()
                    ready.record(torch.cuda.current_stream(self.device))
                if seq == 0:
                    continue  # the probe
                with self.cond:
                    if self.error:  # closed (a re-attach replaced this link): nothing more to keep
                        return
                    self.got[seq] = (mb, rnd, dtype, shape, buf.view(dtype).view(shape), ready)
                    self.last = seq
                    for old in [s for s in self.got if s <= seq - MAX_UNREAD]:
                        del self.got[old]
                    self.cond.notify_all()
        except Exception as e:  # noqa: BLE001 - the peer gone, closed, or garbled: reads say so
            with self.cond:
                if self.error == "closed":
                    return  # replaced by a re-attach: its sender dropped it, as expected
                self.error = str(e) or type(e).__name__
                self.cond.notify_all()
            log.warning("data plane: the dist link from stage instance %s ended: %s", self.sender_id, self.error)

    def read(self, ref, micro_batch_id: int, round_: int, timeout: float | None = None) -> torch.Tensor:
        """The tensor of ``ref.seq`` once it arrived, checked against its header and the step.

        Raises:
            NotAttachedError: the link broke (the sender attaches again).
            DataPlaneError: it did not come in time, was dropped, or header and control disagree.
        """
        timeout = READ_TIMEOUT if timeout is None else timeout
        with self.cond:
            self.cond.wait_for(lambda: ref.seq in self.got or self.error or ref.seq <= self.last, timeout)
            entry = self.got.get(ref.seq)
            if entry is None:
                if self.error:
                    raise NotAttachedError(f"hidden_ref: the dist link from stage instance {ref.sender_id} is broken "
                                           f"({self.error}); it must attach again (AttachDataPlane)")
                if ref.seq <= self.last:
                    raise DataPlaneError(f"hidden_ref: tensor {ref.seq} of the dist link was read already or dropped")
                raise DataPlaneError(f"hidden_ref: tensor {ref.seq} did not arrive on the dist link within "
                                     f"{timeout:.0f}s")
            mb, rnd, dtype, shape, tensor, ready = entry
            wrong = []
            if (mb, rnd) != (micro_batch_id, round_):
                wrong.append(f"micro-batch {mb} round {rnd} in the header, micro-batch {micro_batch_id} round "
                             f"{round_} in the step")
            got_dtype = str(dtype).removeprefix("torch.")
            if got_dtype != ref.dtype:
                wrong.append(f"dtype {got_dtype} in the header, {ref.dtype!r} in the step")
            if shape != tuple(ref.shape):
                wrong.append(f"shape {list(shape)} in the header, {list(ref.shape)} in the step")
            if wrong:
                raise DataPlaneError(f"hidden_ref: tensor {ref.seq} of the dist link is not the step's: "
                                     f"{'; '.join(wrong)}")
            del self.got[ref.seq]
        if ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready)
            tensor.record_stream(stream)  # made on the receiving thread's stream, used on this one
        return tensor

    def close(self) -> None:
        """Drop the link (a re-attach replaced it). NCCL: abort, which ends a pending
        receive; gloo: the thread ends when the sender drops its side."""
        with self.cond:
            self.error = self.error or "closed"
            self.got.clear()
            self.cond.notify_all()
        if self.payloads is not None and self.backend == "nccl":
            self.payloads.abort()
