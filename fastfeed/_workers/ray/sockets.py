"""The Ray link's socket plumbing, shared by both ends (``link.Receiver`` in the loader, ``sender.Sender`` in an
actor): keepalive, exact reads, gathered sends, shutdowns that wake a blocked thread, and a TLS connection that one
thread may read while another writes. Nothing here reads a peer's bytes for meaning: that is ``wire.py``'s."""

from __future__ import annotations

import collections
import itertools
import select
import socket
import ssl
import threading
import time

# Keepalive: a stream whose peer's machine vanished (no FIN, no RST) ends in about two minutes, not the kernel's
# default of two hours, so that take() raises and the actor is replaced.
KEEPALIVE = (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6))
IOV_MAX = 1024  # buffers one sendmsg takes (Linux's UIO_MAXIOV)


def keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in KEEPALIVE:
        option = getattr(socket, name, None)  # Linux names; other systems keep their defaults
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


class Tls:
    """A TLS connection that one thread may read while another writes.

    OpenSSL forbids two calls on one connection at once (an ``SSL_read`` in one thread and an ``SSL_write`` in
    another corrupt its state), and the link reads and writes from two threads. So every OpenSSL call here holds a
    lock, over a non-blocking socket: a call that would block gives the lock back and waits for the socket outside
    it. ``shutdown`` is the plain socket's (it wakes a waiting reader, which then reads the end of the stream).
    """

    def __init__(self, sock: ssl.SSLSocket):
        self._ssl = sock
        self._lock = threading.Lock()
        self._timeout: float | None = sock.gettimeout()
        sock.setblocking(False)

    def settimeout(self, seconds: float | None) -> None:
        self._timeout = seconds

    def gettimeout(self) -> float | None:
        return self._timeout

    def fileno(self) -> int:
        return self._ssl.fileno()

    def setsockopt(self, *args) -> None:
        self._ssl.setsockopt(*args)

    def version(self) -> str | None:
        return self._ssl.version()

    def _call(self, op):
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        while True:
            with self._lock:
                try:
                    return op()
                except ssl.SSLWantReadError:
                    events = select.POLLIN
                except ssl.SSLWantWriteError:
                    events = select.POLLOUT
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError("timed out")
            poller = select.poll()
            poller.register(self._ssl.fileno(), events)
            if not poller.poll(None if remaining is None else max(1, int(remaining * 1000))) and remaining is not None:
                raise TimeoutError("timed out")

    def do_handshake(self) -> None:
        self._call(self._ssl.do_handshake)

    def recv_into(self, buffer, nbytes: int = 0) -> int:
        return self._call(lambda: self._ssl.recv_into(buffer, nbytes or len(buffer)))  # 0 would read nothing

    def sendall(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            sent = self._call(lambda: self._ssl.send(view))
            view = view[sent:]

    def shutdown(self, how: int) -> None:
        socket.socket.shutdown(self._ssl, how)  # not SSLSocket's, which drops the TLS state under a reader

    def close(self) -> None:
        self._ssl.close()


def read_by(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly ``n`` bytes (a handshake message's fixed size), by ``deadline``.

    Raises:
        TimeoutError: not all of them by then. EOFError: the peer closed first.
    """
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        sock.settimeout(remaining)
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise EOFError
        got += k
    return bytes(buf)


def fill(sock: socket.socket, view: memoryview) -> int:
    """Read into all of ``view``; returns the bytes read, fewer only when the peer closed (or was shut down)."""
    got, want = 0, len(view)
    while got < want:
        n = sock.recv_into(view[got:], want - got)
        if not n:
            break
        got += n
    return got


def drop(sock: socket.socket) -> None:
    """Shut a connection down, under its owner's lock (a thread that closes it under that lock still holds it):
    the plain socket's shutdown even for TLS, whose own would unset the TLS object that its reading or writing
    thread is using (they get an error from the connection instead, as from a peer's reset)."""
    try:
        if isinstance(sock, Tls):
            sock.shutdown(socket.SHUT_RDWR)  # the plain socket's too
        else:
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


def pieces(bufs: list, size: int):
    """``bufs`` (a frame's buffers) regrouped into lists of at most ``size`` bytes each, in order, without copying."""
    group, room = [], size
    for buf in bufs:
        view = memoryview(buf).cast("B")
        while len(view):
            part, view = view[:room], view[room:]
            group.append(part)
            room -= len(part)
            if not room:
                yield group
                group, room = [], size
    if group:
        yield group


def send_all(sock: socket.socket, bufs: list) -> None:
    """``sendall`` of several buffers in as few ``sendmsg`` calls as the socket takes them in: one for a header and
    the payload it heads, unless the socket takes only part (a full buffer, a signal)."""
    if isinstance(sock, Tls):  # no sendmsg: TLS copies each piece into its records anyway
        for buf in bufs:
            if len(buf):
                sock.sendall(buf)
        return
    bufs = collections.deque(b for b in bufs if len(b))
    while bufs:
        sent = sock.sendmsg(list(itertools.islice(bufs, IOV_MAX)))
        while sent:
            head = bufs[0]
            if sent >= len(head):
                sent -= len(head)
                bufs.popleft()
            else:
                bufs[0] = head[sent:]
                sent = 0
