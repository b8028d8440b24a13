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

Wire format and trust: ``wire.py``, which says what the link protects (the secret never crosses it; every frame's
header, and every task's and answer's payload, is authenticated under a per-connection key before it is used or
unpickled; every size is bounded before anything is allocated for it; TLS where Ray uses it) and holds every
function that reads a peer's bytes. This module moves those bytes: the handshake (hello, challenge, proof, ack)
with one deadline for all of it, then sealed frames::

    batch   sealed header (FRAME_MAGIC, task index, nbytes; its MAC), then exactly nbytes raw bytes
    answer  sealed header (ANSWER_MAGIC, call number, nbytes; its MAC), nbytes of pickle, the pickle's MAC
    task    sealed header (TASK_MAGIC, call number, nbytes; its MAC), nbytes of pickle, the pickle's MAC

A batch's bytes are never unpickled. A peer whose hello is not this protocol's, whose proof does not check, or which
says nothing within ``handshake_timeout_s``, is closed without an ack and counted in ``refused``; the secret is never
logged. ``Sender.connect`` returns only after the ack, so by the time an actor tells the pool that it streams, the
receiver knows its stream: ``take`` on a (worker, key) it does not know is an error at once, not a wait. An actor
that cannot connect (a firewall, a refused handshake) gets an ``OSError`` and the caller falls back to the object
store. A frame whose MAC or size does not check ends its link (``StreamBroken``: the pool replaces the actor).

No half batch is ever visible. A frame is recorded (and ``take`` can return it) only once all its bytes are in the
slot; a connection that breaks, or sends garbage, inside a frame gives its slot back with ``writer.abandon``, and its
(worker, key) is marked ended, so that ``take`` raises ``StreamBroken`` for every frame that had not arrived (frames
that had stay takeable until taken, discarded or closed). A second connection for a (worker, key) already seen, or
discarded, is refused: a replaced actor that is still alive cannot write into the ring after its replacement.

Threads and descriptors. One daemon thread accepts; each connection gets its own thread, which does the handshake and
then reads frames. No lock is held across a blocking send or receive: ``send`` queues a task for the link's own
writer thread (started by its first task), so a peer that stops reading (frozen, partitioned, a task larger than the
socket buffers) stalls its own link only. A watchdog thread ends a link whose writer has handed the kernel nothing
for ``send_timeout_s`` (the loader's ``timeout``, else ``SEND_TIMEOUT_S``), naming its worker: the pool replaces
that actor as a lost one. ``discard`` and ``close`` end connections with ``shutdown`` (which wakes a blocked
``recv_into`` or send, and sends FIN even while a forked worker process holds a copy of the descriptor), then join
the threads within a bound. A socket is closed by the last of its reader and its writer to leave, and shutdowns and
closes happen under the receiver's lock, so nothing is ever written into, shut down or closed on a descriptor number
that was closed and reused meanwhile.

Admission. Strangers can connect, so a connection costs only its handshake until it proves the secret: pending ones
are capped per source address and in all (``MAX_HANDSHAKES_PER_SOURCE``, ``MAX_HANDSHAKES``), and a new one past a
cap drops the oldest pending one rather than being refused; each is dropped at its handshake deadline anyway. An
actor's handshake is a round trip, so silent peers cannot crowd it out, and ``Sender.connect`` tries again on the
rare refusal. Refusals are counted (``refused``) and logged at most ``REFUSALS_LOGGED`` lines per
``REFUSALS_LOG_S``.

The writer is a ``SlotWriter`` over the ring (``loop.py``), shared with the main thread's own copies (Ray objects,
``pool._into_ring``): its claims are atomic bit operations on the ring's free list and its mapping cache is a
dict keyed by the claimed slot, so concurrent claims from several threads never meet on one slot.
"""

from __future__ import annotations

import collections
import logging
import pickle
import queue
import secrets
import socket
import threading
import time

from . import wire
from .sockets import Tls, drop, fill, keepalive, pieces, read_by, send_all
from .wire import ANSWER_MAGIC, FRAME_MAGIC, MAX_FRAME_BYTES, TASK_MAGIC, WireError  # noqa: F401 (FRAME_MAGIC: the tests')

log = logging.getLogger("fastfeed")

TOKEN_BYTES = wire.SECRET_BYTES  # the receiver's secret ("token", as the pool and actors call it)
# Admission. Connections not yet past their handshake are held per source address, at most
# MAX_HANDSHAKES_PER_SOURCE each and MAX_HANDSHAKES in all; a new one past either cap drops the oldest pending one
# (of its source, else of all) rather than being refused. An actor's handshake takes a round trip, so peers that
# stay silent until their deadline cannot crowd it out, and a new connection is never turned away for them.
MAX_HANDSHAKES = 256
MAX_HANDSHAKES_PER_SOURCE = 32
# Handshake threads, dropped ones not yet ended included: past this the acceptor waits (peers queue in the backlog).
MAX_HELLO_THREADS = 2 * MAX_HANDSHAKES
# Refusals logged one line each, at most this many per REFUSALS_LOG_S; past that they are counted, and the next line
# says how many went unlogged (a flood of strangers is one line per interval, not one per connection).
REFUSALS_LOGGED = 10
REFUSALS_LOG_S = 60.0
# A link's peer that takes no byte of a task for this long is lost (frozen, partitioned, or not reading its link),
# when the loader sets no timeout of its own: the link ends and the pool replaces the actor.
SEND_TIMEOUT_S = 60.0
SEND_CHUNK = 1 << 20  # a task is handed to the kernel this much at a time: each piece taken is progress
JOIN_S = 5.0  # how long close() and discard() wait for the threads they end (a claim may be creating a segment)


class StreamBroken(ConnectionError):
    """The stream of one actor start ended (broke, closed, was discarded or never made) before a frame arrived."""

    def __init__(self, worker: int, key: int, message: str):
        super().__init__(message)
        self.worker = worker
        self.key = key


class _Stream:
    """One actor start's connection: the frames it delivered and not yet taken, and why it ended (None: live)."""

    __slots__ = ("worker", "key", "sock", "thread", "frames", "sizes", "answers", "ended", "wire", "outbox", "writer",
                 "sending")  # fmt: skip

    def __init__(self, worker: int, key: int, sock: socket.socket, thread: threading.Thread):
        self.worker = worker
        self.key = key
        self.sock = sock
        self.thread = thread
        self.frames: dict[int, tuple[int | None, str | None]] = {}
        self.sizes: dict[int, int] = {}  # task index -> its frame's nbytes, while the frame is in ``frames``
        self.answers: dict[int, object] = {}  # call number -> its answer (unpickled), until taken
        self.ended: str | None = None
        self.wire: wire.Channel | None = None  # the connection's keyed frames (sealed under the receiver's lock)
        # Tasks go out from a thread of the link's own (``writer``, started by the first ``send``), fed through
        # ``outbox`` (sealed frames; None: stop), so that no lock is held while a peer does not read.
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.writer: threading.Thread | None = None
        self.sending: float | None = None  # when the writer last handed the kernel a piece (None: it is idle)


class _Pending:
    """Connections not yet past their handshake, oldest first, per source address (admission's book)."""

    def __init__(self):
        self._source: dict[socket.socket, str] = {}  # insertion order: oldest first
        self._by_source: dict[str, dict[socket.socket, None]] = {}

    def add(self, sock: socket.socket, source: str) -> None:
        self._source[sock] = source
        self._by_source.setdefault(source, {})[sock] = None

    def discard(self, sock: socket.socket) -> None:
        source = self._source.pop(sock, None)
        if source is not None:
            mine = self._by_source[source]
            del mine[sock]
            if not mine:
                del self._by_source[source]

    def crowding(self, source: str) -> list[socket.socket]:
        """The oldest pending connections to drop so that one more from ``source`` stays within both caps."""
        out = []
        mine = list(self._by_source.get(source, ()))
        out += mine[: max(0, len(mine) - MAX_HANDSHAKES_PER_SOURCE + 1)]
        over = len(self._source) - len(out) - MAX_HANDSHAKES + 1
        if over > 0:
            dropping = set(out)
            out += [s for s in self._source if s not in dropping][:over]
        return out

    def __len__(self) -> int:
        return len(self._source)

    def __iter__(self):
        return iter(list(self._source))

    def __contains__(self, sock) -> bool:
        return sock in self._source


class Receiver:
    """The main process's end: a listening socket, and one reading thread per actor connection.

    Args:
        writer: claims ring memory for each frame and gives it back: a ``loop.SlotWriter``, or anything with its
            ``claim(nbytes) -> (slot_id, made, base)`` (``base``: a uint8 CPU tensor of at least nbytes) and
            ``abandon(slot_id, made)``.
        host: the address to listen on (one the actors' machines can reach); the port is chosen by the system.
        handshake_timeout_s: how long a new connection may take for its whole handshake (TLS's too).
        max_frame_bytes: the largest batch frame accepted: a link whose header announces more is ended before any
            memory is claimed for it. None: ``wire.frame_bound()`` (the shared-memory directory's capacity).
        on_news: called (from a receiving thread, with no lock held) when an answer arrives or a connection ends,
            so that a loop waiting in ``poll`` on other things too wakes (``pool._Wakeup.ring``).
        send_timeout_s: how long a link's peer may take no byte of a task before that link ends, as a lost actor's
            does (``SEND_TIMEOUT_S``; the pool sets the loader's ``timeout`` here). Settable later.
    """

    def __init__(self, writer, host: str, handshake_timeout_s: float = 10.0,
                 max_frame_bytes: int | None = None, on_news=None, send_timeout_s: float = SEND_TIMEOUT_S):
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.send_timeout_s = send_timeout_s
        self._on_news = on_news
        self.handshake_timeout_s = handshake_timeout_s
        self.max_frame_bytes = min(wire.frame_bound() if max_frame_bytes is None else max_frame_bytes,
                                   MAX_FRAME_BYTES)
        self._tls = wire.tls_context(server_side=True)  # None unless the Ray cluster uses TLS
        self.batches: collections.Counter = collections.Counter()  # frames received, per worker
        self.bytes: collections.Counter = collections.Counter()  # their payload bytes, per worker
        self.refused = 0  # connections closed before (or instead of) their ack
        self._writer = writer
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._streams: dict[tuple[int, int], _Stream] = {}
        self._gone: set[tuple[int, int]] = set()  # discarded starts: never let in again
        self._handshaking = _Pending()
        self._hellos = 0  # threads still in their handshake (dropped ones included)
        self._threads: set[threading.Thread] = set()
        # Sockets whose writer thread is still using them (its stream), and those of these whose reader has left:
        # whichever of the two leaves last closes the socket.
        self._writers: dict[socket.socket, _Stream] = {}
        self._readerless: set[socket.socket] = set()
        self._watchdog: threading.Thread | None = None  # ends links whose peer stopped taking tasks
        self._stopping = threading.Event()
        self._refusals_unlogged = 0
        self._refusal_lines: collections.deque = collections.deque()  # when the last few refusals were logged
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

    def on_own_thread(self) -> bool:
        """Whether the caller runs on one of this receiver's threads (its acceptor, a link's reader or writer, the
        watchdog). Read without the lock, which that very thread may hold: a garbage collection runs finalizers in
        whichever thread allocated, and one that stopped the loader from here would wait on itself."""
        me = threading.current_thread()
        return me is self._acceptor or me in self._threads or any(s.writer is me for s in list(self._writers.values()))

    @property
    def address(self) -> tuple[str, int]:
        return self._host, self._port

    @property
    def send_timeout_s(self) -> float:
        return self._send_timeout_s

    @send_timeout_s.setter
    def send_timeout_s(self, seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"send_timeout_s must be a number of seconds above 0, not {seconds!r}")
        self._send_timeout_s = float(seconds)

    def stats(self) -> dict:
        """Counters for ``DataLoader`` stats: batches and bytes per worker, and refused connections."""
        with self._lock:
            return {"batches": dict(self.batches), "bytes": dict(self.bytes), "refused": self.refused}

    # -- the main thread's side -----------------------------------------------------------------

    def take(self, worker: int, key: int, index: int, timeout: float | None,
             nbytes: int | None = None) -> tuple[int | None, str | None] | None:
        """The ``(slot_id, made)`` frame ``index`` of (worker, key) was written into, once it has all arrived.

        Waits up to ``timeout`` seconds (None: without limit); returns None when it has not arrived by then. The
        caller owns what it gets (``Ring.receive`` takes it as a worker's report).

        Args:
            nbytes: the batch's size as the actor's answer declares it (``Done.nbytes``). A frame of any other size
                is refused: a short one would leave a slot's stale bytes in the batch. Its slot is given back and
                the link ended.

        Raises:
            StreamBroken: that start's connection ended, or was discarded, or never made, before the frame arrived;
                or the frame is not ``nbytes`` long.
        """
        got = self._wait(worker, key, timeout, lambda stream: _pop_frame(stream, index),
                         lambda why: self._broken(worker, key, index, why))  # fmt: skip
        if got is None:
            return None
        slot_id, made, size = got
        if nbytes is None or size == nbytes:
            return slot_id, made
        self._writer.abandon(slot_id, made)
        why = f"batch {index} arrived as {size} bytes, but its answer says {nbytes}"
        with self._cond:
            stream = self._streams.get((worker, key))
            if stream is not None and stream.ended is None:
                stream.ended = why
                self._shutdown(stream.sock)
            self._cond.notify_all()
        log.warning("fastfeed: DataLoader worker %d (Ray actor start %d): %s; its link is ended", worker, key, why)
        raise StreamBroken(worker, key, self._broken(worker, key, index, why))

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

        Returns at once: the link's own writer thread sends it. Never raises for a link that is gone: it ends that
        link instead (so does a peer that takes none of it for ``send_timeout_s``), and ``answer`` then raises
        ``StreamBroken`` for this call, which is where the pool learns of a lost actor."""
        failed = None
        with self._cond:
            stream = self._streams.get((worker, key))
            if stream is None or stream.ended is not None:
                return
            # Sealed and queued under one lock: the actor checks the tasks' sequence numbers in the order they go,
            # and one writer sends them in the order queued.
            stream.outbox.put((number, stream.wire.seal_message(TASK_MAGIC, number, payload)))
            if stream.writer is None:
                failed = self._start_writer(stream)
        if failed is not None:
            self._news()

    def _start_writer(self, stream: _Stream) -> str | None:
        """Start ``stream``'s writer thread (and the receiver's watchdog, the first time); under the lock. Returns
        why the link ended instead, or None."""
        writer = threading.Thread(target=self._write, args=(stream,), name=f"fastfeed-link-w{stream.worker}",
                                  daemon=True)  # fmt: skip
        watchdog = None
        if self._watchdog is None:
            watchdog = threading.Thread(target=self._watch, name="fastfeed-link-watch", daemon=True)
        try:
            if watchdog is not None:
                watchdog.start()
                self._watchdog = watchdog
                self._threads.add(watchdog)
            writer.start()
        except RuntimeError as e:  # no thread to be had: this link cannot send, as if it were lost
            stream.ended = f"no thread to send its tasks ({e})"
            self._shutdown(stream.sock)
            self._cond.notify_all()
            return stream.ended
        stream.writer = writer
        self._writers[stream.sock] = stream
        self._threads.add(writer)
        return None

    def _write(self, stream: _Stream) -> None:
        """A link's writer thread: its tasks, in order, until it ends. The socket is closed by whichever of this
        thread and the link's reader leaves last (both under the lock), so neither ever writes into, shuts down or
        closes a descriptor number reused meanwhile."""
        sock = stream.sock
        with self._lock:
            pass  # _start_writer registers this thread under the lock: this finally must find it registered
        try:
            while True:
                item = stream.outbox.get()
                if item is None or stream.ended is not None:
                    return
                number, frame = item
                try:
                    stream.sending = time.monotonic()
                    for piece in pieces(frame, SEND_CHUNK):
                        send_all(sock, piece)
                        stream.sending = time.monotonic()  # progress: the watchdog's clock starts again
                except Exception as e:  # noqa: BLE001 - whatever it was, this link cannot send: it ends
                    self._fail(stream, f"sending it call {number} failed ({type(e).__name__}: {e})")
                    return
                finally:
                    stream.sending = None
        finally:
            with self._cond:
                self._writers.pop(sock, None)
                self._threads.discard(threading.current_thread())
                if sock in self._readerless:
                    self._readerless.discard(sock)
                    sock.close()

    def _fail(self, stream: _Stream, why: str) -> None:
        """End ``stream``'s link from this end (unless it ended already): shut its socket, which wakes its reader
        and its writer, and tell the waiting loop."""
        with self._cond:
            if stream.ended is None:
                stream.ended = why
            self._shutdown(stream.sock)  # under the lock, as every close of it is (see _shutdown)
            self._cond.notify_all()
        self._news()

    def _watch(self) -> None:
        """The watchdog: ends each link whose writer has handed the kernel nothing for ``send_timeout_s`` (its
        peer frozen, partitioned, or not reading), as a lost actor's link ends, naming its worker."""
        while not self._stopping.wait(min(1.0, self.send_timeout_s / 4)):
            now, limit, stuck = time.monotonic(), self.send_timeout_s, []
            with self._lock:
                for stream in self._writers.values():
                    since = stream.sending
                    if since is not None and stream.ended is None and now - since > limit:
                        stuck.append(stream)
            for stream in stuck:
                why = (f"its actor took no byte of a task for {limit:g} s (frozen, unreachable, or not reading its "
                       f"link)")  # fmt: skip
                log.warning("fastfeed: DataLoader worker %d (Ray actor start %d): %s; the actor is treated as lost",
                            stream.worker, stream.key, why)  # fmt: skip
                self._fail(stream, why)

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
            stream.outbox.put(None)  # its writer, if it has one, stops (the shutdown woke it if it was sending)
            self._cond.notify_all()
        for slot_id, made in untaken:
            self._writer.abandon(slot_id, made)
        deadline = time.monotonic() + JOIN_S
        for thread in (stream.thread, stream.writer):
            if thread is not None and thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

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
            for stream in {*streams, *self._writers.values()}:  # discarded ones' writers may be ending still
                stream.outbox.put(None)
            self._stopping.set()  # the watchdog
            for sock in self._handshaking:
                drop(sock)
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
        drop(sock)

    # -- the receiver's threads ----------------------------------------------------------------

    def _accept(self) -> None:
        try:
            while True:
                with self._cond:
                    # Dropped handshakes end at once (shut down), so this waits only while a flood outruns them;
                    # meanwhile new peers wait in the listen backlog, not refused.
                    while self._hellos >= MAX_HELLO_THREADS and not self._closed:
                        self._cond.wait(0.1)
                try:
                    conn, peer = self._listener.accept()
                except OSError:
                    if self._closed:
                        return
                    time.sleep(0.05)  # out of descriptors, say: the peer waits in the backlog meanwhile
                    continue
                if self._tls is not None:
                    try:  # the TLS handshake itself runs in the connection's thread, under its deadline
                        conn = Tls(self._tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False))
                    except OSError:
                        conn.close()
                        continue
                source = peer[0] if isinstance(peer, tuple) else str(peer)
                with self._lock:
                    if self._closed:
                        conn.close()
                        continue
                    # Never refuse the newcomer: drop the oldest pending ones instead (see MAX_HANDSHAKES). Each
                    # is only shut down here: its own thread, which reads it, counts the refusal and closes it.
                    for old in self._handshaking.crowding(source):
                        self._handshaking.discard(old)
                        drop(old)
                    thread = threading.Thread(target=self._serve, args=(conn, peer), name="fastfeed-stream-hello",
                                              daemon=True)  # fmt: skip
                    self._handshaking.add(conn, source)
                    self._threads.add(thread)
                    self._hellos += 1
                try:
                    thread.start()
                except BaseException as e:
                    with self._lock:
                        self._handshaking.discard(conn)
                        self._threads.discard(thread)
                        self._hellos -= 1
                        conn.close()
                    if not isinstance(e, RuntimeError):
                        raise
                    self._refuse(peer, f"no thread for its handshake ({e})")  # the process's thread limit
                    time.sleep(0.05)
        finally:
            with self._lock:
                self._listener.close()

    def _serve(self, sock: socket.socket, peer) -> None:
        """A connection's thread: its handshake, then its frames until it ends."""
        stream = None
        try:
            try:
                stream = self._handshake(sock, peer)
            finally:
                with self._cond:
                    self._handshaking.discard(sock)
                    self._hellos -= 1
                    if self._hellos == MAX_HELLO_THREADS - 1:
                        self._cond.notify_all()  # the acceptor may be waiting for room
            if stream is not None:
                self._pump(stream)
        except Exception as e:  # noqa: BLE001 - a thread's error has nowhere to go: it ends its stream instead
            log.warning("fastfeed: a batch stream from %s failed: %s: %s", peer, type(e).__name__, e)
            if stream is not None:
                self._end(stream, f"{type(e).__name__}: {e}")
        finally:
            with self._cond:
                self._threads.discard(threading.current_thread())
                writing = self._writers.get(sock)
                if writing is None:
                    sock.close()
                else:  # its writer still uses it: shut it (that wakes the writer), and the writer closes it
                    self._readerless.add(sock)
                    self._shutdown(sock)
                    writing.outbox.put(None)

    def _refuse(self, peer, why: str) -> None:
        with self._lock:
            self.refused += 1
            now, lines = time.monotonic(), self._refusal_lines
            while lines and now - lines[0] > REFUSALS_LOG_S:
                lines.popleft()
            if len(lines) >= REFUSALS_LOGGED:  # a flood: counted in ``refused``, and in the next line logged
                self._refusals_unlogged += 1
                return
            lines.append(now)
            unlogged, self._refusals_unlogged = self._refusals_unlogged, 0
            last = len(lines) == REFUSALS_LOGGED
        more = f"; {unlogged} more were refused before this one, unlogged" if unlogged else ""
        if last:
            more += f"; further refusals within {REFUSALS_LOG_S:g} s are only counted (stats()['refused'])"
        log.warning("fastfeed: refused a batch stream connection from %s: %s%s", peer, why, more)  # never the token

    def _handshake(self, sock: socket.socket, peer) -> _Stream | None:
        """The handshake (TLS's first, where Ray uses it): the actor's hello, this end's challenge, the actor's proof;
        then the stream is registered and acked. None (and counted) when refused: one deadline for all of it, so a
        peer trickling bytes gets no longer than a silent one, and no reply says which check failed."""
        deadline = time.monotonic() + self.handshake_timeout_s
        step = "its TLS handshake"
        try:
            if isinstance(sock, Tls):
                sock.settimeout(self.handshake_timeout_s)
                sock.do_handshake()
            step = "its hello"
            hello = read_by(sock, wire.HELLO.size, deadline)
            intro = wire.read_hello(hello)
            challenge = wire.challenge(self.token, hello, secrets.token_bytes(wire.NONCE_BYTES))
            step = "its proof"
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.sendall(challenge)
            transcript = wire.transcript(hello, challenge)
            wire.check_proof(self.token, transcript, read_by(sock, wire.PROOF_BYTES, deadline))
        except TimeoutError:
            self._refuse(peer, f"no complete handshake within {self.handshake_timeout_s} s (waiting for {step})")
            return None
        except EOFError:
            self._refuse(peer, f"it closed during {step}")
            return None
        except WireError as e:  # its text names the step, never a secret or a MAC
            self._refuse(peer, str(e))
            return None
        except OSError as e:  # ssl.SSLError included: a peer without TLS, or a certificate not of the cluster's CA
            self._refuse(peer, f"{type(e).__name__} during {step}: {e}")
            return None
        worker, key = intro.worker, intro.key
        key_bytes = wire.derive_key(self.token, transcript)
        stream = _Stream(worker, key, sock, threading.current_thread())
        stream.wire = wire.Channel(key_bytes, wire.TO_ACTOR, self.max_frame_bytes)
        with self._lock:
            if self._closed:
                return None
            # Only now, past the proof: a stranger cannot claim a (worker, key) ahead of the actor it names.
            if (worker, key) in self._streams or (worker, key) in self._gone:
                why = "its actor start already connected once, or was discarded"
                stream = None
            else:
                self._streams[worker, key] = stream
                self._handshaking.discard(sock)
        if stream is None:
            self._refuse(peer, f"worker {worker}, start {key}: {why}")
            return None
        threading.current_thread().name = f"fastfeed-stream-w{worker}"
        try:
            sock.settimeout(None)  # between frames a stream may idle for as long as the loop does
            keepalive(sock)
            sock.sendall(wire.ack(key_bytes))
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
        sock, writer, channel = stream.sock, self._writer, stream.wire
        header = bytearray(wire.SEALED_HEADER_BYTES)
        hview = memoryview(header)
        try:
            while True:
                try:
                    got = fill(sock, hview)
                except OSError as e:
                    self._end(stream, f"connection lost between batches ({type(e).__name__}: {e})")
                    return
                if got == 0:
                    self._end(stream, "the actor closed its connection")
                    return
                if got < len(header):
                    self._end(stream, f"connection cut inside a frame header ({got} of {len(header)} bytes)")
                    return
                try:
                    # Its MAC, then its kind and size: nothing is claimed or allocated for a header before both.
                    magic, index, nbytes, _ = opened = channel.open_header(header)
                except WireError as e:
                    self._end(stream, f"a frame refused: {e}")
                    return
                if magic == ANSWER_MAGIC:
                    if not self._take_answer(stream, opened):
                        return
                    continue
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
                        got = fill(sock, view)
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
                        stream.sizes[index] = nbytes
                        self.batches[stream.worker] += 1
                        self.bytes[stream.worker] += nbytes
                        self._cond.notify_all()
                if not live:  # discarded or closed while it arrived: nobody will take it
                    writer.abandon(slot_id, made)
                    return
        finally:
            hview.release()

    def _take_answer(self, stream: _Stream, header: wire.Header) -> bool:
        """Read the answer ``header`` (checked) announces, check its MAC and record it for ``answer``; False when
        the link ended instead."""
        number, nbytes = header.index, header.nbytes
        payload = bytearray(nbytes + wire.MAC_BYTES)  # bounded: open_header checked nbytes <= MAX_MESSAGE_BYTES
        view = memoryview(payload)
        try:
            got = fill(stream.sock, view)
        except OSError as e:
            self._end(stream, f"connection lost inside answer {number} ({type(e).__name__}: {e})")
            return False
        finally:
            view.release()
        if got < len(payload):
            self._end(stream, f"connection cut after {got} of answer {number}'s {len(payload)} bytes")
            return False
        try:
            stream.wire.check_message(header, memoryview(payload)[:nbytes], payload[nbytes:])
        except WireError as e:
            self._end(stream, f"answer {number} refused: {e}")
            return False
        # Authenticated: what this loader's own actor sent, under this connection's key (see wire.py).
        answer = pickle.loads(memoryview(payload)[:nbytes])
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


def _pop_frame(stream: _Stream, index: int) -> tuple[int | None, str | None, int] | None:
    frame = stream.frames.pop(index, None)
    return None if frame is None else (*frame, stream.sizes.pop(index))
