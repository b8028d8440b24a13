"""The Ray link's wire protocol, as pure functions over bytes: the trust boundary between the loader and its actors.

``link.py`` owns the sockets and threads; everything it reads from a peer passes through a function here before it
is believed, unpickled, or used as a size.

What the link protects, and when:

* **The secret never crosses the link.** The loader's ``Receiver`` holds a 32-byte secret that reaches the actors
  only through Ray (the ``start`` call's arguments). The handshake is a mutual challenge-response over fresh nonces:
  the actor says hello (protocol magic, worker, start key, its nonce); the receiver answers with its own nonce and
  ``HMAC(secret, "recv" | transcript)``; the actor checks that (so it talks to its loader, not to whoever answered
  the port) and answers ``HMAC(secret, "actor" | transcript)``; the receiver checks that with
  ``hmac.compare_digest`` and only then registers the (worker, key) and acks. Both sides derive the connection's key
  ``K = HMAC(secret, "key" | transcript)``. Whoever sees a handshake learns neither the secret nor K, and a
  replayed handshake fails on the receiver's fresh nonce. Any mismatch closes the connection without saying (on the
  wire) which check failed.
* **Control messages are authenticated before they are unpickled.** Every frame carries a sealed header: the
  20-byte header (magic, index, nbytes) and ``HMAC(K, direction | sequence number | header)``. Tasks (loader ->
  actor) and answers (actor -> loader) add ``HMAC(K, direction | sequence number | header | payload)`` after their
  payload, checked before ``pickle.loads``. Each direction numbers its frames from 0, so a frame replayed, dropped,
  reordered, or reflected back at its sender fails its MAC. A bad MAC ends the link (the pool replaces the actor).
* **Strangers can make no allocation and run no code.** A size is used only after its header's MAC checked and its
  bound: an answer or task is at most ``MAX_MESSAGE_BYTES``; a batch frame at most the receiver's bound (by default
  the capacity of the shared-memory directory: no batch this loader can hold is larger), and the pool then compares
  it with the batch size the actor's answer declares.
* **Batch payloads** are not MACed (that would cost a hash over every batch byte): their headers are, so only the
  actor holding K decides where they land and how long they are. Their integrity in transit is TCP's checksum, and
  under TLS, TLS's.
* **TLS**: when the Ray cluster runs with ``RAY_USE_TLS`` set (1 or true), the link is TLS too, with Ray's own files
  (``RAY_TLS_SERVER_CERT``, ``RAY_TLS_SERVER_KEY``, ``RAY_TLS_CA_CERT``): mutual, each side verifying the other's
  certificate against the CA, host names unchecked (Ray's certificates are per cluster, not per host). Then
  everything, batches included, is encrypted and integrity-protected; a peer without TLS is refused.

Every function that reads a peer's bytes raises ``WireError`` (a ``ValueError``) on anything but a well-formed,
authentic message, and allocates nothing whose size the peer chose.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import ssl
import struct
from typing import NamedTuple

from ... import config

VERSION = 3
MAGIC = b"FFLINK" + VERSION.to_bytes(2, "big")  # a hello's first bytes: protocol and version
SECRET_BYTES = 32
NONCE_BYTES = 32
MAC_BYTES = 32  # HMAC-SHA256, untruncated
HELLO = struct.Struct("<8sIQ32s")  # actor -> receiver: magic, worker, start key, the actor's nonce
CHALLENGE = struct.Struct("<32s32s")  # receiver -> actor: its nonce, HMAC(secret, "recv" | transcript)
PROOF_BYTES = MAC_BYTES  # actor -> receiver: HMAC(secret, "actor" | transcript)
ACK_BYTES = MAC_BYTES  # receiver -> actor, once registered: HMAC(K, "ack")
HEADER = struct.Struct("<4sqQ")  # every frame's: magic, index (a batch's task, or a call's number), nbytes
SEALED_HEADER_BYTES = HEADER.size + MAC_BYTES
FRAME_MAGIC = b"FFBT"  # a batch's bytes, actor -> loader, straight into a ring slot
ANSWER_MAGIC = b"FFAN"  # a pickled answer, actor -> loader
TASK_MAGIC = b"FFTK"  # a pickled call, loader -> actor
# A task or an answer (a reply and the worker's state after it: RNG states, a dataset's state_dict, a batch's
# non-tensor parts) is kilobytes; a state of tens of megabytes still fits. Past this a header is refused before
# anything is allocated for it, and a sender refuses to send it.
MAX_MESSAGE_BYTES = 64 << 20
# The ceiling of any receiver's batch bound, whatever the shared-memory directory claims.
MAX_FRAME_BYTES = 1 << 40

TO_ACTOR = b"loader->actor"
TO_LOADER = b"actor->loader"
_KINDS = {TO_LOADER: (FRAME_MAGIC, ANSWER_MAGIC), TO_ACTOR: (TASK_MAGIC,)}  # the frames each direction carries
_SEQ = struct.Struct("<Q")


class WireError(ValueError):
    """Bytes from a peer that are not a well-formed, authentic message of this protocol."""


class MessageTooLarge(ValueError):
    """A task or answer this side was asked to send is past ``MAX_MESSAGE_BYTES``."""


class Hello(NamedTuple):
    worker: int
    key: int
    nonce: bytes


class Header(NamedTuple):
    """A frame's header, once its MAC checked: what it is, its index, its payload's size, its sequence number."""

    magic: bytes
    index: int
    nbytes: int
    seq: int


def _mac(key: bytes, *parts) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(part)
    return h.digest()


def _exact(buf, size: int, what: str) -> bytes:
    if len(buf) != size:
        raise WireError(f"a {what} is {size} bytes, not {len(buf)}")
    return bytes(buf)


def _secret(secret: bytes) -> bytes:
    if not isinstance(secret, (bytes, bytearray)) or len(secret) != SECRET_BYTES:
        raise ValueError(f"the link's secret is {SECRET_BYTES} bytes")
    return bytes(secret)


# -- the handshake --------------------------------------------------------------------------------


def hello(worker: int, key: int, nonce: bytes) -> bytes:
    """The actor's hello: who it is (worker, start key) and its fresh nonce."""
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"a nonce is {NONCE_BYTES} bytes, not {len(nonce)}")
    return HELLO.pack(MAGIC, worker, key, nonce)


def read_hello(buf) -> Hello:
    """The receiver's reading of a hello.

    Raises:
        WireError: the wrong size, or not this protocol and version.
    """
    magic, worker, key, nonce = HELLO.unpack(_exact(buf, HELLO.size, "hello"))
    if not hmac.compare_digest(magic, MAGIC):
        raise WireError("not a fastfeed link hello (wrong protocol or version)")
    return Hello(worker, key, nonce)


def challenge(secret: bytes, hello_bytes: bytes, nonce: bytes) -> bytes:
    """The receiver's answer to ``hello_bytes``: its fresh ``nonce`` and its proof that it holds the secret."""
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"a nonce is {NONCE_BYTES} bytes, not {len(nonce)}")
    return CHALLENGE.pack(nonce, _mac(_secret(secret), b"recv", hello_bytes, nonce))


def check_challenge(secret: bytes, hello_bytes: bytes, buf) -> bytes:
    """The actor's check of the receiver's challenge; returns the handshake's transcript.

    Raises:
        WireError: the wrong size, or a receiver that does not hold the secret.
    """
    nonce, tag = CHALLENGE.unpack(_exact(buf, CHALLENGE.size, "challenge"))
    transcript = bytes(hello_bytes) + nonce
    if not hmac.compare_digest(tag, _mac(_secret(secret), b"recv", transcript)):
        raise WireError("the receiver's challenge did not check")
    return transcript


def transcript(hello_bytes: bytes, challenge_bytes: bytes) -> bytes:
    """The receiver's copy of the transcript: the hello and its own nonce."""
    return bytes(hello_bytes) + bytes(challenge_bytes[:NONCE_BYTES])


def proof(secret: bytes, transcript_bytes: bytes) -> bytes:
    """The actor's proof that it holds the secret, bound to this handshake's nonces."""
    return _mac(_secret(secret), b"actor", transcript_bytes)


def check_proof(secret: bytes, transcript_bytes: bytes, buf) -> None:
    """The receiver's check of the actor's proof.

    Raises:
        WireError: the wrong size, or an actor that does not hold the secret (or answers another handshake).
    """
    if not hmac.compare_digest(_exact(buf, PROOF_BYTES, "proof"), proof(secret, transcript_bytes)):
        raise WireError("the actor's proof did not check")


def derive_key(secret: bytes, transcript_bytes: bytes) -> bytes:
    """The connection's key K, which every frame's MACs use."""
    return _mac(_secret(secret), b"key", transcript_bytes)


def ack(key: bytes) -> bytes:
    """The receiver's ack: the actor start is registered, under key ``key``."""
    return _mac(key, b"ack")


def check_ack(key: bytes, buf) -> None:
    """
    Raises:
        WireError: not the ack of a receiver holding ``key``.
    """
    if not hmac.compare_digest(_exact(buf, ACK_BYTES, "ack"), ack(key)):
        raise WireError("the receiver's ack did not check")


# -- frames ---------------------------------------------------------------------------------------


class Channel:
    """One connection's frames, both ways, under its key: sealing what this side sends and opening what it reads.

    Each direction's sequence number counts its frames from 0. The sending side must seal frames in the order they
    go out (one lock around sealing and sending); the reading side opens them in the order they arrive.

    Args:
        key: the connection's key (``derive_key``).
        outgoing: the direction this side sends, ``TO_ACTOR`` (the loader's side) or ``TO_LOADER`` (an actor's).
        max_frame_bytes: the largest batch frame this side accepts (the loader's; an actor receives none).
    """

    def __init__(self, key: bytes, outgoing: bytes, max_frame_bytes: int = 0):
        if outgoing not in _KINDS:
            raise ValueError(f"a channel sends {TO_ACTOR!r} or {TO_LOADER!r}, not {outgoing!r}")
        self.outgoing = outgoing
        self.incoming = TO_LOADER if outgoing == TO_ACTOR else TO_ACTOR
        self.max_frame_bytes = min(int(max_frame_bytes), MAX_FRAME_BYTES)
        self._out = hmac.new(key, outgoing, hashlib.sha256)  # copied per frame: the key's pads are hashed once
        self._in = hmac.new(key, self.incoming, hashlib.sha256)
        self.sent = 0  # the next outgoing sequence number
        self.received = 0  # the next incoming one
        self._pending = None  # the MAC state of the last message header opened, which its payload continues

    # sending

    def seal_batch(self, index: int, nbytes: int) -> bytes:
        """A batch frame's sealed header (its payload follows unMACed)."""
        if nbytes <= 0:
            raise ValueError("an empty batch has no bytes to stream")
        return self._seal(FRAME_MAGIC, index, nbytes)[0]

    def seal_message(self, magic: bytes, number: int, payload) -> list:
        """A task's or answer's frame: its sealed header, ``payload`` itself, and the payload's MAC.

        Raises:
            MessageTooLarge: ``payload`` is past ``MAX_MESSAGE_BYTES``; nothing was sealed.
        """
        view = memoryview(payload).cast("B")
        if not 0 < view.nbytes <= MAX_MESSAGE_BYTES:
            raise MessageTooLarge(f"a link message is 1 to {MAX_MESSAGE_BYTES} bytes, not {view.nbytes} "
                                  "(a task's message or an answer's state this large does not go over the link)")
        sealed, h = self._seal(magic, number, view.nbytes)
        h.update(view)
        return [sealed, view, h.digest()]

    def _seal(self, magic: bytes, index: int, nbytes: int):
        if magic not in _KINDS[self.outgoing]:
            raise ValueError(f"{self.outgoing.decode()} sends no {magic!r} frames")
        header = HEADER.pack(magic, index, nbytes)
        h = self._out.copy()
        h.update(_SEQ.pack(self.sent))
        h.update(header)
        self.sent += 1
        # The payload's MAC continues the header's: it covers direction, sequence number, header and payload.
        return header + h.copy().digest(), h

    # reading

    def open_header(self, buf) -> Header:
        """Check a sealed header's MAC, then its magic and size against this side's bounds.

        Raises:
            WireError: the wrong size, a MAC that does not check (a stranger, a replay, a cut or reordered stream),
                or a kind or size this side does not accept. The link must end.
        """
        buf = _exact(buf, SEALED_HEADER_BYTES, "sealed frame header")
        header, tag = buf[: HEADER.size], buf[HEADER.size:]
        h = self._in.copy()
        h.update(_SEQ.pack(self.received))
        h.update(header)
        if not hmac.compare_digest(tag, h.copy().digest()):
            raise WireError(f"frame {self.received} from {self.incoming.decode()}: its header's MAC did not check")
        magic, index, nbytes = HEADER.unpack(header)
        if magic not in _KINDS[self.incoming]:
            raise WireError(f"frame {self.received}: a {magic!r} frame does not travel {self.incoming.decode()}")
        bound = self.max_frame_bytes if magic == FRAME_MAGIC else MAX_MESSAGE_BYTES
        if not 0 < nbytes <= bound:
            raise WireError(f"frame {self.received}: {magic.decode(errors='replace')} of {nbytes} bytes, past "
                            f"this side's bound of 1 to {bound}")  # fmt: skip
        self._pending = h
        self.received += 1
        return Header(magic, index, nbytes, self.received - 1)

    def check_message(self, header: Header, payload, tag) -> None:
        """Check a task's or answer's payload MAC; ``header`` is what ``open_header`` just returned for it.

        Raises:
            WireError: the payload or its MAC was changed (or belongs to another frame).
        """
        h = self._pending
        if h is None or header.seq != self.received - 1 or header.magic == FRAME_MAGIC:
            raise WireError("a message's MAC checked against no message header")
        self._pending = None
        h.update(payload)
        if not hmac.compare_digest(bytes(tag), h.digest()):
            raise WireError(f"frame {header.seq} from {self.incoming.decode()}: its payload's MAC did not check")


# -- bounds and TLS -------------------------------------------------------------------------------


def frame_bound() -> int:
    """The default bound of a batch frame: the capacity of the directory ring segments live in (no batch this loader
    can hold is larger), at most ``MAX_FRAME_BYTES``."""
    try:
        st = os.statvfs(config.shm_dir())
        capacity = st.f_blocks * st.f_frsize
    except OSError:
        capacity = 0
    if capacity <= 0:  # no such directory here: physical memory bounds any batch as well
        capacity = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(capacity, MAX_FRAME_BYTES)


TLS_ENV = "RAY_USE_TLS"
TLS_FILES = ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")


def tls_enabled() -> bool:
    """Whether the Ray cluster runs with TLS (``RAY_USE_TLS`` 1 or true), and so the link must too."""
    return os.environ.get(TLS_ENV, "").strip().lower() in ("1", "true")


def tls_context(server_side: bool) -> ssl.SSLContext | None:
    """The link's TLS context from Ray's files, or None where Ray does not use TLS.

    Raises:
        ValueError: ``RAY_USE_TLS`` is on but one of Ray's files is not named.
        OSError: one of them cannot be read (``ssl.SSLError`` where it is not a certificate or key).
    """
    if not tls_enabled():
        return None
    missing = [name for name in TLS_FILES if not os.environ.get(name)]
    if missing:
        raise ValueError(f"{TLS_ENV} is on, but {', '.join(missing)} is not set: the Ray link cannot use TLS")
    cert, key, ca = (os.environ[name] for name in TLS_FILES)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False  # Ray's certificates are the cluster's, not a host's
    ctx.verify_mode = ssl.CERT_REQUIRED  # mutual: the receiver checks the actor's certificate too
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(cafile=ca)
    return ctx
