"""Batches streamed over TCP straight into ring slots (fastfeed._workers.ray_stream), without Ray.

The receiver writes through a real ring's ``SlotWriter``, built as ``_iterator.py`` builds the main process's, and
every frame taken is handed to ``Ring.receive`` as a worker's report would be; the writer records its claims and
abandons, so that each test can say which slot a frame landed in and whether it was given back.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time

import numpy as np
import pytest
import torch

from fastfeed._ring import layout, segments
from fastfeed._ring.ring import Ring
from _link import ring, writer  # noqa: F401 (fixtures)
from _load import Within
from fastfeed._workers.ray import link as rs
from fastfeed._workers.ray.sender import CONNECT_TRIES, Sender
from fastfeed._workers.ray import wire

pytestmark = [pytest.mark.fastfeed_only, pytest.mark.hang_limit(30)]

HOST = "127.0.0.1"
MB = 1 << 20


def _payload(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _until(predicate, timeout: float = 60.0) -> None:
    """Wait for ``predicate``, polling: ``timeout`` only bounds a test gone wrong (it returns as soon as the condition
    holds), so it leaves room for a machine busy with other work."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def _check_in_ring(ring: Ring, got, expected: np.ndarray) -> None:
    """Adopt a taken frame as a worker's report, compare its bytes, and let its slot go free."""
    slot_id, made = got
    lent = ring.lend(ring.receive(slot_id, made))
    assert np.array_equal(lent[: expected.nbytes].numpy(), expected)
    del lent  # the lease's last view: the slot goes back on the free list


def _fds() -> dict:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the descriptor listdir itself used
    return out


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed: EOF, or a reset when it closed with our bytes still unread."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _raw_hello(worker=0, key=0, magic=wire.MAGIC) -> bytes:
    return wire.HELLO.pack(magic, worker, key, os.urandom(wire.NONCE_BYTES))


def _sealed(sender, magic, index, nbytes) -> bytes:
    """A frame header sealed under ``sender``'s key, announcing ``nbytes`` of payload (none of which is sent)."""
    return sender._wire._seal(magic, index, nbytes)[0]


def test_frames_from_several_connections_land_in_slots_byte_for_byte(ring, writer):
    """Several actors stream multi-MB frames at once; each taken frame's slot holds exactly the bytes sent, first in
    segments the writer made, then in ring slots it claimed again; counters add up per worker."""
    workers = (0, 1, 2)
    sizes = {w: 3 * MB + 1001 * w + 7 for w in workers}  # odd sizes: no page-aligned end hides a short read
    later = {(w, i): 2 * MB + 13 * w + i for w in workers for i in (1, 2)}
    with rs.Receiver(writer, HOST) as receiver:
        senders = {w: Sender.connect(receiver.address, receiver.token, w, 100 + w, timeout_s=5) for w in workers}
        data = {(w, 0): _payload(sizes[w], w) for w in workers}
        data.update({wi: _payload(n, 10 * wi[0] + wi[1]) for wi, n in later.items()})

        def send(w, indices):
            for i in indices:
                senders[w].send(i, data[w, i])

        def send_round(indices):  # every actor at once, each on its own connection
            threads = [threading.Thread(target=send, args=(w, indices)) for w in workers]
            for t in threads:
                t.start()
            return threads

        for t in send_round([0]):
            t.join()
        # Every first frame is taken before any is adopted and freed: a frame still being read when another's slot
        # went free would claim that slot (on a loaded machine the reader can lag the senders by that much).
        taken = {w: receiver.take(w, 100 + w, 0, timeout=10) for w in workers}
        for w in workers:
            _check_in_ring(ring, taken[w], data[w, 0])
        first = list(writer.claims)
        assert all(made is not None for _, made in first)  # no slot yet: segments of the writer's making
        threads = send_round([1, 2])
        for w in workers:
            for i in (1, 2):
                _check_in_ring(ring, receiver.take(w, 100 + w, i, timeout=10), data[w, i])
        for t in threads:
            t.join()
        reused = [c for c in writer.claims[len(first):] if c[1] is None]
        assert reused and all(slot_id is not None for slot_id, _ in reused)  # written straight into ring slots
        assert writer.abandoned == []
        stats = receiver.stats()
        assert stats["batches"] == {w: 3 for w in workers}
        assert stats["bytes"] == {w: sizes[w] + later[w, 1] + later[w, 2] for w in workers}
        assert stats["refused"] == 0
        for sender in senders.values():
            sender.close()


def test_a_wrong_token_or_magic_is_refused_and_never_yields_a_frame(writer, caplog):
    """An actor with the wrong secret, a hello of another protocol, or a forged proof gets no ack and is closed,
    even with a frame behind it; nothing is claimed, the connection is counted, and the secret never reaches the
    log."""
    with rs.Receiver(writer, HOST) as receiver:
        wrong = bytes(b ^ 0xFF for b in receiver.token)
        with pytest.raises(ConnectionRefusedError):
            Sender.connect(receiver.address, wrong, 1, 7, timeout_s=5)
        frame = _payload(4096, 0).tobytes()
        with socket.create_connection(receiver.address, timeout=5) as raw:
            raw.sendall(_raw_hello(worker=1, key=7, magic=b"NOTFFSTR") + frame)
            assert _closed_by_peer(raw)  # closed without a challenge
        with socket.create_connection(receiver.address, timeout=5) as raw:
            raw.sendall(_raw_hello(worker=1, key=7))
            challenge = raw.recv(wire.CHALLENGE.size, socket.MSG_WAITALL)
            assert len(challenge) == wire.CHALLENGE.size
            raw.sendall(os.urandom(wire.PROOF_BYTES) + frame)  # a proof made without the secret
            assert _closed_by_peer(raw)  # closed without the ack
        _until(lambda: receiver.refused == CONNECT_TRIES + 2)  # Sender.connect tries again when refused
        with pytest.raises(rs.StreamBroken, match="worker 1 .*never connected"):
            receiver.take(1, 7, 0, timeout=0.2)
        assert writer.claims == []
        text = caplog.text
        assert "proof did not check" in text and "wrong protocol" in text
        assert receiver.token.hex() not in text and repr(receiver.token) not in text


def test_a_silent_connection_is_dropped_after_the_handshake_timeout_without_holding_up_others(writer):
    """A peer that says nothing (or half a hello) is closed once handshake_timeout_s has passed, and counted; an
    actor that connects meanwhile is acknowledged at once."""
    timeout = 1.0
    with rs.Receiver(writer, HOST, handshake_timeout_s=timeout) as receiver:
        silent = socket.create_connection(receiver.address, timeout=10)
        partial = socket.create_connection(receiver.address, timeout=10)
        partial.sendall(_raw_hello()[:20])
        t0 = time.monotonic()
        with Within(timeout, "an actor's handshake beside two silent peers"):  # not queued behind theirs
            sender = Sender.connect(receiver.address, receiver.token, 2, 0, timeout_s=5)
        with sender:
            sender.send(0, _payload(100, 1))
            assert receiver.take(2, 0, 0, timeout=5) is not None
        for sock in (silent, partial):
            assert _closed_by_peer(sock)  # the receiver closed it
            sock.close()
        assert time.monotonic() - t0 >= timeout * 0.9
        _until(lambda: receiver.refused == 2)


@pytest.mark.parametrize("into", ["ring slot", "made segment"])
def test_a_connection_cut_mid_frame_yields_no_frame_and_gives_its_memory_back(ring, writer, into):
    """A frame cut off after part of its bytes is never takeable: take() raises StreamBroken naming the worker, the
    slot (or the segment the writer made for it) is given back, and a frame that arrived before the cut stays."""
    size = 1 * MB + 3
    with rs.Receiver(writer, HOST) as receiver:
        sender = Sender.connect(receiver.address, receiver.token, 3, 9, timeout_s=5)
        if into == "ring slot":  # two slots in the ring, both free again once checked
            for i in (0, 1):
                sender.send(i, _payload(size, i))
            _until(lambda: receiver.batches[3] == 2)  # both claimed before either is freed: two made, two slots
            for i in (0, 1):
                _check_in_ring(ring, receiver.take(3, 9, i, timeout=5), _payload(size, i))
        kept = _payload(size - 10, 42)
        sender.send(2, kept)
        _until(lambda: receiver.batches[3] == (3 if into == "ring slot" else 1))
        raw = sender._sock
        raw.sendall(_sealed(sender, rs.FRAME_MAGIC, 3, size) + _payload(size // 2, 3).tobytes())
        sender.close()
        with pytest.raises(rs.StreamBroken, match="worker 3 .*cut after"):
            receiver.take(3, 9, 3, timeout=5)
        slot_id, made = writer.claims[-1]
        assert writer.abandoned == [(slot_id, made)]
        if into == "ring slot":
            assert made is None and slot_id == 1  # slot 0 went to the kept frame
            assert ring.control.is_free(slot_id)
        else:
            assert slot_id is None and made is not None
            assert not os.path.exists(segments._path(made))
        _check_in_ring(ring, receiver.take(3, 9, 2, timeout=0), kept)
        assert receiver.stats()["batches"] == {3: 3 if into == "ring slot" else 1}


@pytest.mark.parametrize("header", [
    lambda sender: _sealed(sender, b"JUNK", 0, 100),  # unsealable: _seal refuses a magic the actor never sends
    lambda sender: wire.HEADER.pack(rs.FRAME_MAGIC, 0, 100) + b"\0" * wire.MAC_BYTES,  # no valid MAC
    lambda sender: _sealed(sender, rs.FRAME_MAGIC, 0, 2**63),  # would otherwise ask the writer for 8 EiB
    lambda sender: _sealed(sender, rs.TASK_MAGIC, 0, 100),  # a task's kind, travelling the wrong way
], ids=["magic", "unsealed", "huge", "direction"])
def test_garbage_instead_of_a_frame_header_breaks_the_stream_without_claiming(writer, header):
    """A header with no valid MAC, a wrong kind or an impossible size ends the stream before any memory is
    claimed."""
    with rs.Receiver(writer, HOST, max_frame_bytes=64 * MB) as receiver:
        sender = Sender.connect(receiver.address, receiver.token, 4, 1, timeout_s=5)
        try:
            sealed = header(sender)
        except ValueError:  # the sending side refuses to seal it: forge it as a stranger would
            sealed = wire.HEADER.pack(b"JUNK", 0, 100) + os.urandom(wire.MAC_BYTES)
        sender._sock.sendall(sealed + b"\0" * 100)
        with pytest.raises(rs.StreamBroken, match="worker 4 .*frame refused"):
            receiver.take(4, 1, 0, timeout=5)
        sender.close()
        assert writer.claims == []


def test_a_batch_sent_twice_breaks_the_stream(writer):
    """The same task index twice on one stream is a confused sender: the second is not read, the first stays."""
    with rs.Receiver(writer, HOST) as receiver:
        sender = Sender.connect(receiver.address, receiver.token, 5, 1, timeout_s=5)
        sender.send(0, _payload(1000, 0))
        try:
            sender.send(0, _payload(1000, 1))
        except OSError:
            pass  # the receiver may already have closed on the header: its unread bytes make the reset
        with pytest.raises(rs.StreamBroken, match="sent twice"):
            receiver.take(5, 1, 1, timeout=5)
        assert len(writer.claims) == 1
        assert receiver.take(5, 1, 0, timeout=0) == writer.claims[0]
        writer.abandon(*writer.claims[0])  # taken: the caller's to give back
        sender.close()


def test_take_returns_none_on_timeout_and_the_frame_once_it_arrives(ring, writer):
    """take() waits up to its timeout and returns None; the frame sent afterwards is returned; an unknown stream
    raises at once rather than waiting."""
    with rs.Receiver(writer, HOST) as receiver:
        with Sender.connect(receiver.address, receiver.token, 6, 0, timeout_s=5) as sender:
            t0 = time.monotonic()
            assert receiver.take(6, 0, 0, timeout=0.2) is None
            assert time.monotonic() - t0 >= 0.2
            data = _payload(5000, 6)
            later = threading.Timer(0.1, sender.send, (0, data))
            later.start()
            got = receiver.take(6, 0, 0, timeout=5)  # woken by the frame, well before the timeout
            later.join()
            _check_in_ring(ring, got, data)
            with Within(1, "take() of a start that never connected"):
                with pytest.raises(rs.StreamBroken, match="worker 6 .*never connected"):
                    receiver.take(6, 1, 0, timeout=5)  # another start of the same worker


def test_a_second_connection_for_the_same_actor_start_is_refused(writer):
    """One connection per actor start: a second hello naming it is refused, and the first stream goes on."""
    with rs.Receiver(writer, HOST) as receiver:
        with Sender.connect(receiver.address, receiver.token, 7, 3, timeout_s=5) as first:
            with pytest.raises(OSError):
                Sender.connect(receiver.address, receiver.token, 7, 3, timeout_s=5)
            assert receiver.refused == CONNECT_TRIES  # Sender.connect tries again when refused
            first.send(0, _payload(10, 0))
            got = receiver.take(7, 3, 0, timeout=5)
            assert got is not None
            writer.abandon(*got)


def test_send_refuses_a_non_contiguous_buffer_without_breaking_the_stream(writer):
    """Only one contiguous buffer goes out without a copy: anything else is the caller's error, and the stream is
    still usable after it; a multi-dimensional array goes out as its bytes."""
    with rs.Receiver(writer, HOST) as receiver:
        with Sender.connect(receiver.address, receiver.token, 8, 0, timeout_s=5) as sender:
            with pytest.raises(ValueError, match="contiguous"):
                sender.send(0, np.zeros((64, 64), dtype=np.uint8)[:, ::2])
            grid = _payload(4096, 8).reshape(64, 64)
            sender.send(0, grid)
            got = receiver.take(8, 0, 0, timeout=5)
            assert got is not None and receiver.stats()["bytes"] == {8: 4096}
            writer.abandon(*got)


def test_discard_gives_back_untaken_slots_and_leaves_no_thread_or_fd(ring, writer):
    """discard() gives back what arrived and was not taken, ends the connection and its thread, and refuses the
    same start later; closing then leaves the threads and descriptors found before the receiver."""
    fds, threads = _fds(), set(threading.enumerate())
    receiver = rs.Receiver(writer, HOST)
    sender = Sender.connect(receiver.address, receiver.token, 9, 5, timeout_s=5)
    for i in (0, 1):
        sender.send(i, _payload(MB + i, i))
    _until(lambda: receiver.batches[9] == 2)
    _check_in_ring(ring, receiver.take(9, 5, 0, timeout=0), _payload(MB, 0))
    untaken = writer.claims[1]
    assert len(set(threading.enumerate()) - threads) == 2  # the acceptor and the stream's thread
    receiver.discard(9, 5)
    assert writer.abandoned == [untaken]
    assert len(set(threading.enumerate()) - threads) == 1  # the stream's thread ended with its connection
    sender._sock.settimeout(5)
    assert _closed_by_peer(sender._sock)  # the receiver closed its end
    with pytest.raises(rs.StreamBroken, match="worker 9 .*discarded"):
        receiver.take(9, 5, 1, timeout=5)
    with pytest.raises(OSError):  # the replaced actor cannot come back
        Sender.connect(receiver.address, receiver.token, 9, 5, timeout_s=5)
    receiver.discard(9, 5)  # again: nothing left to do
    sender.close()
    receiver.close()
    assert set(threading.enumerate()) == threads
    assert _fds() == fds


def test_close_ends_every_connection_gives_back_every_slot_and_is_idempotent(ring, writer):
    """close() with a frame untaken, a frame half received and a peer still in its handshake: every slot goes back,
    every thread ends promptly, every descriptor is closed; a second close() is harmless, and afterwards take()
    raises and connecting fails."""
    fds, threads = _fds(), set(threading.enumerate())
    receiver = rs.Receiver(writer, HOST, handshake_timeout_s=30)
    done = Sender.connect(receiver.address, receiver.token, 10, 0, timeout_s=5)
    done.send(0, _payload(MB, 0))
    half = Sender.connect(receiver.address, receiver.token, 11, 0, timeout_s=5)
    half._sock.sendall(_sealed(half, rs.FRAME_MAGIC, 0, 2 * MB) + _payload(MB, 1).tobytes())
    silent = socket.create_connection(receiver.address, timeout=5)
    _until(lambda: receiver.batches[10] == 1 and len(writer.claims) == 2)
    _until(lambda: len(set(threading.enumerate()) - threads) == 4)  # acceptor, two streams, one handshake
    receiver.close()
    assert sorted(writer.abandoned, key=repr) == sorted(writer.claims, key=repr)
    assert all(slot_id is None and not os.path.exists(segments._path(made)) for slot_id, made in writer.abandoned)
    # Woken by the shutdown, not by the handshake's 30 s timeout: its thread ended within close(), which waits at most
    # JOIN_S for the threads (told by the threads left, which other processes' load cannot change; a time taken can).
    assert rs.JOIN_S < 30 and set(threading.enumerate()) == threads
    receiver.close()
    with pytest.raises(rs.StreamBroken, match="worker 10 .*closed"):
        receiver.take(10, 0, 0, timeout=5)
    with pytest.raises(OSError):
        Sender.connect(receiver.address, receiver.token, 12, 0, timeout_s=2)
    assert _closed_by_peer(silent)
    silent.close()
    done.close()
    half.close()
    assert _fds() == fds


# -- the link: tasks out, answers back, on the same connection ------------------------------------------------------


def test_tasks_and_answers_travel_the_link_in_order_and_wake_the_loop(ring, writer):
    """The pool's calls reach the actor in the order sent; each answer (after its batch's frame, on the same
    connection) is taken by its call's number, out of order too, and each arrival calls ``on_news``; a number that
    never comes times out with None."""
    news = []
    with rs.Receiver(writer, HOST, on_news=lambda: news.append(1)) as receiver:
        sender = Sender.connect(receiver.address, receiver.token, 3, 7, timeout_s=5)
        for n in range(3):
            receiver.send(3, 7, n, pickle.dumps(("task", n)))
        assert [sender.task() for _ in range(3)] == [(n, ("task", n)) for n in range(3)]
        data = _payload(MB + 3, 3)
        sender.send(0, data)
        for n in (0, 1):
            sender.answer(n, pickle.dumps({"answer": n}))
        _until(lambda: receiver.ready(3, 7, 1))
        assert len(news) == 2 and not receiver.ready(3, 7, 2)
        assert receiver.answer(3, 7, 1, timeout=0) == {"answer": 1}
        assert receiver.answer(3, 7, 0, timeout=0) == {"answer": 0}
        _check_in_ring(ring, receiver.take(3, 7, 0, timeout=0), data)  # its bytes came first: no wait
        assert receiver.answer(3, 7, 2, timeout=0.05) is None
        sender.close()


def test_a_lost_actor_fails_the_calls_it_owes_and_answers_that_came_stay(writer):
    """The actor's end closes (its process died): answers already received are still taken; the next one raises
    StreamBroken naming the worker; ``wait_gone`` sees it gone, and a send to it is dropped without raising."""
    news = []
    with rs.Receiver(writer, HOST, on_news=lambda: news.append(1)) as receiver:
        sender = Sender.connect(receiver.address, receiver.token, 4, 1, timeout_s=5)
        other = Sender.connect(receiver.address, receiver.token, 5, 1, timeout_s=5)
        sender.answer(0, pickle.dumps("first"))
        _until(lambda: receiver.ready(4, 1, 0))
        assert receiver.wait_gone([(4, 1), (5, 1)], timeout=0.05) == [(4, 1), (5, 1)]
        sender.close()
        # The closed link is seen gone, the other one is not: looked at until the first is, not waited out for the
        # second (wait_gone waits for all of them).
        _until(lambda: receiver.wait_gone([(4, 1), (5, 1)], timeout=0.05) == [(5, 1)])
        assert receiver.answer(4, 1, 0, timeout=0) == "first"
        with pytest.raises(rs.StreamBroken, match="worker 4 .*before answer 1: the actor closed"):
            receiver.answer(4, 1, 1, timeout=5)
        receiver.send(4, 1, 1, pickle.dumps("nobody reads this"))
        assert len(news) == 2  # the answer, then the end
        other.close()


def test_an_answer_cut_short_ends_the_link_and_is_never_taken(writer):
    """An answer frame whose bytes stop half way (the actor died sending it) is not unpickled or recorded."""
    with rs.Receiver(writer, HOST) as receiver:
        sender = Sender.connect(receiver.address, receiver.token, 6, 0, timeout_s=5)
        payload = pickle.dumps(list(range(1000)))
        header, *_ = sender._wire.seal_message(rs.ANSWER_MAGIC, 0, payload)
        sender._sock.sendall(header + payload[:100])
        sender.close()
        with pytest.raises(rs.StreamBroken, match="cut after 100 of answer 0"):
            receiver.answer(6, 0, 0, timeout=5)


def _slot_bytes(batch) -> tuple[np.ndarray, list | None]:
    """What ``layout.fill`` lays down for ``batch`` (collated as a worker collates into a slot), and its pieces."""
    payload, objs, leaves, nbytes = layout.plan(batch)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    layout.fill(buf, objs, leaves)
    return buf.numpy(), layout.pieces(objs, leaves, nbytes)


def test_a_batch_sent_in_pieces_lands_as_fill_lays_it_out(ring, writer):
    """A gathering send of the samples' own memory (no copy in the actor) puts in the slot exactly the bytes
    ``fill`` would, padding included, for several leaves and dtypes; batches it cannot send that way say so."""
    g = torch.Generator().manual_seed(0)
    samples = [{"img": torch.randint(0, 255, (3, 96, 96), generator=g, dtype=torch.uint8),
                "emb": torch.randn(4099, generator=g, dtype=torch.float32).to(torch.bfloat16),
                "label": i} for i in range(5)]  # fmt: skip
    batch = layout.slot_collate(samples)
    expected, parts = _slot_bytes(batch)
    assert parts is not None and len(parts) > 5  # the images' own memory, one buffer each
    with rs.Receiver(writer, HOST) as receiver:
        sender = Sender.connect(receiver.address, receiver.token, 1, 0, timeout_s=5)
        sender.send_pieces(0, parts, expected.nbytes)
        _check_in_ring(ring, receiver.take(1, 0, 0, timeout=10), expected)
        with pytest.raises(ValueError, match="add up"):
            sender.send_pieces(1, parts[:-1], expected.nbytes)
        sender.close()
    # Samples not contiguous, or too small to be worth a buffer each: that leaf is filled into one buffer.
    for odd in ([torch.arange(64 * 256.0).view(64, 256).t() for _ in range(2)], [torch.arange(8.0)] * 4):
        expected, parts = _slot_bytes(layout.slot_collate(odd))
        assert len(parts) == 1 and np.array_equal(np.frombuffer(parts[0], np.uint8), expected)
    many = layout.slot_collate([torch.zeros(1 << 14, dtype=torch.uint8) for _ in range(layout.MAX_PIECES + 1)])
    assert _slot_bytes(many)[1] is None  # more buffers than one sendmsg should take: fill the whole batch


def test_closing_from_a_receiving_thread_neither_raises_nor_waits_on_itself(writer, caplog):
    """A loader dropped while a receiving thread runs the garbage collector is stopped from that thread: close()
    there joins the others, not itself, and every thread still ends."""
    threads = set(threading.enumerate())
    closed = []

    def news():  # runs in the link's own thread, as a collected loader's stop would
        if not closed:
            closed.append(threading.current_thread())
            receiver.close()

    receiver = rs.Receiver(writer, HOST, on_news=news)
    sender = Sender.connect(receiver.address, receiver.token, 2, 0, timeout_s=5)
    sender.answer(0, pickle.dumps("the answer whose arrival closes the receiver"))
    _until(lambda: closed)
    assert closed[0].name == "fastfeed-stream-w2"
    _until(lambda: set(threading.enumerate()) == threads)
    assert not [r for r in caplog.records if "failed" in r.getMessage()], caplog.text
    sender.close()


# -- a link that no peer can stall or lock out ----------------------------------------------------------------------


def _within(seconds: float, fn):
    """``fn()``'s result, called in a thread: a call that does not return within ``seconds`` fails the test rather
    than hanging it."""
    out: list = []

    def run():
        try:
            out.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - raised again in the test's thread
            out.append((False, e))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert out, f"{getattr(fn, '__name__', fn)} did not return within {seconds} s"
    ok, value = out[0]
    if not ok:
        raise value
    return value


def test_a_peer_that_stops_reading_stalls_only_its_own_link_which_ends_after_the_send_timeout(ring, writer):
    """An actor stops reading its link while a task larger than the socket buffers is sent to it: send returns at
    once, another actor's tasks, answers and batches still travel and stats() returns while the stuck link is still
    open; the stuck link then ends, naming its worker, once the send timeout has passed, and closing leaves no
    thread or descriptor behind."""
    limit = 2.0
    fds, threads = _fds(), set(threading.enumerate())
    receiver = rs.Receiver(writer, HOST, send_timeout_s=limit)
    stuck = Sender.connect(receiver.address, receiver.token, 1, 0, timeout_s=5)  # never reads its link
    good = Sender.connect(receiver.address, receiver.token, 2, 0, timeout_s=5)
    try:
        t0 = time.monotonic()
        _within(5, lambda: receiver.send(1, 0, 0, bytes(60 * MB)))  # far past both ends' socket buffers
        _within(5, lambda: receiver.send(2, 0, 0, pickle.dumps("task")))
        assert _within(5, good.task) == (0, "task")
        data = _payload(MB + 5, 2)
        good.send(0, data)
        good.answer(0, pickle.dumps("done"))
        assert _within(5, lambda: receiver.answer(2, 0, 0, timeout=5)) == "done"
        _check_in_ring(ring, _within(5, lambda: receiver.take(2, 0, 0, timeout=5)), data)
        assert _within(5, receiver.stats)["batches"] == {2: 1}
        assert not receiver.ready(1, 0, 0)  # none of that waited for the stuck link's timeout
        with pytest.raises(rs.StreamBroken, match="worker 1 .*took no byte of a task for 2 s"):
            _within(limit + 15, lambda: receiver.answer(1, 0, 0, timeout=limit + 10))
        assert time.monotonic() - t0 >= limit * 0.9
        receiver.send(2, 0, 1, pickle.dumps("after"))  # the other link goes on
        assert _within(5, good.task) == (1, "after")
    finally:
        stuck.close()  # unblocks a send that holds the receiver (the code before this test's change)
    good.close()
    _within(10, receiver.close)
    _until(lambda: set(threading.enumerate()) == threads)
    assert _fds() == fds


def test_a_send_timeout_that_is_not_a_positive_number_is_refused_naming_it(writer):
    """send_timeout_s of zero, a negative number or not a number is a ValueError that names it."""
    for bad in (0, -1.0, "60", True):
        with pytest.raises(ValueError, match="send_timeout_s must be a number of seconds above 0"):
            rs.Receiver(writer, HOST, send_timeout_s=bad)


def test_two_hundred_silent_connections_neither_lock_an_actor_out_nor_flood_the_log(ring, writer, caplog):
    """200 connections that never say a word are held open to the receiver: an actor with the secret still gets in
    at its first try, and its tasks and batches travel; the oldest silent ones were dropped to make room, counted in
    ``refused``, in a bounded number of log lines."""
    with rs.Receiver(writer, HOST, handshake_timeout_s=60) as receiver:
        silent = []
        try:
            for _ in range(200):
                silent.append(socket.create_connection(receiver.address, timeout=10))
            _until(lambda: receiver.refused >= 200 - rs.MAX_HANDSHAKES_PER_SOURCE)
            with Sender.connect(receiver.address, receiver.token, 3, 0, timeout_s=5, tries=1) as sender:
                receiver.send(3, 0, 0, pickle.dumps("task"))
                assert sender.task() == (0, "task")
                data = _payload(2 * MB + 1, 3)
                sender.send(0, data)
                _check_in_ring(ring, receiver.take(3, 0, 0, timeout=10), data)
            assert receiver.stats()["refused"] >= 200 - rs.MAX_HANDSHAKES_PER_SOURCE
        finally:
            for sock in silent:
                sock.close()
    lines = [r for r in caplog.records if "refused a batch stream connection" in r.getMessage()]
    assert 0 < len(lines) <= rs.REFUSALS_LOGGED
    assert "only counted" in lines[-1].getMessage()


def test_the_receiver_knows_its_own_threads_even_while_one_holds_its_lock(writer):
    """``on_own_thread`` is True on the receiver's threads (a link's reader, calling ``on_news`` as an answer
    arrives) and False elsewhere, and answers without taking the lock: a finalizer run by a collection inside a
    reader that holds it (the loader's stop) must learn where it runs without waiting on itself."""
    seen = []
    receiver = rs.Receiver(writer, HOST, on_news=lambda: seen.append(receiver.on_own_thread()))
    with receiver:
        assert not receiver.on_own_thread()
        sender = Sender.connect(receiver.address, receiver.token, 1, 0, timeout_s=5)
        with receiver._lock:  # as a reader inside its critical section: the answer does not need the lock
            assert not receiver.on_own_thread()
        sender.answer(0, pickle.dumps("done"))
        _until(lambda: seen)
        assert seen[0] is True
        sender.close()
