"""The body of one Ray actor worker: the worker loop (``loop.serve``), fed the messages of the actor's calls.

The loop is the same code process workers run, so seeding, ``get_worker_info()``, ``worker_init_fn``, IterableDataset
exhaustion, persistent-worker resume and errors are the same. It runs in a thread of the actor. The actor is an
asyncio actor: a call hands its message to the loop at once and awaits the answer, so the tasks the main process sent
ahead of the running one wait in the loop's queue, where a dataset's read-ahead (``prefetch``, see ``readahead``)
sees them, as a worker process sees the tasks waiting in its pipe. Ray runs an asyncio actor's calls in no promised
order: each call carries its number in the epoch its ``start`` began, and the messages reach the loop in that order.
Where the actor reaches the loader's link (``_link_for``), the calls after ``start`` come over it instead, read by a
thread of the actor in the order sent, and their answers go back over it (``_Channel``'s ``number``); Ray's calls
carry them only where there is no link.

Where a batch goes depends on where the actor runs (its *path*, chosen at each ``start``, see ``_writer_for``):

- ``shm``: on the training process's node, the actor attaches the ring's control block and slot segments by name
  and writes the batch into a slot, as a worker process does; only the small ``Done`` goes back through Ray.
- ``stream``: on another node, the actor sends the batch's bytes, laid out as a slot, over one TCP connection to the
  loader's ``link.Receiver``, which reads them straight into a slot; the ``Done`` goes back through Ray.
- ``object store``: the batch is one flat byte buffer laid out as a slot (``layout.plan``/``fill``), returned through
  Ray's object store, and copied once into a slot by the main process. Where neither of the others can be set up
  (another container or user, a firewall), and for a batch whose stream broke as it was sent.

With each answer to a task goes the worker's state right after it (RNGs, a stateful dataset's position, batches
made), which is what a replacement actor starts from if this one is lost (``pool``). Nothing in this module
imports Ray: the actor class is made from it where Ray is used.
"""

from __future__ import annotations

import asyncio
import collections
import os
import queue
import socket
import threading
import time

import numpy as np
import torch
from torch.utils.data._utils import worker as torch_worker

from ..._dataset_hooks import hooks_of
from ..._ring import layout, segments
from ..._ring.control import Control
from .. import messages as m
from .. import readahead
from ..loop import SlotWriter, _seed, _seed_datapipe, serve
from .wire import MessageTooLarge


SHM, STREAM, STORE = "shm", "stream", "object store"  # the paths a batch takes to the ring (see the docstring)
PATHS = (SHM, STREAM, STORE)
PATH_ENV = "FASTFEED_RAY_PATH"  # auto (the default), or one of "shm", "stream", "store" to force it (tests, bench)


class BufferWriter:
    """``SlotWriter``'s face for an actor: the batch goes into a fresh flat buffer, returned through Ray's object
    store."""

    path = STORE

    def __init__(self):
        self.buffer = None  # the last batch's bytes, taken with the answer that reports them

    def write(self, task: m.Task, batch, worker_id: int, fetch_s=0.0, collate_s=0.0, since=0.0, timed=False) -> m.Done:
        payload, objs, leaves, nbytes = layout.plan(batch)
        if nbytes:
            self._put(task.idx, objs, leaves, nbytes)
        if timed:
            collate_s += time.perf_counter() - since
        # done_at stays 0: another machine's clock says nothing about the main process's timeline.
        return m.Done(task.idx, worker_id, nbytes, leaves, payload, None, None, fetch_s, collate_s, 0.0)

    def _put(self, idx: int, objs, leaves, nbytes: int) -> None:
        buf = self._memory(nbytes)
        layout.fill(torch.from_numpy(buf), objs, leaves)
        self._send(idx, buf)

    def _memory(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)

    def _send(self, idx: int, buf: np.ndarray) -> None:
        self.buffer = buf

    def take(self):
        buf, self.buffer = self.buffer, None
        return buf

    def close(self) -> None:
        self.buffer = None


class RingWriter(SlotWriter):
    """On the training process's node: the ring's own slots, written as a worker process writes them. The ``Done``
    names the slot (or a segment of the actor's making, which the ring adopts), so no bytes go through Ray."""

    path = SHM

    def take(self):
        return None

    def close(self) -> None:
        self.mapped.clear()  # the slots' mappings: the control block goes with the last reference


class StreamWriter(BufferWriter):
    """On another node: each batch is sent over the loader's stream laid out as a slot, gathered from the samples'
    own memory where it can be (``layout.pieces``), else from a buffer of the actor's, and the stream's receiver
    reads it into a slot. A send that fails ends the stream, and the receiver discards what it got of the batch, so
    no half batch is ever yielded. The stream is this actor's link too: the loader then counts the actor lost and
    a new one makes the batch again."""

    path = STREAM

    def __init__(self, sender):
        super().__init__()
        self.sender = sender
        self._scratch = np.empty(0, np.uint8)  # reused: a fresh buffer per batch would fault in its pages each time
        self.broken: str | None = None  # why the stream was given up (the loader replaces this actor)

    def _put(self, idx: int, objs, leaves, nbytes: int) -> None:
        if self.broken is not None:
            return  # the loader has lost this actor: it is replaced, and the batch made again
        parts = layout.pieces(objs, leaves, nbytes)
        if parts is None:
            super()._put(idx, objs, leaves, nbytes)  # laid out in the scratch buffer, then sent
            return
        try:
            # The samples' own memory, gathered by the kernel as it sends: no copy of the batch in this process.
            self.sender.send_pieces(idx, parts, nbytes)
        except OSError as e:
            self._broke(e)

    def _memory(self, nbytes: int) -> np.ndarray:
        if len(self._scratch) < nbytes:
            self._scratch = np.empty(nbytes + nbytes // 4, np.uint8)
        return self._scratch[:nbytes]

    def _send(self, idx: int, buf: np.ndarray) -> None:
        try:
            self.sender.send(idx, buf)  # returns once the bytes are the kernel's: the scratch is free again
        except OSError as e:
            self._broke(e)

    def _broke(self, error: OSError) -> None:
        self.broken = f"{type(error).__name__}: {error}"
        self.sender.close()  # the loader sees its link end

    def close(self) -> None:
        super().close()
        self.sender.close()


class RayWorker:
    """One worker, as a Ray actor (made with ``ray.remote`` in ``pool``). Reused across epochs: ``start``
    begins each one afresh, with that epoch's dataset, seed and ``worker_init_fn``."""

    def __init__(self):
        self._thread = None
        self._channel = None
        self._link = None  # this start's sender.Sender, when its calls come over the loader's link
        self._reader = None  # the thread that reads them
        self._epoch = None  # the key the main process gave the last start: its calls carry it
        self._next = 0  # the number of the call whose message goes to the loop next
        self._turns: dict = {}  # (epoch, number) -> the future a call that came before its turn awaits

    def where(self) -> dict:
        """Where this actor runs: for messages, and the tests' check of placement."""
        return {"host": socket.gethostname(), "pid": os.getpid(), "node_id": _node_id()}

    async def start(self, epoch, worker_id: int, spec, resume: dict | None, sync: dict | None = None,
                    link: dict | None = None) -> dict:  # fmt: skip
        """Begin serving as worker ``worker_id`` of ``spec`` (the epoch's ``WorkerSpec``, from the object store);
        ``epoch``: the key the calls of this epoch carry.

        ``resume``: where a replacement (or ``load_state_dict``) picks up, as for a worker process. ``sync``: a
        persistent worker's later epoch (its ``Resume``): the dataset's sync and shared seed, applied first.
        ``link``: how to reach the loader's ring (``_writer_for``); None: through the object store.
        Returns the worker's state at the epoch's start and, resumed mid-epoch, the state it resumed from (both
        ``StateReply``), where it runs, and the path its batches take (with why, where it fell back).
        """
        self._end_thread()
        writer, fallback = _writer_for(spec, link, worker_id, epoch)
        self._link = _link_for(writer, link, worker_id, epoch)
        torch.set_num_threads(1)  # as a worker process: the actor's cores are its workers' to share
        seed = _seed(spec.base_seed, worker_id)
        dataset = _seed_datapipe(spec.dataset, spec.shared_seed if sync is None else sync["shared_seed"])
        if sync is not None and sync.get("dataset_sync") is not None:
            hooks_of(dataset).worker_apply(sync["dataset_sync"])
        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=worker_id, num_workers=spec.num_workers, seed=seed, dataset=dataset
        )
        channel = self._channel = _Channel(asyncio.get_running_loop(), writer, self._link)
        where = f"in DataLoader worker {worker_id} (Ray actor, pid {os.getpid()} on {socket.gethostname()})"
        self._thread = threading.Thread(
            target=_serve, args=(worker_id, spec, dataset, channel, resume, where),
            name=f"ff_ray_worker_{worker_id}", daemon=True,
        )  # fmt: skip
        self._thread.start()
        # Before any call of this epoch is let in: the loop answers these first.
        restored = channel.send(m.StateRequest(m.RESTORED)) if resume is not None and resume["mid_epoch"] else None
        state = channel.send(m.StateRequest(None))
        self._epoch, self._next = epoch, 0
        self._let_in()
        if self._link is not None:
            # The pool sends this start's calls over the link once it has this answer, so they come after these.
            self._reader = threading.Thread(target=_read_link, args=(self._link, channel),
                                            name=f"ff_ray_link_{worker_id}", daemon=True)  # fmt: skip
            self._reader.start()
        state = to_wire((await state)[0])
        restored = None if restored is None else to_wire((await restored)[0])
        return {"state": state, "restored": restored, "where": self.where(), "path": writer.path,
                "fallback": fallback, "direct": self._link is not None}  # fmt: skip

    async def call(self, epoch, number: int, msg):
        """Hand ``msg``, call ``number`` of ``epoch``, to the loop once the calls numbered before it have. Returns
        ``(answer or None, state after it or None, batch bytes or None)``."""
        if (epoch, number) != (self._epoch, self._next):
            turn = self._turns[(epoch, number)] = asyncio.get_running_loop().create_future()
            await turn
        answer = self._channel.send(msg)
        self._next += 1
        self._let_in()
        return await answer

    def _let_in(self) -> None:
        """Wake the call whose turn it is, if it came early."""
        turn = self._turns.pop((self._epoch, self._next), None)
        if turn is not None and not turn.done():
            turn.set_result(None)

    def _end_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._channel.stop()
            self._thread.join(timeout=5.0)  # one stuck in the dataset is left (a daemon); its channel is dropped
        if self._channel is not None:
            self._channel.writer.close()  # the last start's stream connection: each start makes its own
        if self._link is not None:
            self._link.close()  # wakes the reader
            self._link = None
        if self._reader is not None:
            self._reader.join(timeout=5.0)
            self._reader = None
        self._thread = None


class _Call:
    """One call's message on its way through the loop, and what the call returns."""

    __slots__ = ("future", "number", "reply", "state", "buf", "asks_state", "done")

    def __init__(self, future, asks_state: bool, number: int | None = None):
        self.future = future  # the actor's event loop's, which a Ray call awaits; None for one over the link
        self.number = number  # the call's number on the link, where its answer goes back over it
        self.reply = self.state = self.buf = None
        self.asks_state = asks_state  # a StateRequest for the state right after it follows it
        self.done = False


class _Channel:
    """An epoch's messages to the loop, in the order of their calls, and its answers back to the calls that await
    them.

    The loop answers its messages in the order it takes them, and goes past some without an answer (a task after
    its iterable ended, which torch's worker skips too). The state after a task (or a ``Resume``) is asked right
    behind it, so the loop answers that before it runs the next task, and it goes back with the task's answer. The
    event loop's calls ``send``; only the loop's thread takes messages and answers (``get``, ``put``, ``crash``).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, writer=None, link=None):
        self.writer = BufferWriter() if writer is None else writer
        self.link = link  # the sender.Sender that the answers of the link's calls go back over
        self._loop = loop
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # (message, its _Call or None, is its state request)
        self._taken: collections.deque = collections.deque()  # inbox entries the loop took and has not answered
        self._lock = threading.Lock()  # a message sent as the loop dies fails with its error, never waits for ever
        self._error = None

    def send(self, msg, number: int | None = None) -> asyncio.Future | None:
        """Queue ``msg`` for the loop; the future's result is ``(answer, state after it, batch bytes)``. With
        ``number`` (a call that came over the link, from its reading thread), the answer goes back over the link
        instead, and there is no future."""
        ask = _state_request_after(msg)
        call = _Call(None if number is not None else self._loop.create_future(), ask is not None, number)
        with self._lock:
            if self._error is not None:
                self._resolve(call, None, self._error)
                return call.future
            self._inbox.put((msg, call, False))
            if ask is not None:
                self._inbox.put((ask, call, True))
        return call.future

    def stop(self) -> None:
        self._inbox.put((m.Stop(), None, False))

    def get(self, block: bool = True):
        """The loop's next message (``block=False``: ``readahead.NOTHING`` when none waits)."""
        if block:
            # The loop blocks only once it is done with every message it took: those not answered were gone past.
            while self._taken:
                self._finish(self._taken.popleft()[1])
        while True:
            try:
                entry = self._inbox.get() if block else self._inbox.get_nowait()
            except queue.Empty:
                return readahead.NOTHING
            msg, call, is_ask = entry
            if is_ask and call.done:
                # The loop went past its task, and holds no state after it. Only an iterable's loop goes past tasks,
                # and it takes one message at a time (read-ahead is for map-style datasets): it never took this ask
                # before its task was settled here.
                continue
            if call is not None:
                self._taken.append(entry)
            return msg

    def put(self, reply) -> None:
        while True:
            msg, call, is_ask = self._taken.popleft()
            if _answers(msg, reply):
                break
            self._finish(call)  # answered by nothing: a message the loop went past
        if is_ask:
            call.state = to_wire(reply)
            self._finish(call)
            return
        call.reply = reply
        if type(reply) is m.Done and reply.nbytes:
            call.buf = self.writer.take()
        if not call.asks_state:
            self._finish(call)

    def crash(self, error: BaseException) -> None:
        """The loop itself raised: every message sent, and any sent later, fails with ``error``."""
        with self._lock:
            self._error = error
            calls = [call for _, call, _ in self._taken]
            self._taken.clear()
            while True:
                try:
                    calls.append(self._inbox.get_nowait()[1])
                except queue.Empty:
                    break
        for call in calls:
            if call is not None and not call.done:
                call.done = True
                self._resolve(call, None, error)

    def _finish(self, call: _Call) -> None:
        if not call.done:
            call.done = True
            self._resolve(call, (call.reply, call.state, call.buf), None)

    def _resolve(self, call: _Call, result, error) -> None:
        if call.number is not None:
            _answer(self.link, call.number, result if error is None else error)
            return
        try:
            self._loop.call_soon_threadsafe(_settle, call.future, result, error)
        except RuntimeError:  # the event loop closed with the actor: no call awaits
            pass


def _answer(link, number: int, answer) -> None:
    """Send call ``number``'s answer (its result, or the exception the loop raised) over the link."""
    try:
        payload = m.dumps(answer)
    except Exception as e:  # noqa: BLE001 (an exception that does not pickle: its text still goes)
        payload = m.dumps(RuntimeError(f"{type(answer).__name__}: {answer} (its answer did not pickle: {e})"))
    try:
        try:
            link.answer(number, payload)
        except MessageTooLarge as e:  # nothing was sent: the call still gets an answer, the error
            link.answer(number, m.dumps(RuntimeError(f"{type(answer).__name__}: its answer does not fit the Ray "
                                                     f"link: {e}")))  # fmt: skip
    except OSError:
        pass  # the link is gone: the loader sees it end, and replaces this actor


def _read_link(link, channel: _Channel) -> None:
    """The actor's reader of its link: each call the loader sent, to the loop in the order sent; once the link
    ends (the loader stopped, or replaced this actor), a ``Stop``, so the loop does not serve on for nobody."""
    while True:
        got = link.task()
        if got is None:
            break
        number, msg = got
        channel.send(msg, number)
    channel.stop()


def _settle(future, result, error) -> None:
    if not future.done():
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


def _state_request_after(msg) -> m.StateRequest | None:
    """What asks the loop for its state right after ``msg``, where the answer to ``msg`` takes it along."""
    kind = type(msg)
    if kind is m.Task:
        return m.StateRequest(msg.idx)
    if kind is m.Resume:
        return m.StateRequest(None)
    return None


def _answers(msg, reply) -> bool:
    """Whether ``reply`` is the loop's answer to ``msg`` (the loop answers in order, going past some messages)."""
    kind = type(reply)
    if kind in (m.Done, m.Failed, m.IterEnd):
        return type(msg) is m.Task and msg.idx == reply.idx
    if kind is m.ResumeAck:
        return type(msg) is m.Resume
    return type(msg) is m.StateRequest


def to_wire(reply: m.StateReply | None) -> m.StateReply | None:
    """A state with its RNGs' tensors as numpy arrays: Ray pickles an array in microseconds and a tensor in a
    fraction of a millisecond, and a state goes with every batch but is read only for a replacement or a
    ``state_dict()`` (``from_wire``)."""
    if reply is None:
        return None
    return reply._replace(state=_rngs(reply.state, torch.Tensor.numpy), epoch_start=_rngs(reply.epoch_start,
                                                                                         torch.Tensor.numpy))


def owned(reply: m.StateReply | None) -> m.StateReply | None:
    """``to_wire``'s state with arrays of its own: what Ray hands back views the object the batch came in, and a
    kept state would keep that whole object (megabytes) in the object store."""
    if reply is None:
        return None
    return reply._replace(state=_rngs(reply.state, np.array), epoch_start=_rngs(reply.epoch_start, np.array))


def from_wire(reply: m.StateReply | None) -> m.StateReply | None:
    """``to_wire``'s state with its tensors back (copies: what Ray hands back may be read-only)."""
    if reply is None:
        return None
    return reply._replace(state=_rngs(reply.state, torch.tensor), epoch_start=_rngs(reply.epoch_start, torch.tensor))


def _rngs(state: dict | None, convert) -> dict | None:
    """``state`` (RNGs as ``_state.rngs_to_plain`` gives them, and more) with the torch state and the numpy keys
    converted."""
    if state is None:
        return None
    state = dict(state)
    state["torch"] = convert(state["torch"])
    if state.get("numpy") is not None:
        name, keys, *rest = state["numpy"]
        state["numpy"] = (name, convert(keys), *rest)
    return state


def _serve(worker_id, spec, dataset, channel: _Channel, resume, where) -> None:
    try:
        serve(worker_id, spec, dataset, channel.writer, channel.get, channel.put, resume, where=where)
    except BaseException as e:  # noqa: BLE001 (raised in the actor's calls, so the main process hears of it)
        channel.crash(e)


def _writer_for(spec, link: dict | None, worker_id: int, key: int):
    """The writer of this start's batches, and why it is not the path ``link`` asked for (None when it is).

    ``link``: ``{"node": the loader's Ray node id, "path": a path forced by PATH_ENV or None, "stream": (host,
    port) of the loader's ``link.Receiver`` or None, "token": its token}``. On the loader's node, the ring's
    own shared memory; elsewhere, the stream; the object store where that cannot be set up."""
    if link is None:
        return BufferWriter(), None
    want = link.get("path") or (SHM if _node_id() == link["node"] else STREAM)
    try:
        if want == SHM:
            # By name, 0600 and unguessable: only a process of the loader's user, seeing its /dev/shm, gets here.
            control = Control.attach(spec.control, spec.prefix)
            return RingWriter(control, lambda claimed: segments.attach(claimed.name)), None
        if want == STREAM and link.get("stream") is not None:
            from .sender import Sender

            sender = Sender.connect(tuple(link["stream"]), link["token"], worker_id, key, STREAM_CONNECT_S)
            return StreamWriter(sender), None
    except OSError as e:
        return BufferWriter(), f"{want} could not be set up ({type(e).__name__}: {e})"
    return BufferWriter(), None if want == STORE else f"{want}: the loader offered none"


def _link_for(writer, link: dict | None, worker_id: int, key: int):
    """The ``sender.Sender`` this start's calls and answers go over, or None (Ray's calls carry them). A
    streaming actor's is its stream; one beside the loop (shm) connects only for this."""
    if isinstance(writer, StreamWriter):
        return writer.sender
    if isinstance(writer, RingWriter) and link is not None and link.get("stream") is not None:
        from .sender import Sender

        try:
            return Sender.connect(tuple(link["stream"]), link["token"], worker_id, key, STREAM_CONNECT_S)
        except OSError:
            return None  # Ray's calls carry them: slower for the loop, but they work
    return None


STREAM_CONNECT_S = 10.0  # an actor that cannot reach the loader's stream in this long uses the object store


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 (only for messages)
        return None
