"""An actor's end of its Ray link (``link.py`` is the loader's end): the handshake that proves it holds the secret,
batches and answers sealed and sent in order, and the loader's tasks opened and checked before they are unpickled."""

from __future__ import annotations

import logging
import pickle
import secrets
import socket
import threading
import time

from . import wire
from .sockets import Tls, fill, keepalive, read_by, send_all
from .wire import ANSWER_MAGIC, WireError

log = logging.getLogger("fastfeed")

TOKEN_BYTES = wire.SECRET_BYTES  # the receiver's secret ("token", as the pool and actors call it)
CONNECT_TRIES = 3  # Sender.connect's attempts when the receiver refuses or drops it before its ack


class Sender:
    """An actor's end: one connection to the main process's ``Receiver``, frames sent in task order.

    A send that fails leaves the connection closed (the receiver gives back the slot of the frame it cut), so the
    caller sends that batch, and later ones, another way.
    """

    def __init__(self, sock: socket.socket, channel: wire.Channel):
        self._sock: socket.socket | None = sock
        self._wire = channel
        # Batches and answers are sealed and go out whole, one at a time, from any thread: the receiver checks
        # their sequence numbers in the order they arrive.
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, address: tuple[str, int], token: bytes, worker: int, key: int, timeout_s: float = 10.0,
                send_timeout_s: float | None = None, tries: int = CONNECT_TRIES) -> Sender:
        """``_connect_once``, tried again (``tries`` in all, briefly apart) while the receiver refuses or drops the
        connection before its ack: a receiver flooded with strangers drops its oldest pending handshakes to admit
        new ones (see ``link.MAX_HANDSHAKES``), so a second try gets in. A timeout is not tried again.

        Raises:
            OSError: as ``_connect_once``, on the last try.
        """
        if isinstance(tries, bool) or not isinstance(tries, int) or tries < 1:
            raise ValueError(f"tries must be a whole number of at least 1, not {tries!r}")
        for attempt in range(1, tries + 1):
            try:
                return cls._connect_once(address, token, worker, key, timeout_s, send_timeout_s)
            except ConnectionError:  # refused, reset, or closed on it: not a timeout
                if attempt == tries:
                    raise
                time.sleep(0.05 * 4 ** (attempt - 1))

    @classmethod
    def _connect_once(cls, address: tuple[str, int], token: bytes, worker: int, key: int, timeout_s: float = 10.0,
                      send_timeout_s: float | None = None) -> Sender:
        """Connect (over TLS where Ray uses it), do the handshake (the secret itself is never sent: see
        ``wire.py``), and wait for the receiver's ack.

        Args:
            token: the receiver's secret, as the pool gave it through Ray.
            timeout_s: for the connection and the whole handshake.
            send_timeout_s: for each send afterwards (None: a send waits as long as the receiver does not read).

        Raises:
            OSError: no connection, or the receiver refused it (another secret, a start it already knows, closed),
                or it did not prove that it holds the secret (``ConnectionRefusedError``, either way).
        """
        if len(token) != TOKEN_BYTES:
            raise ValueError(f"a stream token is {TOKEN_BYTES} bytes, not {len(token)}")
        tls = wire.tls_context(server_side=False)
        sock = socket.create_connection(address, timeout=timeout_s)
        try:
            deadline = time.monotonic() + timeout_s
            # The header and the payload's tail go out at once, not after the previous segment's (delayed) ack.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            keepalive(sock)
            if tls is not None:
                sock = Tls(tls.wrap_socket(sock))  # the TLS handshake, within timeout_s (the socket's timeout)
            hello = wire.hello(worker, key, secrets.token_bytes(wire.NONCE_BYTES))
            sock.sendall(hello)
            transcript = wire.check_challenge(token, hello, read_by(sock, wire.CHALLENGE.size, deadline))
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.sendall(wire.proof(token, transcript))
            key_bytes = wire.derive_key(token, transcript)
            wire.check_ack(key_bytes, read_by(sock, wire.ACK_BYTES, deadline))
            sock.settimeout(send_timeout_s)
        except (WireError, EOFError):
            sock.close()
            raise ConnectionRefusedError(f"the Ray link's receiver at {address} refused worker {worker}, start "
                                         f"{key}") from None  # fmt: skip
        except BaseException:
            sock.close()
            raise
        return cls(sock, wire.Channel(key_bytes, wire.TO_LOADER))

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
            self._frame(self._wire.seal_batch(index, payload.nbytes), payload)

    def send_pieces(self, index: int, pieces: list, nbytes: int) -> None:
        """Send batch ``index``'s ``nbytes``, which are ``pieces`` (byte memoryviews) one after another, gathered
        by the kernel from where they are (``sendmsg``), not copied into one buffer first.

        Raises:
            OSError: the connection failed, now or before; it is closed.
        """
        if not nbytes or sum(len(p) for p in pieces) != nbytes:
            raise ValueError(f"a streamed batch's pieces must add up to its {nbytes} bytes, and to more than none")
        with self._lock:
            self._frame(self._wire.seal_batch(index, nbytes), *pieces)

    def answer(self, number: int, payload: bytes) -> None:
        """Send the answer to call ``number`` (pickled by the caller).

        Raises:
            OSError: the connection failed, now or before; it is closed.
            wire.MessageTooLarge: ``payload`` is past ``wire.MAX_MESSAGE_BYTES``; nothing was sent.
        """
        with self._lock:
            header, *rest = self._wire.seal_message(ANSWER_MAGIC, number, payload)
            self._frame(header, *rest)

    def _frame(self, header: bytes, *payload) -> None:
        """Send one frame: ``header``, then the ``payload`` buffers one after another (the caller holds the lock)."""
        sock = self._sock
        if sock is None:
            raise BrokenPipeError("the batch stream is closed")
        try:
            send_all(sock, [memoryview(header), *payload])
        except BaseException:
            self.close()  # the frame may be cut: the receiver must see the connection end, not a next header
            raise

    def task(self) -> tuple[int, object] | None:
        """The next call the loader sent (its number and message), waiting for it; None once the link ended, or
        when what came is not an authentic task (the link is then closed, so the loader sees it end). Only one
        thread reads."""
        sock = self._sock
        header = bytearray(wire.SEALED_HEADER_BYTES)
        try:
            if sock is None or fill(sock, memoryview(header)) < len(header):
                return None
            opened = self._wire.open_header(header)  # before anything is allocated for it
            payload = bytearray(opened.nbytes + wire.MAC_BYTES)
            if fill(sock, memoryview(payload)) < len(payload):
                return None
            self._wire.check_message(opened, memoryview(payload)[: opened.nbytes], payload[opened.nbytes:])
        except OSError:
            return None
        except WireError as e:
            log.warning("fastfeed: the Ray link's task refused, the link closed: %s", e)
            self.close()
            return None
        # Authenticated under this connection's key: the loader that proved it holds the secret sent it.
        return opened.index, pickle.loads(memoryview(payload)[: opened.nbytes])

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
