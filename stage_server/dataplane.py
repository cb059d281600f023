"""The stage-to-stage data plane: how a stage hands its hidden states to the next one.

The gRPC ``StepRequest`` always carries the micro-batch's control data; the hidden states
``[T, hidden]`` travel one of four ways, agreed by ``AttachDataPlane`` when the next
stage is first reached and again whenever it restarted:

- ``shm`` (CPU stages on one host): the sender copies the tensor into a POSIX
  shared-memory slot (``/dev/shm``) and names it in ``StepRequest.hidden_ref``; the receiver
  maps the slot once and reads it in place (no copy, no serialisation).
- ``cuda_ipc`` (CUDA stages on one host): the slot's payload is a device buffer exported by
  CUDA IPC; the sender records an interprocess event after its copy, the receiver's stream
  waits for it before copying the tensor out (device to device).
- ``dist`` (stages on different hosts; ``dataplane_dist.py``): ``torch.distributed``
  point-to-point in a 2-rank group per link, gloo between CPU stages, NCCL between CUDA
  stages; a header message before each tensor, checked as the slots' header is.
- ``bytes`` (anything else, and the fallback): the tensor inline in
  ``StepRequest.hidden_states``.

Every slot has a header in shared memory (both on ``shm`` and ``cuda_ipc``) that repeats
what the control message says (seq, micro_batch_id, round, dtype, shape): a receiver refuses
a tensor whose header disagrees (:class:`DataPlaneError`, a ValueError: INVALID_ARGUMENT,
before anything changes).

**Slot lifetime.** A slot is the sender's until the relay call it went with is answered
(the receiver has then finished with it: its reply comes after its step); a call that ends
without an answer (timeout, peer gone) retires its slot, since the receiver may still read
it. **No leaked segments:** the receiver unlinks a segment as soon as it has mapped it (both
keep their mapping), and the sender unlinks at close those the receiver never opened.
Segment names carry the creating process id, so a stage removes at start the segments of
dead processes (a sender killed between creating a segment and its first send).
"""
from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import uuid
from dataclasses import dataclass

import torch

from ppspec.proto.codec import tensor_to_pb
from ppspec.proto.local import host_id  # noqa: F401 - dataplane.host_id: one host id for both channels
from ppspec.proto.stubs import pb

log = logging.getLogger("ppspec.dataplane")

SHM_DIR = "/dev/shm"
PREFIX = "ppspec-"
MAX_SENDERS = 4  # links a receiver keeps, the least recently used dropped (a restarted sender, tools)
PAYLOAD_OFFSET = 4096  # the header's page; the payload starts page-aligned
MIN_SLOT_BYTES = 1 << 20
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAGIC = b"PPSPEC01"
# magic, seq, micro_batch_id, round, nbytes, dtype index, ndim, shape[4]
_HEADER = struct.Struct("<8sQIQQII4q")


class DataPlaneError(ValueError):
    """A tensor reference that does not match its slot or control message."""


class NotAttachedError(DataPlaneError):
    """A tensor reference from a sender that has not attached (FAILED_PRECONDITION)."""


def choose(requested: str, device: str) -> str:
    """The transport a stage on ``device`` offers its next stage for ``--data-plane
    requested`` (``auto``: ``cuda_ipc`` from a CUDA stage, ``shm`` from a CPU stage, and
    ``dist`` instead where the next stage is on another host: ``AttachRequest.dist_if_remote``)."""
    if requested != "auto":
        return requested
    return "cuda_ipc" if str(device).startswith("cuda") else "shm"


def sweep_dead_segments() -> list[str]:
    """Remove ``/dev/shm/ppspec-<pid>-*`` segments whose creating process is gone."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except OSError:
            pass
    return removed


# ---------------------------------------------------------------------------------- segments
class Segment:
    """A mapped ``/dev/shm`` file: a header page then ``capacity`` payload bytes."""

    def __init__(self, name: str, capacity: int, create: bool):
        self.name, self.path = name, os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                # reserve the pages now: a write past a full tmpfs would be SIGBUS, this is ENOSPC
                os.posix_fallocate(fd, 0, PAYLOAD_OFFSET + capacity)
            size = os.fstat(fd).st_size
            if size < PAYLOAD_OFFSET:
                raise DataPlaneError(f"shared-memory segment {name} is {size} bytes, smaller than its header")
            self.mem = mmap.mmap(fd, size)
        except BaseException:
            if create:
                os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.capacity = size - PAYLOAD_OFFSET
        self.unlinked = False

    def payload(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the payload, a uint8 view (no copy)."""
        return torch.frombuffer(self.mem, dtype=torch.uint8, count=nbytes, offset=PAYLOAD_OFFSET)

    def write_header(self, seq: int, micro_batch_id: int, round_: int, dtype: torch.dtype, shape) -> None:
        dims = list(shape) + [0] * (4 - len(shape))
        nbytes = _numel(shape) * dtype.itemsize
        _HEADER.pack_into(self.mem, 0, _MAGIC, seq, micro_batch_id, round_, nbytes, DTYPES.index(dtype), len(shape), *dims)

    def read_header(self) -> tuple:
        magic, seq, mb, rnd, nbytes, code, ndim, *dims = _HEADER.unpack_from(self.mem, 0)
        if magic != _MAGIC or ndim > 4 or code >= len(DTYPES):
            raise DataPlaneError(f"shared-memory segment {self.name} holds no tensor header")
        return seq, mb, rnd, nbytes, DTYPES[code], tuple(dims[:ndim])

    def unlink(self) -> None:
        if not self.unlinked:
            self.unlinked = True
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---------------------------------------------------------------------------------- sender side
@dataclass
class Slot:
    index: int
    seg: Segment
    device_buf: torch.Tensor | None = None  # cuda_ipc: the payload on the device
    event: object = None  # cuda_ipc: interprocess torch.cuda.Event
    exported: object = None  # cuda_ipc: pb.CudaIpcBuffer


@dataclass
class Sent:
    """What one relay carries: the inline tensor (bytes) or the slot it waits in."""

    tensor: object = None  # pb.Tensor (bytes)
    ref: object = None  # pb.TensorRef
    slot: Slot | None = None

    def fill(self, request) -> None:
        """Put the hidden states into ``request`` (a ``pb.StepRequest``)."""
        if self.ref is not None:
            request.ClearField("hidden_states")
            request.hidden_ref.CopyFrom(self.ref)
        else:
            request.ClearField("hidden_ref")
            request.hidden_states.CopyFrom(self.tensor)


class BytesLink:
    """Hidden states inline in the step message (any two hosts; the fallback)."""

    transport = "bytes"

    def put(self, t: torch.Tensor, micro_batch_id: int, round_: int) -> Sent:
        return Sent(tensor=tensor_to_pb(t))

    def done(self, sent: Sent, answered: bool) -> None:
        pass

    def close(self) -> None:
        pass


class SlotLink:
    """Sender side of ``shm`` and ``cuda_ipc``: a pool of buffer slots, one per relay in
    flight, grown (a new, larger segment) when a tensor does not fit.

    Args:
        sender_id: this stage's instance_id (names the link on the receiver).
        device: where the hidden states are (``cpu`` for shm; ``cuda:N`` for cuda_ipc).
    """

    def __init__(self, transport: str, sender_id: str, device: str):
        assert transport in ("shm", "cuda_ipc")
        self.transport, self.sender_id, self.device = transport, sender_id, torch.device(device)
        self.lock = threading.Lock()  # put runs on the compute thread, done on the event loop
        self.free: list[Slot] = []
        self.slots = 0  # slot indices handed out
        self.spare: list[int] = []  # indices of retired slots, for their next segment
        self.seq = 0
        self.live: list[Segment] = []  # every segment made, to unlink at close
        self._gen = 0

    def _segment(self, capacity: int) -> Segment:
        self._gen += 1
        name = f"{PREFIX}{os.getpid()}-{self.sender_id}-{self._gen}"
        seg = Segment(name, capacity if self.transport == "shm" else 0, create=True)
        self.live = [s for s in self.live if not s.unlinked] + [seg]
        return seg

    def _new_slot(self, index: int, nbytes: int) -> Slot:
        capacity = max(MIN_SLOT_BYTES, 1 << (max(nbytes, 1) - 1).bit_length())
        slot = Slot(index, self._segment(capacity))
        if self.transport == "cuda_ipc":
            try:
                with torch.cuda.device(self.device):  # the event belongs to the current device
                    slot.device_buf = torch.empty(capacity, dtype=torch.uint8, device=self.device)
                    slot.event = torch.cuda.Event(interprocess=True)
                    slot.exported = export_cuda(slot.device_buf, slot.event)
            except BaseException:
                slot.seg.unlink()
                raise
        return slot

    def _take(self, nbytes: int) -> Slot:
        with self.lock:
            fits = [s for s in self.free if self._capacity(s) >= nbytes]
            if fits:  # the smallest that fits: large slots stay free for large tensors
                slot = min(fits, key=self._capacity)
                self.free.remove(slot)
                return slot
            if self.free:  # too small: the same index gets a larger buffer
                old = self.free.pop()
                old.seg.unlink()
                index = old.index
            elif self.spare:
                index = self.spare.pop()
            else:
                index, self.slots = self.slots, self.slots + 1
            try:
                return self._new_slot(index, nbytes)
            except BaseException:  # e.g. /dev/shm full (ENOSPC): the index waits for the next try
                self.spare.append(index)
                raise

    @staticmethod
    def _capacity(slot: Slot) -> int:
        return slot.device_buf.numel() if slot.device_buf is not None else slot.seg.capacity

    def put(self, t: torch.Tensor, micro_batch_id: int, round_: int) -> Sent:
        """Copy ``t`` into a free slot and write its header (on the thread that made ``t``:
        on CUDA the copy is ordered after the kernels that wrote it)."""
        t = t.detach().contiguous()
        if t.dtype not in DTYPES:
            raise DataPlaneError(f"hidden_states dtype {t.dtype} cannot travel on the data plane")
        nbytes = t.numel() * t.element_size()
        slot = self._take(nbytes)
        with self.lock:
            self.seq += 1
            seq = self.seq
        flat = t.view(-1).view(torch.uint8) if nbytes else t.new_empty(0, dtype=torch.uint8)
        if slot.device_buf is not None:
            with torch.cuda.device(self.device):  # on the stream that wrote t (the stage's current one)
                slot.device_buf[:nbytes].copy_(flat, non_blocking=True)
                slot.event.record(torch.cuda.current_stream(self.device))
        else:
            slot.seg.payload(nbytes).copy_(flat)
        slot.seg.write_header(seq, micro_batch_id, round_, t.dtype, t.shape)
        ref = pb.TensorRef(sender_id=self.sender_id, slot=slot.index, seq=seq,
                           dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), shm_name=slot.seg.name)
        if slot.exported is not None:
            ref.cuda.CopyFrom(slot.exported)
        return Sent(ref=ref, slot=slot)

    def done(self, sent: Sent, answered: bool) -> None:
        """The relay call of ``sent`` ended; ``answered``: the receiver replied, so it is done
        with the slot. Otherwise the slot is retired (the receiver may still read it)."""
        if sent.slot is None:
            return
        with self.lock:
            if answered:
                self.free.append(sent.slot)
            else:  # the index gets a new segment (the receiver then drops its old mapping)
                sent.slot.seg.unlink()
                self.spare.append(sent.slot.index)

    def close(self) -> None:
        with self.lock:
            for seg in self.live:
                seg.unlink()
            self.free.clear()


def export_cuda(buf: torch.Tensor, event) -> "pb.CudaIpcBuffer":
    """The IPC handles of ``buf``'s allocation and of ``event`` (torch's ``_share_cuda_``)."""
    storage = buf.untyped_storage()
    (_dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync) = storage._share_cuda_()
    return pb.CudaIpcBuffer(
        device_uuid=str(torch.cuda.get_device_properties(buf.device).uuid), handle=handle, size_bytes=size,
        offset_bytes=offset, ref_counter_handle=rc_handle, ref_counter_offset=rc_offset,
        event_handle=ev_handle or b"", event_sync_required=bool(ev_sync), ready_event=event.ipc_handle(),
    )


# ---------------------------------------------------------------------------------- receiver side
class _Inbox:
    """One sender's slots as this receiver mapped them (slot index -> segment)."""

    def __init__(self, transport: str, device: str):
        self.transport, self.device = transport, device
        self.segments: dict[int, Segment] = {}
        self.cuda: dict[int, tuple[tuple, torch.Tensor, object]] = {}  # slot -> (handle key, buffer, event)

    def close(self) -> None:
        pass  # the mappings go with the last reference


class Receiver:
    """Receiver side of the data plane: the links of senders that attached, and reading
    the tensor a step names (:meth:`read`).

    Args:
        device: this stage's device (a ``cuda_ipc`` tensor is copied onto it).
        dist_inbox: the class of a ``dist`` link's receiving end
            (``dataplane_dist.DistInbox``, given by whoever hosts such links; that module
            builds on this one); None: a ``dist`` offer is answered ``bytes``.
    """

    def __init__(self, device: str, dist_inbox: type | None = None):
        self.device = str(device)
        self.dist_inbox = dist_inbox
        self.host = host_id()
        self.inboxes: dict[str, _Inbox] = {}
        self.lock = threading.Lock()

    def attach(self, req: "pb.AttachRequest", peer_host: str = "127.0.0.1") -> "pb.AttachReply":
        """Answer a sender's offer: the transport agreed and, where it is "bytes" but the
        offer was another, why (worded for the sender's Info and log). A slot offer stands
        only if the sender is on this host and the probe slot opens here and holds the
        nonce; from another host it becomes ``dist`` where the sender allows
        (``dist_if_remote``). ``dist``: a fresh group, its store's port in the reply
        (``peer_host``: the sender's address, as its call came). The sender's earlier link
        (if any) is replaced."""
        offer = req.transport
        remote = req.host_id.rsplit("/", 1)[-1] != self.host.rsplit("/", 1)[-1]
        if offer in ("shm", "cuda_ipc") and remote and req.dist_if_remote:
            offer = "dist"
        if offer == "bytes":
            return pb.AttachReply(transport="bytes")
        if offer == "dist":
            return self._attach_dist(req, peer_host)
        transport, detail = self._attach_slots(req, offer, remote)
        return pb.AttachReply(transport=transport, detail=detail)

    def _attach_dist(self, req, peer_host: str) -> "pb.AttachReply":
        if self.dist_inbox is None:
            return pb.AttachReply(transport="bytes", detail="the next stage hosts no dist links")
        try:
            inbox = self.dist_inbox(req.sender_id, req.dist_backend, self.device, peer_host)
        except Exception as e:  # noqa: BLE001 - no store, another backend: bytes, and why
            return pb.AttachReply(transport="bytes", detail=f"the next stage cannot host a dist link: {e}")
        self._keep(req.sender_id, inbox)
        return pb.AttachReply(transport="dist", store_port=inbox.port)

    def _keep(self, sender_id: str, inbox) -> None:
        """``inbox`` is ``sender_id``'s link from now on (its earlier one closed)."""
        with self.lock:
            dropped = [self.inboxes.pop(sender_id, None)]
            self.inboxes[sender_id] = inbox
            while len(self.inboxes) > MAX_SENDERS:
                dropped.append(self.inboxes.pop(next(iter(self.inboxes))))
        for old in dropped:
            if old is not None:
                old.close()

    def _attach_slots(self, req, offer: str, remote: bool) -> tuple[str, str]:
        if offer not in ("shm", "cuda_ipc"):
            return "bytes", f"the next stage knows no transport {offer!r}"
        if remote:
            return "bytes", f"the next stage is on another host ({self.host}; this stage is on {req.host_id})"
        if offer == "cuda_ipc" and not self.device.startswith("cuda"):
            return "bytes", f"the next stage runs on {self.device}, not on a CUDA device"
        inbox = _Inbox(offer, self.device)
        try:
            got = self._read(inbox, req.probe, 0, 0)
            got = got.to("cpu") if got.device.type != "cpu" else got
            if bytes(got.view(torch.uint8).numpy().tobytes()) != req.nonce:
                return "bytes", "the next stage reads another nonce in the probe slot (another shared memory?)"
        except Exception as e:  # noqa: BLE001 - whatever fails here, the hop goes as bytes and says why
            return "bytes", (f"the next stage cannot open this stage's {offer} buffer: {e} (do the stages share "
                             f"/dev/shm, or for CUDA IPC the IPC namespace? see deploy/README.md)")
        self._keep(req.sender_id, inbox)
        return offer, ""

    def read(self, ref: "pb.TensorRef", micro_batch_id: int, round_: int) -> torch.Tensor:
        """The tensor ``ref`` names, checked against its slot's header and the step's
        ``micro_batch_id`` and ``round``. On ``shm`` a view of the slot (valid until this
        step is answered); on ``cuda_ipc`` a copy on this stage's device, ordered after the
        sender's copy. Call on the compute thread.

        Raises:
            NotAttachedError: no link from ``ref.sender_id`` (attach first).
            DataPlaneError: the slot cannot be opened, or header and control disagree.
        """
        with self.lock:
            inbox = self.inboxes.pop(ref.sender_id, None)
            if inbox is not None:  # most recently used last: a sender that sends is never the one dropped
                self.inboxes[ref.sender_id] = inbox
        if inbox is None:
            raise NotAttachedError(f"hidden_ref: no data-plane link from stage instance {ref.sender_id!r}; "
                                   f"it must attach first (AttachDataPlane)")
        if inbox.transport == "dist":
            return inbox.read(ref, micro_batch_id, round_)
        try:
            return self._read(inbox, ref, micro_batch_id, round_)
        except OSError as e:
            raise DataPlaneError(f"hidden_ref: cannot open slot {ref.slot} ({ref.shm_name}): {e}") from None

    def _read(self, inbox: _Inbox, ref, micro_batch_id: int, round_: int) -> torch.Tensor:
        seg = inbox.segments.get(ref.slot)
        new = seg is None or seg.name != ref.shm_name
        if new:
            if not ref.shm_name.startswith(PREFIX) or "/" in ref.shm_name:
                raise DataPlaneError(f"hidden_ref: {ref.shm_name!r} is not a data-plane segment")
            seg = Segment(ref.shm_name, 0, create=False)
        seq, mb, rnd, nbytes, dtype, shape = seg.read_header()
        want_dtype = str(dtype).removeprefix("torch.")
        wrong = []
        if seq != ref.seq:
            wrong.append(f"sequence number {seq} in the slot, {ref.seq} in the step")
        if (mb, rnd) != (micro_batch_id, round_):
            wrong.append(f"micro-batch {mb} round {rnd} in the slot, micro-batch {micro_batch_id} round {round_} "
                         f"in the step")
        if want_dtype != ref.dtype:
            wrong.append(f"dtype {want_dtype} in the slot, {ref.dtype!r} in the step")
        if shape != tuple(ref.shape):
            wrong.append(f"shape {list(shape)} in the slot, {list(ref.shape)} in the step")
        if inbox.transport == "shm" and nbytes > seg.capacity:
            wrong.append(f"{nbytes} bytes do not fit the slot's {seg.capacity}")
        if wrong:
            raise DataPlaneError(f"hidden_ref: slot {ref.slot} does not hold the step's tensor: {'; '.join(wrong)}")
        if new:  # checked: this slot's segment from now on
            seg.unlink()  # both ends hold it mapped: nothing is left in /dev/shm to leak
            inbox.segments[ref.slot] = seg
        if inbox.transport == "shm":
            return seg.payload(nbytes).view(dtype).view(shape)
        return self._read_cuda(inbox, ref, nbytes, dtype, shape)

    def _read_cuda(self, inbox: _Inbox, ref, nbytes: int, dtype, shape) -> torch.Tensor:
        c = ref.cuda
        key = (c.handle, c.offset_bytes, c.size_bytes)  # two buffers may share one allocation's handle
        cached = inbox.cuda.get(ref.slot)
        if cached is None or cached[0] != key:
            cached = (key, *import_cuda(c))
            inbox.cuda[ref.slot] = cached
        _, buf, event = cached
        if nbytes > buf.numel():
            raise DataPlaneError(f"hidden_ref: {nbytes} bytes do not fit slot {ref.slot} ({buf.numel()})")
        dev = torch.device(self.device)
        with torch.cuda.device(dev):
            for d in {dev, buf.device}:  # never read before the sender's copy is done
                torch.cuda.current_stream(d).wait_event(event)
            return buf[:nbytes].to(dev, copy=True).view(dtype).view(shape)


def import_cuda(c: "pb.CudaIpcBuffer") -> tuple[torch.Tensor, object]:
    """Map an exported device buffer and its ready event in this process."""
    index = next((i for i in range(torch.cuda.device_count())
                  if str(torch.cuda.get_device_properties(i).uuid) == c.device_uuid), None)
    if index is None:
        raise DataPlaneError(f"GPU {c.device_uuid} is not visible to this stage (CUDA_VISIBLE_DEVICES?)")
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        index, c.handle, c.size_bytes, c.offset_bytes, c.ref_counter_handle, c.ref_counter_offset,
        c.event_handle or None, c.event_sync_required,
    )
    buf = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(storage)
    event = torch.cuda.Event.from_ipc_handle(index, c.ready_event)
    return buf, event


def make_probe(link: SlotLink) -> tuple[Sent, bytes]:
    """A slot holding a random nonce, for the receiver to open at attach."""
    nonce = uuid.uuid4().bytes
    t = torch.frombuffer(bytearray(nonce), dtype=torch.uint8).view(torch.float32).to(link.device)
    return link.put(t, 0, 0), nonce
