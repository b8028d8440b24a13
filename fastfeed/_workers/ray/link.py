"""Each Ray actor's direct link to the loader: its tasks and answers, and, from other machines, its batches,
streamed over TCP straight into ring slots.

Through Ray's object store a batch made on another node is copied into that node's store, fetched into this node's
store, and copied once more into a ring slot. Here each actor start holds one TCP connection to the main process
(``Sender``), and the main process reads every batch's bytes with ``recv_into`` straight into the slot it claims for
it (``Receiver``): the kernel's socket buffer is the only stop between the network and the slot, and ``recv_into``
releases the GIL while it copies, so the training thread runs meanwhile. Ray itself is not imported here: the pool
that owns the actors sends the address and token to each actor and the batch's metadata through its own calls, and
asks the receiver for the bytes by (worker, actor start key, task index).

The same connection is the actor's control link, on every node (an actor beside the loop writes its batches into
the ring's shared memory itself, and uses the link for nothing else): the pool sends each task over it (``send``)
and the actor sends back each answer, with the worker's state after it (``Sender.answer``), after the batch's bytes
where it streams them. A Ray call and ``ray.get`` cost the training loop's thread about half a millisecond each; a
frame costs it a ``sendall`` or a dictionary look-up, which is what a worker process's pipe costs.

Wire format (little-endian, fixed ``struct`` headers)::

    hello   HELLO_MAGIC (8 bytes), token (32 bytes), worker (uint32), key (uint64: which start of that worker)
    ack     ACK (8 bytes), from the receiver once the stream is registered
    frame   FRAME_MAGIC (4 bytes), task index (int64), nbytes (uint64), then exactly nbytes raw bytes
    answer  ANSWER_MAGIC (4 bytes), call number (int64), nbytes (uint64), then nbytes of pickle: actor -> loader
    task    TASK_MAGIC (4 bytes), call number (int64), nbytes (uint64), then nbytes of pickle: loader -> actor

A batch's bytes are never unpickled. An answer is unpickled only once its connection has presented the token, that
is, only what an actor of this loader sent in this framing; a task, only by the actor that connected to the address
and token the pool gave it through Ray.

The token is a per-receiver secret (``secrets.token_bytes(32)``) compared with ``hmac.compare_digest``: a peer that
sends a wrong token or magic, or says nothing within ``handshake_timeout_s``, is closed without an ack and counted in
``refused``; the token is never logged. ``Sender.connect`` returns only after the ack, so by the time an actor tells
the pool that it streams, the receiver knows its stream: ``take`` on a (worker, key) it does not know is an error at
once, not a wait. An actor that cannot connect (a firewall, a refused token) gets an ``OSError`` and the caller falls
back to the object store.

No half batch is ever visible. A frame is recorded (and ``take`` can return it) only once all its bytes are in the
slot; a connection that breaks, or sends garbage, inside a frame gives its slot back with ``writer.abandon``, and its
(worker, key) is marked ended, so that ``take`` raises ``StreamBroken`` for every frame that had not arrived (frames
that had stay takeable until taken, discarded or closed). A second connection for a (worker, key) already seen, or
discarded, is refused: a replaced actor that is still alive cannot write into the ring after its replacement.

Threads and descriptors. One daemon thread accepts; each connection gets its own thread, which does the handshake and
then reads frames, and which alone closes its socket. ``discard`` and ``close`` end connections with ``shutdown``
(which wakes a blocked ``recv_into``, and sends FIN even while a forked worker process holds a copy of the
descriptor), then join the threads within a bound. Shutdowns and closes happen under the receiver's lock, so a
shutdown never reaches a descriptor number that was closed and reused meanwhile.

The writer is a ``SlotWriter`` over the ring (``loop.py``), shared with the main thread's own copies (Ray objects,
``pool._into_ring``): its claims are atomic bit operations on the ring's free list and its mapping cache is a
dict keyed by the claimed slot, so concurrent claims from several threads never meet on one slot.
"""

from __future__ import annotations

import collections
import hmac
import itertools
import logging
import pickle
import secrets
import socket
import struct
import threading
import time

log = logging.getLogger("fastfeed")

HELLO_MAGIC = b"FFSTRM\x00\x02"  # the last two bytes are the protocol's version
HELLO = struct.Struct("<8s32sIQ")
ACK = b"FFSTRMOK"
FRAME_MAGIC = b"FFBT"
ANSWER_MAGIC = b"FFAN"
TASK_MAGIC = b"FFTK"
FRAME = struct.Struct("<4sqQ")  # every frame's header: magic, index (a task's, or a call's number), nbytes
# An answer is a reply and a worker's state: a few kilobytes (a batch's non-tensor parts, for one with many). Past
# this, a header is garbage, not an answer.
MAX_ANSWER_BYTES = 1 << 30
TOKEN_BYTES = 32
# A frame header's size field past this is garbage, not a batch: eight random bytes exceed it with probability
# 1 - 2**-24, and without the bound they would make the writer create (and prefault) a segment of that size.
MAX_FRAME_BYTES = 1 << 40
MAX_HANDSHAKES = 64  # connections not yet past their hello: past this a flood of silent peers is refused, not served
JOIN_S = 5.0  # how long close() and discard() wait for the threads they end (a claim may be creating a segment)
# Keepalive: a stream whose peer's machine vanished (no FIN, no RST) ends in about two minutes, not the kernel's
# default of two hours, so that take() raises and the actor is replaced.
KEEPALIVE = (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6))


class StreamBroken(ConnectionError):
    """The stream of one actor start ended (broke, closed, was discarded or never made) before a frame arrived."""

    def __init__(self, worker: int, key: int, message: str):
        super().__init__(message)
        self.worker = worker
        self.key = key


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in KEEPALIVE:
        option = getattr(socket, name, None)  # Linux names; other systems keep their defaults
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def _fill(sock: socket.socket, view: memoryview) -> int:
    """Read into all of ``view``; returns the bytes read, fewer only when the peer closed (or was shut down)."""
    got, want = 0, len(view)
    while got < want:
        n = sock.recv_into(view[got:], want - got)
        if not n:
            break
        got += n
    return got


class _Stream:
    """One actor start's connection: the frames it delivered and not yet taken, and why it ended (None: live)."""

    __slots__ = ("worker", "key", "sock", "thread", "frames", "answers", "ended")

    def __init__(self, worker: int, key: int, sock: socket.socket, thread: threading.Thread):
        self.worker = worker
        self.key = key
        self.sock = sock
        self.thread = thread
        self.frames: dict[int, tuple[int | None, str | None]] = {}
        self.answers: dict[int, object] = {}  # call number -> its answer (unpickled), until taken
        self.ended: str | None = None


class Receiver:
    """The main process's end: a listening socket, and one reading thread per actor connection.

    Args:
        writer: claims ring memory for each frame and gives it back: a ``loop.SlotWriter``, or anything with its
            ``claim(nbytes) -> (slot_id, made, base)`` (``base``: a uint8 CPU tensor of at least nbytes) and
            ``abandon(slot_id, made)``.
        host: the address to listen on (one the actors' machines can reach); the port is chosen by the system.
        handshake_timeout_s: how long a new connection may take to send its hello.
        max_frame_bytes: frames announcing more are garbage (see ``MAX_FRAME_BYTES``).
        on_news: called (from a receiving thread, with no lock held) when an answer arrives or a connection ends,
            so that a loop waiting in ``poll`` on other things too wakes (``pool._Wakeup.ring``).
    """

    def __init__(self, writer, host: str, handshake_timeout_s: float = 10.0,
                 max_frame_bytes: int = MAX_FRAME_BYTES, on_news=None):
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._on_news = on_news
        self.handshake_timeout_s = handshake_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.batches: collections.Counter = collections.Counter()  # frames received, per worker
        self.bytes: collections.Counter = collections.Counter()  # their payload bytes, per worker
        self.refused = 0  # connections closed before (or instead of) their ack
        self._writer = writer
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._streams: dict[tuple[int, int], _Stream] = {}
        self._gone: set[tuple[int, int]] = set()  # discarded starts: never let in again
        self._handshaking: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._closed = False
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        self._listener = socket.create_server((host, 0), family=family, backlog=128)
        self._host = host
        self._port = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept, name="fastfeed-stream-accept", daemon=True)
        try:
            self._acceptor.start()
        except BaseException:
            self._listener.close()
            raise

    @property
    def address(self) -> tuple[str, int]:
        return self._host, self._port

    def stats(self) -> dict:
        """Counters for ``DataLoader`` stats: batches and bytes per worker, and refused connections."""
        with self._lock:
            return {"batches": dict(self.batches), "bytes": dict(self.bytes), "refused": self.refused}

    # -- the main thread's side -----------------------------------------------------------------

    def take(self, worker: int, key: int, index: int, timeout: float | None) -> tuple[int | None, str | None] | None:
        """The ``(slot_id, made)`` frame ``index`` of (worker, key) was written into, once it has all arrived.

        Waits up to ``timeout`` seconds (None: without limit); returns None when it has not arrived by then. The
        caller owns what it gets (``Ring.receive`` takes it as a worker's report).

        Raises:
            StreamBroken: that start's connection ended, or was discarded, or never made, before the frame arrived.
        """
        return self._wait(worker, key, timeout, lambda stream: stream.frames.pop(index, None),
                          lambda why: self._broken(worker, key, index, why))  # fmt: skip

    def _wait(self, worker: int, key: int, timeout: float | None, look, lost):
        """What ``look(stream)`` finds (not None) on the stream of (worker, key), waiting for it up to ``timeout``;
        None if it is not there by then. Raises ``StreamBroken`` (its text ``lost(why)``) once the stream ended
        without it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                stream = self._streams.get((worker, key))
                if stream is None:
                    why = ("the receiver is closed" if self._closed else "it was discarded"
                           if (worker, key) in self._gone else "it never connected")
                    raise StreamBroken(worker, key, lost(why))
                hit = look(stream)
                if hit is not None:
                    return hit
                if stream.ended is not None:
                    raise StreamBroken(worker, key, lost(stream.ended))
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def send(self, worker: int, key: int, number: int, payload: bytes) -> None:
        """Send call ``number`` (a pickled message) to the actor of (worker, key) over its link.

        Never raises for a link that is gone: it ends that link instead, and ``answer`` then raises ``StreamBroken``
        for this call, which is where the pool learns of a lost actor."""
        header = FRAME.pack(TASK_MAGIC, number, len(payload))
        with self._cond:
            stream = self._streams.get((worker, key))
            if stream is None or stream.ended is not None:
                return
            try:
                # Under the lock: the stream's thread closes the socket under it, so this never writes into a
                # descriptor number reused meanwhile. A task is small and the actor reads its link in a thread of
                # its own, so this does not wait on the dataset.
                _send_all(stream.sock, [header, payload])
            except OSError as e:
                stream.ended = f"sending it call {number} failed ({type(e).__name__}: {e})"
                self._shutdown(stream.sock)
                self._cond.notify_all()

    def ready(self, worker: int, key: int, number: int) -> bool:
        """Whether ``answer`` would not wait: call ``number``'s answer is here, or the link ended."""
        with self._lock:
            stream = self._streams.get((worker, key))
            return stream is None or number in stream.answers or stream.ended is not None

    def answer(self, worker: int, key: int, number: int, timeout: float | None):
        """The answer to call ``number`` of (worker, key), once it has arrived; None if not within ``timeout``.

        Raises:
            StreamBroken: the link ended (the actor, its node or the connection was lost) before the answer came.
        """
        return self._wait(worker, key, timeout, lambda stream: stream.answers.pop(number, None),
                          lambda why: self._lost(worker, key, number, why))  # fmt: skip

    def wait_gone(self, links: list[tuple[int, int]], timeout: float) -> list[tuple[int, int]]:
        """Wait up to ``timeout`` for the actors' ends of ``links`` (worker, key) to close (their processes gone);
        returns those still open. Called before this end shuts them: a link that ended, the actor's end did."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                left = [k for k in links if (s := self._streams.get(k)) is not None and s.ended is None]
                remaining = deadline - time.monotonic()
                if not left or remaining <= 0:
                    return left
                self._cond.wait(remaining)

    @staticmethod
    def _lost(worker: int, key: int, number: int, why: str) -> str:
        return f"the link of DataLoader worker {worker} (Ray actor start {key}) ended before answer {number}: {why}"

    @staticmethod
    def _broken(worker: int, key: int, index: int, why: str) -> str:
        return (f"the batch stream of DataLoader worker {worker} (Ray actor start {key}) ended before batch "
                f"{index} arrived: {why}")

    def discard(self, worker: int, key: int) -> None:
        """Forget an actor start (it was replaced): give back the slots it filled and nobody took, end its
        connection, and refuse any later connection that names it."""
        with self._cond:
            self._gone.add((worker, key))
            stream = self._streams.pop((worker, key), None)
            if stream is None:
                return
            if stream.ended is None:
                stream.ended = "discarded"
            untaken = list(stream.frames.values())
            stream.frames.clear()
            stream.answers.clear()
            self._shutdown(stream.sock)
            self._cond.notify_all()
        for slot_id, made in untaken:
            self._writer.abandon(slot_id, made)
        if stream.thread is not threading.current_thread():
            stream.thread.join(JOIN_S)

    def close(self) -> None:
        """Stop accepting, end every connection, give back every slot not taken, and join the threads (bounded).

        Idempotent; afterwards ``take`` raises ``StreamBroken``.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            streams = list(self._streams.values())
            self._streams.clear()
            untaken = [frame for stream in streams for frame in stream.frames.values()]
            for stream in streams:
                stream.frames.clear()
                if stream.ended is None:
                    stream.ended = "the receiver is closed"
                self._shutdown(stream.sock)
            for sock in self._handshaking:
                self._shutdown(sock)
            self._shutdown(self._listener)  # wakes accept() (EINVAL on Linux); the acceptor closes it
            threads = [self._acceptor, *self._threads]
            self._cond.notify_all()
        for slot_id, made in untaken:
            self._writer.abandon(slot_id, made)
        deadline = time.monotonic() + JOIN_S
        for thread in threads:
            # A loader dropped while one of these threads ran the garbage collector is stopped from that thread:
            # it ends by itself once this returns (its socket is shut down).
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _shutdown(sock: socket.socket) -> None:
        # Under the lock (see the module's docstring); a socket its thread already closed raises EBADF.
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -- the receiver's threads ----------------------------------------------------------------

    def _accept(self) -> None:
        try:
            while True:
                try:
                    conn, peer = self._listener.accept()
                except OSError:
                    if self._closed:
                        return
                    time.sleep(0.05)  # out of descriptors, say: the peer waits in the backlog meanwhile
                    continue
                with self._lock:
                    if self._closed or len(self._handshaking) >= MAX_HANDSHAKES:
                        conn.close()
                        if not self._closed:
                            self.refused += 1
                            log.warning("fastfeed: refused a batch stream connection from %s: %d others are "
                                        "still in their handshake", peer, MAX_HANDSHAKES)  # fmt: skip
                        continue
                    thread = threading.Thread(target=self._serve, args=(conn, peer), name="fastfeed-stream-hello",
                                              daemon=True)  # fmt: skip
                    self._handshaking.add(conn)
                    self._threads.add(thread)
                try:
                    thread.start()
                except BaseException:
                    with self._lock:
                        self._handshaking.discard(conn)
                        self._threads.discard(thread)
                        conn.close()
                    raise
        finally:
            with self._lock:
                self._listener.close()

    def _serve(self, sock: socket.socket, peer) -> None:
        """A connection's thread: its handshake, then its frames until it ends."""
        stream = None
        try:
            stream = self._handshake(sock, peer)
            if stream is not None:
                self._pump(stream)
        except Exception as e:  # noqa: BLE001 - a thread's error has nowhere to go: it ends its stream instead
            log.warning("fastfeed: a batch stream from %s failed: %s: %s", peer, type(e).__name__, e)
            if stream is not None:
                self._end(stream, f"{type(e).__name__}: {e}")
        finally:
            with self._cond:
                self._handshaking.discard(sock)
                self._threads.discard(threading.current_thread())
                sock.close()

    def _refuse(self, peer, why: str) -> None:
        with self._lock:
            self.refused += 1
        log.warning("fastfeed: refused a batch stream connection from %s: %s", peer, why)  # never the token

    def _handshake(self, sock: socket.socket, peer) -> _Stream | None:
        """Read and check the hello, register the stream and ack it; None (and counted) when refused."""
        hello = bytearray(HELLO.size)
        view = memoryview(hello)
        deadline = time.monotonic() + self.handshake_timeout_s
        got = 0
        try:
            while got < len(hello):
                # One deadline for the whole hello: a peer trickling bytes gets no longer than a silent one.
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                sock.settimeout(remaining)
                n = sock.recv_into(view[got:])
                if not n:
                    break
                got += n
        except TimeoutError:
            self._refuse(peer, f"no hello within {self.handshake_timeout_s} s")
            return None
        except OSError as e:
            self._refuse(peer, f"{type(e).__name__} during its hello")
            return None
        if got < len(hello):
            self._refuse(peer, f"it closed after {got} of the hello's {len(hello)} bytes")
            return None
        magic, token, worker, key = HELLO.unpack(hello)
        # Both checks run on every hello, so the time taken says nothing about which one failed.
        good_magic = hmac.compare_digest(magic, HELLO_MAGIC)
        if not hmac.compare_digest(token, self.token) or not good_magic:
            self._refuse(peer, "wrong protocol" if not good_magic else "wrong token")
            return None
        with self._lock:
            if self._closed:
                return None
            if (worker, key) in self._streams or (worker, key) in self._gone:
                why = "its actor start already connected once, or was discarded"
                stream = None
            else:
                stream = self._streams[worker, key] = _Stream(worker, key, sock, threading.current_thread())
                self._handshaking.discard(sock)
        if stream is None:
            self._refuse(peer, f"worker {worker}, start {key}: {why}")
            return None
        threading.current_thread().name = f"fastfeed-stream-w{worker}"
        try:
            sock.settimeout(None)  # between frames a stream may idle for as long as the loop does
            _keepalive(sock)
            sock.sendall(ACK)
        except OSError as e:
            self._end(stream, f"could not acknowledge its hello: {e}")
            return None
        return stream

    def _end(self, stream: _Stream, why: str) -> None:
        with self._cond:
            if stream.ended is None:
                stream.ended = why
            self._cond.notify_all()
        self._news()

    def _news(self) -> None:
        if self._on_news is not None:
            self._on_news()

    def _pump(self, stream: _Stream) -> None:
        """Read frames into claimed slots until the connection ends; each complete one is recorded for take()."""
        sock, writer = stream.sock, self._writer
        header = bytearray(FRAME.size)
        hview = memoryview(header)
        try:
            while True:
                try:
                    got = _fill(sock, hview)
                except OSError as e:
                    self._end(stream, f"connection lost between batches ({type(e).__name__}: {e})")
                    return
                if got == 0:
                    self._end(stream, "the actor closed its connection")
                    return
                if got < FRAME.size:
                    self._end(stream, f"connection cut inside a frame header ({got} of {FRAME.size} bytes)")
                    return
                magic, index, nbytes = FRAME.unpack(header)
                if magic == ANSWER_MAGIC and 0 < nbytes <= MAX_ANSWER_BYTES:
                    if not self._take_answer(stream, index, nbytes):
                        return
                    continue
                if magic != FRAME_MAGIC or not 0 < nbytes <= self.max_frame_bytes:
                    self._end(stream, f"garbage instead of a frame header (magic {magic!r}, {nbytes} bytes)")
                    return
                with self._lock:
                    repeated = index in stream.frames
                if repeated:
                    self._end(stream, f"batch {index} sent twice")
                    return
                try:
                    slot_id, made, base = writer.claim(nbytes)
                except Exception as e:  # noqa: BLE001 - no memory for it (a full /dev/shm): the stream cannot go on
                    self._end(stream, f"no ring memory for batch {index} of {nbytes} bytes ({type(e).__name__}: {e})")
                    return
                try:
                    # A view of the slot itself: the kernel copies the socket's bytes straight into it.
                    view = memoryview(base.numpy())[:nbytes]
                    try:
                        got = _fill(sock, view)
                    finally:
                        view.release()
                        del base
                except BaseException as e:
                    writer.abandon(slot_id, made)
                    if not isinstance(e, OSError):
                        raise
                    self._end(stream, f"connection lost inside batch {index} ({type(e).__name__}: {e})")
                    return
                if got < nbytes:
                    writer.abandon(slot_id, made)
                    self._end(stream, f"connection cut after {got} of batch {index}'s {nbytes} bytes")
                    return
                with self._cond:
                    live = self._streams.get((stream.worker, stream.key)) is stream
                    if live:
                        stream.frames[index] = (slot_id, made)
                        self.batches[stream.worker] += 1
                        self.bytes[stream.worker] += nbytes
                        self._cond.notify_all()
                if not live:  # discarded or closed while it arrived: nobody will take it
                    writer.abandon(slot_id, made)
                    return
        finally:
            hview.release()

    def _take_answer(self, stream: _Stream, number: int, nbytes: int) -> bool:
        """Read answer ``number`` and record it for ``answer``; False when the link ended instead."""
        payload = bytearray(nbytes)
        try:
            got = _fill(stream.sock, memoryview(payload))
        except OSError as e:
            self._end(stream, f"connection lost inside answer {number} ({type(e).__name__}: {e})")
            return False
        if got < nbytes:
            self._end(stream, f"connection cut after {got} of answer {number}'s {nbytes} bytes")
            return False
        # Past the token: what this loader's own actor sent, in this framing (see the module's docstring).
        answer = pickle.loads(payload)
        with self._cond:
            if self._streams.get((stream.worker, stream.key)) is not stream:
                return False  # discarded or closed meanwhile: nobody will take it
            twice = number in stream.answers
            if not twice:
                stream.answers[number] = answer
                self._cond.notify_all()
        if twice:
            self._end(stream, f"answer {number} sent twice")
            return False
        self._news()
        return True


def _send_all(sock: socket.socket, bufs: list) -> None:
    """``sendall`` of several buffers in as few ``sendmsg`` calls as the socket takes them in: one for a header and
    the payload it heads, unless the socket takes only part (a full buffer, a signal)."""
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


IOV_MAX = 1024  # buffers one sendmsg takes (Linux's UIO_MAXIOV)


class Sender:
    """An actor's end: one connection to the main process's ``Receiver``, frames sent in task order.

    A send that fails leaves the connection closed (the receiver gives back the slot of the frame it cut), so the
    caller sends that batch, and later ones, another way.
    """

    def __init__(self, sock: socket.socket):
        self._sock: socket.socket | None = sock
        self._lock = threading.Lock()  # batches and answers go out whole, one at a time, from any thread

    @classmethod
    def connect(cls, address: tuple[str, int], token: bytes, worker: int, key: int, timeout_s: float = 10.0,
                send_timeout_s: float | None = None) -> Sender:
        """Connect, introduce this actor start, and wait for the receiver's ack.

        Args:
            timeout_s: for the connection and the ack.
            send_timeout_s: for each send afterwards (None: a send waits as long as the receiver does not read).

        Raises:
            OSError: no connection, or the receiver refused it (wrong token, a start it already knows, closed).
        """
        if len(token) != TOKEN_BYTES:
            raise ValueError(f"a stream token is {TOKEN_BYTES} bytes, not {len(token)}")
        sock = socket.create_connection(address, timeout=timeout_s)
        try:
            # The header and the payload's tail go out at once, not after the previous segment's (delayed) ack.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keepalive(sock)
            sock.sendall(HELLO.pack(HELLO_MAGIC, token, worker, key))
            ack = bytearray(len(ACK))
            if _fill(sock, memoryview(ack)) < len(ACK) or bytes(ack) != ACK:
                raise ConnectionRefusedError(f"the batch stream receiver at {address} refused worker {worker}")
            sock.settimeout(send_timeout_s)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    def send(self, index: int, buf) -> None:
        """Send batch ``index``'s bytes: a contiguous buffer (numpy array, memoryview), not copied.

        Raises:
            OSError: the connection failed, now or before; it is closed.
        """
        payload = memoryview(buf)
        if not payload.c_contiguous:
            raise ValueError("a streamed batch must be one contiguous buffer")
        payload = payload.cast("B") if payload.format != "B" or payload.ndim != 1 else payload
        if not payload.nbytes:
            raise ValueError("an empty batch has no bytes to stream")
        with self._lock:
            self._frame(FRAME.pack(FRAME_MAGIC, index, payload.nbytes), payload)

    def send_pieces(self, index: int, pieces: list, nbytes: int) -> None:
        """Send batch ``index``'s ``nbytes``, which are ``pieces`` (byte memoryviews) one after another, gathered
        by the kernel from where they are (``sendmsg``), not copied into one buffer first.

        Raises:
            OSError: the connection failed, now or before; it is closed.
        """
        if not nbytes or sum(len(p) for p in pieces) != nbytes:
            raise ValueError(f"a streamed batch's pieces must add up to its {nbytes} bytes, and to more than none")
        with self._lock:
            self._frame(FRAME.pack(FRAME_MAGIC, index, nbytes), *pieces)

    def answer(self, number: int, payload: bytes) -> None:
        """Send the answer to call ``number`` (pickled by the caller).

        Raises:
            OSError: the connection failed, now or before; it is closed.
        """
        with self._lock:
            self._frame(FRAME.pack(ANSWER_MAGIC, number, len(payload)), memoryview(payload))

    def _frame(self, header: bytes, *payload) -> None:
        """Send one frame: ``header``, then the ``payload`` buffers one after another (the caller holds the lock)."""
        sock = self._sock
        if sock is None:
            raise BrokenPipeError("the batch stream is closed")
        try:
            _send_all(sock, [memoryview(header), *payload])
        except BaseException:
            self.close()  # the frame may be cut: the receiver must see the connection end, not a next header
            raise

    def task(self) -> tuple[int, object] | None:
        """The next call the loader sent (its number and message), waiting for it; None once the link ended.
        Only one thread reads."""
        sock = self._sock
        header = bytearray(FRAME.size)
        try:
            if sock is None or _fill(sock, memoryview(header)) < FRAME.size:
                return None
            magic, number, nbytes = FRAME.unpack(header)
            if magic != TASK_MAGIC or not 0 < nbytes <= MAX_ANSWER_BYTES:
                return None
            payload = bytearray(nbytes)
            if _fill(sock, memoryview(payload)) < nbytes:
                return None
        except OSError:
            return None
        # What the loader sent: this actor connected to the address and token the pool gave it through Ray.
        return number, pickle.loads(payload)

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked reading it (close alone would not)
            except OSError:
                pass
            sock.close()

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
