"""The Ray link's wire protocol as a trust boundary (fastfeed._workers.ray.wire), and the link's sockets under
strangers, replays, lies about sizes and TLS, without Ray."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import threading
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _link import ring, writer  # noqa: F401 (fixtures)
from fastfeed._workers.ray import link as rs
from fastfeed._workers.ray.sender import Sender
from fastfeed._workers.ray import wire

pytestmark = [pytest.mark.fastfeed_only, pytest.mark.hang_limit(60)]

HOST = "127.0.0.1"
MB = 1 << 20
SECRET = bytes(range(32))
FEW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        while True:
            if sock.recv(1 << 16) == b"":
                return True
    except ConnectionResetError:
        return True


def _pair() -> tuple[wire.Channel, wire.Channel, bytes]:
    """Both ends of one handshake, run over the pure functions: the loader's channel, the actor's, and K."""
    hello = wire.hello(3, 99, os.urandom(wire.NONCE_BYTES))
    challenge = wire.challenge(SECRET, hello, os.urandom(wire.NONCE_BYTES))
    actor_transcript = wire.check_challenge(SECRET, hello, challenge)
    proof = wire.proof(SECRET, actor_transcript)
    transcript = wire.transcript(hello, challenge)
    wire.check_proof(SECRET, transcript, proof)
    key = wire.derive_key(SECRET, transcript)
    assert key == wire.derive_key(SECRET, actor_transcript)
    wire.check_ack(key, wire.ack(key))
    return wire.Channel(key, wire.TO_ACTOR, max_frame_bytes=MB), wire.Channel(key, wire.TO_LOADER), key


def _open_message(channel: wire.Channel, frame: list):
    sealed, payload, tag = (bytes(part) for part in frame)
    header = channel.open_header(sealed)
    channel.check_message(header, payload, tag)
    return header, payload


class _PeakRSS:
    """The largest resident set the process reached while inside, sampled every few milliseconds (the growth a
    fresh 2**30-byte buffer, touched to zero, would show)."""

    def __enter__(self):
        self.base = self._rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def growth(self) -> int:
        return self.peak - self.base


# -- the pure functions -------------------------------------------------------------------------------------------


def test_a_handshake_gives_both_ends_one_key_and_frames_round_trip_in_order():
    """Both ends derive the same key; tasks, answers and batch headers sealed on one end open on the other, with
    their sequence numbers counting per direction."""
    loader, actor, _ = _pair()
    header, payload = _open_message(actor, loader.seal_message(wire.TASK_MAGIC, 5, b"task five"))
    assert (header.magic, header.index, header.nbytes, header.seq, payload) == (wire.TASK_MAGIC, 5, 9, 0, b"task five")
    batch = loader.open_header(actor.seal_batch(7, 4096))
    assert (batch.magic, batch.index, batch.nbytes, batch.seq) == (wire.FRAME_MAGIC, 7, 4096, 0)
    header, payload = _open_message(loader, actor.seal_message(wire.ANSWER_MAGIC, 5, b"answer"))
    assert (header.index, header.seq, payload) == (5, 1, b"answer")
    assert (loader.sent, loader.received, actor.sent, actor.received) == (1, 2, 2, 1)


def test_the_handshake_fails_on_either_side_without_the_secret():
    """A receiver without the secret cannot make a challenge the actor accepts, an actor without it cannot make a
    proof the receiver accepts, and a proof for another handshake (other nonces) is refused too."""
    other = bytes(32)
    hello = wire.hello(0, 1, os.urandom(wire.NONCE_BYTES))
    with pytest.raises(wire.WireError, match="challenge"):
        wire.check_challenge(SECRET, hello, wire.challenge(other, hello, os.urandom(wire.NONCE_BYTES)))
    challenge = wire.challenge(SECRET, hello, os.urandom(wire.NONCE_BYTES))
    transcript = wire.transcript(hello, challenge)
    with pytest.raises(wire.WireError, match="proof"):
        wire.check_proof(SECRET, transcript, wire.proof(other, transcript))
    fresh = wire.transcript(hello, wire.challenge(SECRET, hello, os.urandom(wire.NONCE_BYTES)))
    with pytest.raises(wire.WireError, match="proof"):
        wire.check_proof(SECRET, fresh, wire.proof(SECRET, transcript))  # a replayed proof: the nonce is new
    with pytest.raises(wire.WireError, match="protocol"):
        wire.read_hello(b"FFSTRM\x00\x02" + hello[8:])  # the previous version's magic
    with pytest.raises(ValueError, match="secret"):
        wire.proof(b"short", transcript)


def test_replayed_reordered_or_reflected_frames_fail_their_mac():
    """A frame opened a second time (a replay), out of its order, or sent back to the side that sealed it, fails."""
    loader, actor, _ = _pair()
    actor.seal_batch(0, 10)
    with pytest.raises(wire.WireError, match="MAC"):
        loader.open_header(actor.seal_batch(1, 10))  # ahead of its turn
    loader, actor, _ = _pair()
    sealed = actor.seal_batch(0, 10)
    loader.open_header(sealed)
    with pytest.raises(wire.WireError, match="MAC"):
        loader.open_header(sealed)  # the same frame again
    loader, actor, _ = _pair()
    with pytest.raises(wire.WireError, match="MAC"):
        actor.open_header(actor.seal_batch(0, 10))  # the actor's own frame, reflected back at it
    with pytest.raises(wire.WireError, match="MAC"):
        loader.open_header(bytes(loader.seal_message(wire.TASK_MAGIC, 0, b"x")[0]))  # the loader's own task


def test_sizes_are_bounded_before_anything_is_allocated():
    """An authentic header past its kind's bound, or of no bytes, is refused; an oversized message is not sealed at
    all and leaves the sequence where it was."""
    loader, actor, _ = _pair()
    with pytest.raises(wire.WireError, match="bound"):
        loader.open_header(actor._seal(wire.FRAME_MAGIC, 0, MB + 1)[0])  # past this loader's batch bound
    loader, actor, _ = _pair()
    with pytest.raises(wire.WireError, match="bound"):
        loader.open_header(actor._seal(wire.ANSWER_MAGIC, 0, 1 << 30)[0])  # a 1 GiB answer
    loader, actor, _ = _pair()
    with pytest.raises(wire.WireError, match="bound"):
        loader.open_header(actor._seal(wire.FRAME_MAGIC, 0, 0)[0])
    before = actor.sent
    with pytest.raises(wire.MessageTooLarge, match=str(wire.MAX_MESSAGE_BYTES)):
        actor.seal_message(wire.ANSWER_MAGIC, 0, bytes(wire.MAX_MESSAGE_BYTES + 1))
    assert actor.sent == before
    with pytest.raises(ValueError, match="sends no"):
        actor.seal_message(wire.TASK_MAGIC, 0, b"x")  # an actor sends no tasks


@FEW
@given(data=st.binary(max_size=200))
def test_random_bytes_are_never_a_message(data):
    """Random bytes, of any length, given to every reading function give a WireError (or, for a hello of the
    right size and magic, a hello), never another error, and allocate next to nothing."""
    loader, actor, key = _pair()
    tracemalloc.start()
    try:
        for check in (wire.read_hello, lambda b: wire.check_challenge(SECRET, bytes(52), b),
                      lambda b: wire.check_proof(SECRET, bytes(84), b), lambda b: wire.check_ack(key, b),
                      loader.open_header, actor.open_header):  # fmt: skip
            for candidate in (data, data[: wire.SEALED_HEADER_BYTES].ljust(wire.SEALED_HEADER_BYTES, b"\0")):
                try:
                    check(candidate)
                except wire.WireError:
                    pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MB


@FEW
@given(nbytes=st.integers(min_value=0, max_value=2**64 - 1), index=st.integers(min_value=-(2**63), max_value=2**63 - 1),
       flip=st.integers(min_value=0, max_value=wire.SEALED_HEADER_BYTES * 8 - 1))
def test_a_header_with_any_bit_flipped_is_refused_and_a_true_one_is_bounded(nbytes, index, flip):
    """A sealed header (any size announced, 2**64 - 1 included) with one bit flipped always fails its MAC; unflipped
    it opens only within the bound; neither allocates."""
    loader, actor, _ = _pair()
    sealed = bytearray(actor._seal(wire.FRAME_MAGIC, index, nbytes)[0])
    tracemalloc.start()
    try:
        flipped = bytearray(sealed)
        flipped[flip // 8] ^= 1 << (flip % 8)
        with pytest.raises(wire.WireError):
            loader.open_header(flipped)
        loader.received = 0  # as a fresh link would expect it
        if 0 < nbytes <= loader.max_frame_bytes:
            assert loader.open_header(sealed).nbytes == nbytes
        else:
            with pytest.raises(wire.WireError, match="bound"):
                loader.open_header(sealed)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MB


@FEW
@given(payload=st.binary(min_size=1, max_size=300), flip=st.integers(min_value=0), garbage=st.booleans())
def test_a_message_whose_payload_or_mac_changed_is_refused(payload, flip, garbage):
    """An answer whose payload or MAC lost one bit, or whose payload was swapped for garbage of the same length, is
    refused before anyone could unpickle it."""
    loader, actor, _ = _pair()
    sealed, body, tag = (bytearray(part) for part in actor.seal_message(wire.ANSWER_MAGIC, 1, payload))
    header = loader.open_header(sealed)
    if garbage:
        body = bytearray(os.urandom(len(body)))
        if body == bytearray(payload):
            return
    else:
        target = body + tag
        bit = flip % (len(target) * 8)
        target[bit // 8] ^= 1 << (bit % 8)
        body, tag = target[: len(body)], target[len(body):]
    with pytest.raises(wire.WireError, match="payload"):
        loader.check_message(header, body, tag)


def test_tls_context_needs_all_of_rays_files(monkeypatch):
    """With RAY_USE_TLS on, a missing certificate variable is named in the error; off (or 0), there is no context."""
    for name in wire.TLS_FILES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_USE_TLS", "0")
    assert wire.tls_context(server_side=True) is None
    monkeypatch.setenv("RAY_USE_TLS", "true")
    with pytest.raises(ValueError, match="RAY_TLS_SERVER_CERT, RAY_TLS_SERVER_KEY, RAY_TLS_CA_CERT"):
        wire.tls_context(server_side=False)


# -- at the sockets -----------------------------------------------------------------------------------------------


def _serves(receiver, writer, ring, worker: int, key: int) -> None:
    """A good sender still connects to ``receiver``, and its batch and answer arrive intact."""
    with Sender.connect(receiver.address, receiver.token, worker, key, timeout_s=5) as sender:
        data = np.arange(5000, dtype=np.uint8)
        sender.send(0, data)
        sender.answer(0, pickle.dumps(("ok", worker)))
        slot_id, made = receiver.take(worker, key, 0, timeout=5, nbytes=data.nbytes)
        lent = ring.lend(ring.receive(slot_id, made))
        assert np.array_equal(lent[: data.nbytes].numpy(), data)
        del lent
        assert receiver.answer(worker, key, 0, timeout=5) == ("ok", worker)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.binary(min_size=0, max_size=400))
def test_random_bytes_wrong_secrets_and_huge_headers_are_refused_and_the_receiver_serves_on(ring, writer, junk):
    """Random bytes, an actor with another secret, and a hello followed by a header announcing 2**39 bytes are each
    refused at the handshake: nothing is claimed, the process does not grow by 256 MB, and a good sender is served
    afterwards."""
    claimed = len(writer.claims)  # the fixture's writer serves every example
    with _PeakRSS() as rss, rs.Receiver(writer, HOST, handshake_timeout_s=2) as receiver:
        with socket.create_connection(receiver.address, timeout=5) as raw:
            raw.sendall(junk)
            raw.shutdown(socket.SHUT_WR)
            assert _closed_by_peer(raw)
        with pytest.raises(ConnectionRefusedError):
            Sender.connect(receiver.address, os.urandom(32), 1, 1, timeout_s=5, tries=1)
        with socket.create_connection(receiver.address, timeout=5) as raw:
            huge = wire.HEADER.pack(wire.FRAME_MAGIC, 0, 1 << 39) + bytes(wire.MAC_BYTES)
            raw.sendall(wire.hello(1, 1, os.urandom(32)) + bytes(wire.PROOF_BYTES) + huge)
            assert _closed_by_peer(raw)
        _until(lambda: receiver.refused == 3)
        assert len(writer.claims) == claimed
        _serves(receiver, writer, ring, 2, 5)
    assert rss.growth < 256 * MB


@pytest.mark.parametrize("kind", [wire.FRAME_MAGIC, wire.ANSWER_MAGIC])
def test_an_actors_header_past_the_bounds_ends_its_link_without_an_allocation(ring, writer, kind):
    """An authenticated actor announcing a 2**39-byte batch, or a 1 GiB answer, ends its own link (StreamBroken)
    with nothing claimed or allocated, and the receiver serves other actors on."""
    with _PeakRSS() as rss, rs.Receiver(writer, HOST) as receiver:
        sender = Sender.connect(receiver.address, receiver.token, 4, 1, timeout_s=5)
        sender._sock.sendall(sender._wire._seal(kind, 0, 1 << 39 if kind == wire.FRAME_MAGIC else 1 << 30)[0])
        with pytest.raises(rs.StreamBroken, match="worker 4 .*bound"):
            receiver.answer(4, 1, 0, timeout=5)
        assert writer.claims == []
        sender.close()
        _serves(receiver, writer, ring, 5, 1)
    assert rss.growth < 256 * MB


def test_a_batch_of_another_size_than_its_answer_declares_is_refused(ring, writer):
    """take() given the size the actor's answer declares refuses a frame of any other size (a short frame would
    expose a slot's stale bytes): the slot is given back, the link ended, and take() of the right size works."""
    with rs.Receiver(writer, HOST) as receiver:
        sender = Sender.connect(receiver.address, receiver.token, 6, 2, timeout_s=5)
        sender.send(0, np.ones(1000, dtype=np.uint8))
        sender.send(1, np.ones(999, dtype=np.uint8))
        _until(lambda: receiver.batches[6] == 2)
        got = receiver.take(6, 2, 0, timeout=5, nbytes=1000)
        assert got == writer.claims[0]
        writer.abandon(*got)  # taken: the caller's to give back
        with pytest.raises(rs.StreamBroken, match="batch 1 arrived as 999 bytes, but its answer says 1000"):
            receiver.take(6, 2, 1, timeout=5, nbytes=1000)
        assert writer.claims[1] in writer.abandoned
        _until(lambda: _closed_by_peer(sender._sock))
        sender.close()


@settings(max_examples=15, deadline=None)
@given(junk=st.binary(min_size=1, max_size=300))
def test_random_bytes_to_an_actors_task_reader_end_its_link(junk):
    """Random bytes where the actor waits for a task give None (the link ended, closed on the actor's side), never an
    unpickling, an exception or a large allocation."""
    loader_end, actor_end = socket.socketpair()
    _, actor, _ = _pair()
    sender = Sender(actor_end, actor)
    tracemalloc.start()
    try:
        loader_end.sendall(junk)
        loader_end.shutdown(socket.SHUT_WR)
        assert sender.task() is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        sender.close()
        loader_end.close()
    assert peak < MB


def test_an_actor_answers_an_oversized_state_with_an_error_not_a_broken_link():
    """An answer past the link's bound is not sent; the call gets a RuntimeError naming the bound instead, and the
    link goes on."""
    from fastfeed._workers import messages as m
    from fastfeed._workers.ray.actor import _answer

    loader_end, actor_end = socket.socketpair()
    loader, actor, _ = _pair()
    sender = Sender(actor_end, actor)
    try:
        _answer(sender, 3, bytes(wire.MAX_MESSAGE_BYTES + 10))
        header = loader.open_header(loader_end.recv(wire.SEALED_HEADER_BYTES, socket.MSG_WAITALL))
        body = loader_end.recv(header.nbytes + wire.MAC_BYTES, socket.MSG_WAITALL)
        loader.check_message(header, body[: header.nbytes], body[header.nbytes:])
        error = m.loads(body[: header.nbytes])
        assert header.index == 3 and isinstance(error, RuntimeError) and "does not fit" in str(error)
    finally:
        sender.close()
        loader_end.close()


# -- a capture of a real exchange ---------------------------------------------------------------------------------


class _Proxy:
    """A forwarding proxy on 127.0.0.1 for one connection, recording every byte each way; ``inject`` writes bytes
    of its own to the receiver, inside the live connection."""

    def __init__(self, upstream):
        self._listener = socket.create_server((HOST, 0))
        self.address = self._listener.getsockname()
        self._upstream_address = upstream
        self.up, self.down = bytearray(), bytearray()  # actor -> receiver, receiver -> actor
        self._threads = [threading.Thread(target=self._run, daemon=True)]
        self._threads[0].start()

    def _run(self):
        self.client, _ = self._listener.accept()
        self.server = socket.create_connection(self._upstream_address)
        pumps = [threading.Thread(target=self._pump, args=(a, b, rec), daemon=True)
                 for a, b, rec in ((self.client, self.server, self.up), (self.server, self.client, self.down))]
        self._threads += pumps
        for t in pumps:
            t.start()

    @staticmethod
    def _pump(src, dst, record):
        try:
            while data := src.recv(1 << 16):
                record += data
                dst.sendall(data)
        except OSError:
            pass
        for sock in (dst, src):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def inject(self, data: bytes):
        self.server.sendall(data)

    def close(self):
        self._listener.close()
        self._threads[0].join(5)
        for sock in (getattr(self, "client", None), getattr(self, "server", None)):
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for t in self._threads[1:]:
            t.join(5)
        for sock in (getattr(self, "client", None), getattr(self, "server", None)):
            if sock is not None:
                sock.close()


def test_a_captured_exchange_holds_no_secret_and_replays_nothing(ring, writer, caplog):
    """Every byte of a handshake, a task, a batch and an answer, captured both ways, holds the secret nowhere;
    the captured actor bytes replayed on a fresh connection (to a receiver with the same secret) are refused, and the
    captured answer replayed inside the live link ends that link instead of being taken twice."""
    with rs.Receiver(writer, HOST) as receiver:
        proxy = _Proxy(receiver.address)
        try:
            sender = Sender.connect(proxy.address, receiver.token, 7, 11, timeout_s=5)
            receiver.send(7, 11, 0, pickle.dumps(("task", 0)))
            assert sender.task() == (0, ("task", 0))
            batch = np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8)
            sender.send(0, batch)
            answer = pickle.dumps({"answer": 0})
            sender.answer(0, answer)
            assert receiver.answer(7, 11, 0, timeout=5) == {"answer": 0}
            writer.abandon(*receiver.take(7, 11, 0, timeout=5, nbytes=batch.nbytes))
            captured = bytes(proxy.up) + bytes(proxy.down)
            for form in (receiver.token, receiver.token.hex().encode(), receiver.token[:16], receiver.token[16:]):
                assert form not in captured
            up = bytes(proxy.up)
            handshake = wire.HELLO.size + wire.PROOF_BYTES
            start = handshake + wire.SEALED_HEADER_BYTES + batch.nbytes
            answer_frame = up[start:]
            assert len(answer_frame) == wire.SEALED_HEADER_BYTES + len(answer) + wire.MAC_BYTES
            proxy.inject(answer_frame)  # answer 0 again, as frame 1 of the link: its sequence number is 0
            with pytest.raises(rs.StreamBroken, match="worker 7 .*MAC did not check"):
                receiver.answer(7, 11, 1, timeout=5)
            sender.close()
        finally:
            proxy.close()
        twin = rs.Receiver(writer, HOST)
        twin.token = receiver.token  # the same secret, and no start registered: only the nonce stops a replay
        try:
            with socket.create_connection(twin.address, timeout=5) as raw:
                raw.sendall(up[:handshake])
                assert _closed_by_peer(raw)
            _until(lambda: twin.refused == 1)
            with pytest.raises(rs.StreamBroken, match="never connected"):
                twin.take(7, 11, 0, timeout=0)
        finally:
            twin.close()
    assert "proof did not check" in caplog.text


# -- TLS ----------------------------------------------------------------------------------------------------------


def _certificates(directory) -> dict:
    """A CA and one certificate it signed (as Ray makes one per cluster), written as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    span = (now - datetime.timedelta(days=1), now + datetime.timedelta(days=1))

    def make(subject, issuer, key, signer, ca):
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(span[0]).not_valid_after(span[1])
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))  # fmt: skip
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fastfeed test CA")])
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fastfeed test node")])
    ca = make(ca_name, ca_name, ca_key, ca_key, True)
    cert = make(name, ca_name, key, ca_key, False)
    files = {"RAY_TLS_CA_CERT": directory / "ca.crt", "RAY_TLS_SERVER_CERT": directory / "server.crt",
             "RAY_TLS_SERVER_KEY": directory / "server.key"}  # fmt: skip
    files["RAY_TLS_CA_CERT"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["RAY_TLS_SERVER_CERT"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files["RAY_TLS_SERVER_KEY"].write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return {name: str(path) for name, path in files.items()}


def test_under_ray_tls_the_link_is_tls_and_a_plain_peer_is_refused(ring, writer, tmp_path, monkeypatch):
    """With RAY_USE_TLS and Ray's certificate files, a batch, a task and an answer cross the link intact over TLS;
    a sender without TLS is refused by that receiver, and a TLS sender cannot talk to a receiver without TLS."""
    for name, path in _certificates(tmp_path).items():
        monkeypatch.setenv(name, path)
    monkeypatch.setenv("RAY_USE_TLS", "1")
    with rs.Receiver(writer, HOST, handshake_timeout_s=3) as receiver:
        with Sender.connect(receiver.address, receiver.token, 1, 2, timeout_s=5) as sender:
            assert sender._sock.version() is not None  # a TLS session
            receiver.send(1, 2, 0, pickle.dumps("over TLS"))
            assert sender.task() == (0, "over TLS")
            data = np.random.default_rng(1).integers(0, 256, 2 * MB + 5, dtype=np.uint8)
            sender.send_pieces(0, [memoryview(data)[:MB], memoryview(data)[MB:]], data.nbytes)
            sender.answer(0, pickle.dumps("answered"))
            assert receiver.answer(1, 2, 0, timeout=5) == "answered"
            slot_id, made = receiver.take(1, 2, 0, timeout=5, nbytes=data.nbytes)
            lent = ring.lend(ring.receive(slot_id, made))
            assert np.array_equal(lent[: data.nbytes].numpy(), data)
            del lent
        monkeypatch.setenv("RAY_USE_TLS", "0")
        with pytest.raises(OSError):
            Sender.connect(receiver.address, receiver.token, 1, 3, timeout_s=3, tries=1)
        _until(lambda: receiver.refused == 1)
        assert receiver.stats()["batches"] == {1: 1}
    with rs.Receiver(writer, HOST, handshake_timeout_s=3) as plain:
        monkeypatch.setenv("RAY_USE_TLS", "1")
        with pytest.raises(OSError):
            Sender.connect(plain.address, plain.token, 1, 4, timeout_s=3, tries=1)
        _until(lambda: plain.refused == 1)


def test_under_tls_tasks_and_batches_cross_at_once_both_ways_intact(ring, writer, tmp_path, monkeypatch):
    """Over TLS, the loader's tasks go out while the actor's batches and answers come in, on both ends from two
    threads at once (which OpenSSL allows on one connection only one call at a time): every task, batch and answer
    arrives intact and in order."""
    for name, path in _certificates(tmp_path).items():
        monkeypatch.setenv(name, path)
    monkeypatch.setenv("RAY_USE_TLS", "1")
    tasks, batches = 300, 12
    data = np.random.default_rng(2).integers(0, 256, 256 * 1024, dtype=np.uint8)
    with rs.Receiver(writer, HOST, handshake_timeout_s=3) as receiver:
        with Sender.connect(receiver.address, receiver.token, 1, 2, timeout_s=5) as sender:
            got, errors = [], []

            def read_tasks():  # the actor's reader thread, as actor._read_link
                try:
                    for _ in range(tasks):
                        number, msg = sender.task()
                        got.append((number, msg))
                        sender.answer(number, pickle.dumps(msg * 2))
                except Exception as e:  # noqa: BLE001 - reported below, in the test's thread
                    errors.append(e)

            reader = threading.Thread(target=read_tasks)
            reader.start()
            for n in range(tasks):
                receiver.send(1, 2, n, pickle.dumps(n))
            for i in range(batches):  # the actor's loop thread streaming meanwhile
                sender.send(i, data)
            reader.join(30)
            assert not errors and got == [(n, n) for n in range(tasks)]
            assert [receiver.answer(1, 2, n, timeout=10) for n in range(tasks)] == [2 * n for n in range(tasks)]
            for i in range(batches):
                slot_id, made = receiver.take(1, 2, i, timeout=10, nbytes=data.nbytes)
                lent = ring.lend(ring.receive(slot_id, made))
                assert np.array_equal(lent[: data.nbytes].numpy(), data)
                del lent
