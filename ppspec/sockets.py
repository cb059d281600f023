"""What a socket holds unread, for the timers of an event loop that may have stalled.

After a stall (the process paused: SIGSTOP then SIGCONT, a frozen container), libuv runs
its overdue timers before it reads the sockets: a timer that judges a peer by what this
process has read (an HTTP read deadline, a keep-alive timeout, the engine process's
silence) would judge it by data already waiting in the socket. Such timers ask first.
"""
from __future__ import annotations

import fcntl
import struct
import termios
from typing import Any


def unread_bytes(transport: Any) -> int:
    """Bytes received on the socket of ``transport`` (an asyncio transport or stream writer)
    and not yet read (``FIONREAD``); 0 when it cannot tell."""
    try:
        n = fcntl.ioctl(transport.get_extra_info("socket").fileno(), termios.FIONREAD, b"\0\0\0\0")
        return struct.unpack("i", n)[0]
    except (AttributeError, OSError, ValueError):
        return 0
