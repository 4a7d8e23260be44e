"""Wrappers around the ``torch.distributed`` calls that issue ops (docs/comm.md, "Recording").

Each wrapper notes the op (``otel_train.comm.notes``) and calls the original with the same arguments;
what the original returns or raises reaches the caller unchanged. A fault of ours (an argument we
cannot read) is reported once and counted, and the call runs unrecorded. The same wrapper replaces
the function in ``torch.distributed`` and in ``torch.distributed.distributed_c10d`` (whose own
helpers, ``all_gather_object`` and the like, and ``P2POp``'s checks use the module's names), and
:meth:`Patches.remove` puts the originals back where a wrapper of ours still sits.
"""

from __future__ import annotations

import functools
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

from otel_train import _report, api
from otel_train.record_clock import now_ns as time_ns  # the runtime's one clock (docs/clock.md)
from otel_train.comm.groups import GroupTable
from otel_train.comm.notes import Note, NoteQueue

ORIGINAL_ATTR = "__otel_train_original__"
_KEEP = object()
"""What a ``destroy_process_group`` that we could not read destroyed, for the group table: nothing known."""


@dataclass(frozen=True, slots=True)
class Spec:
    """How to read one call: its op, where its tensor(s), group, peer and async flag are."""

    op: str
    tensor: tuple[int, str] | None  # the input side: the same size on every member
    group: int  # positional index of ``group``
    async_op: int | None  # positional index of ``async_op``; None: always async (isend/irecv) or never
    peer: tuple[int, str, str] | None = None  # (index, global-rank keyword, group-rank keyword)
    always_async: bool = False


SPECS: dict[str, Spec] = {
    "all_reduce": Spec("all_reduce", (0, "tensor"), 2, 3),
    "all_gather": Spec("all_gather", (1, "tensor"), 2, 3),
    "all_gather_into_tensor": Spec("all_gather", (1, "input_tensor"), 2, 3),
    "reduce_scatter": Spec("reduce_scatter", (1, "input_list"), 3, 4),
    "reduce_scatter_tensor": Spec("reduce_scatter", (1, "input"), 3, 4),
    "broadcast": Spec("broadcast", (0, "tensor"), 2, 3),
    "reduce": Spec("reduce", (0, "tensor"), 3, 4),
    "all_to_all": Spec("all_to_all", (1, "input_tensor_list"), 2, 3),
    "all_to_all_single": Spec("all_to_all", (1, "input"), 4, 5),
    "all_gather_single": Spec("all_gather", (1, "input_tensor"), 2, 3),
    "reduce_scatter_single": Spec("reduce_scatter", (1, "input"), 3, 4),
    "all_reduce_coalesced": Spec("all_reduce", (0, "tensors"), 2, 3),
    "barrier": Spec("barrier", None, 0, 1),
    "gather": Spec("gather", (0, "tensor"), 3, 4),
    "scatter": Spec("scatter", (0, "tensor"), 3, 4),
    "send": Spec("send", (0, "tensor"), 2, None, (1, "dst", "group_dst")),
    "recv": Spec("recv", (0, "tensor"), 2, None, (1, "src", "group_src")),
    "isend": Spec("send", (0, "tensor"), 2, None, (1, "dst", "group_dst"), always_async=True),
    "irecv": Spec("recv", (0, "tensor"), 2, None, (1, "src", "group_src"), always_async=True),
}
"""Every wrapped function of ``torch.distributed`` (``batch_isend_irecv`` calls isend/irecv: see below)."""

_DTYPES: dict[Any, str] = {}
PENDING: dict[int, Note] = {}
"""id(Work) -> the note of an async op whose Work has no future (gloo send/recv); the note holds the Work,
so the id stays its own until the note ends (at ``wait()``, or when the recorder sees it completed)."""


def dtype_name(dtype: Any) -> str:
    """``float32`` for ``torch.float32`` (cached per dtype)."""
    name = _DTYPES.get(dtype)
    if name is None:
        text = str(dtype)
        name = _DTYPES[dtype] = text[6:] if text.startswith("torch.") else text
    return name


def _tensor_info(value: Any) -> tuple[int, str | None]:
    if isinstance(value, (list, tuple)):
        if not value:
            return 0, None
        return sum(t.numel() * t.element_size() for t in value), dtype_name(value[0].dtype)
    return value.numel() * value.element_size(), dtype_name(value.dtype)


class NoteMaker:
    """Builds the note of one call (``begin``) and stamps its end (``finish``/``fail``)."""

    def __init__(self, queue: NoteQueue, groups: GroupTable, herald: Callable[[Note], None] | None = None) -> None:
        from torch.distributed import distributed_c10d as c10d

        self._queue = queue
        self._groups = groups
        self._world = c10d._world
        self._work_type = c10d.Work
        self._batch = threading.local()  # ops noted inside batch_isend_irecv (coalesced: no Work of their own)
        self._futures = True  # cleared per op kind when a backend's Work has no future (gloo p2p)
        self._no_future: set[str] = set()
        self._herald = herald  # writes the op's start record now, before the backend has it (herald.py)
        self.active = True

    def forget(self, pg: Any) -> None:
        """A destroyed group (None: every group) leaves the table (:meth:`GroupTable.forget`)."""
        self._groups.forget(pg)

    def begin(self, spec: Spec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Note | None:
        if api._tracing is None or not self.active:
            return None
        try:
            return self._note(spec, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - never break the call over its record
            _report.report_exception(f"noting a torch.distributed {spec.op} call (it is not recorded)", exc)
            return None

    def _note(self, spec: Spec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Note | None:
        # The hot path of every op: a few attribute reads and one object (docs/comm.md, "Cost").
        n = len(args)
        pg = args[spec.group] if n > spec.group else kwargs.get("group")
        if pg is None:
            pg = self._world.default_pg
            if pg is None:
                return None  # not initialised: the original raises what it raises
        state = self._groups.get(pg) or self._groups.add(pg)
        nbytes, dtype = 0, None
        if spec.tensor is not None:
            index, name = spec.tensor
            value = args[index] if n > index else kwargs.get(name)
            if value is None:
                return None  # a call without its tensor: the original says what is wrong
            if isinstance(value, (list, tuple)):
                nbytes, dtype = _tensor_info(value)
            else:
                nbytes = value.numel() * value.element_size()
                dtype = _DTYPES.get(value.dtype) or dtype_name(value.dtype)
        if spec.peer is None:
            fr_key = state.pg._get_sequence_number_for_group() + 1
            note = Note(spec.op, state, fr_key - state.p2p if state.op_counts_p2p else fr_key, fr_key, None,
                        nbytes, dtype)
        else:
            index, key, group_key = spec.peer
            peer = args[index] if n > index else kwargs.get(key)
            if peer is None and kwargs.get(group_key) is not None:
                peer = state.ranks[kwargs[group_key]]
            seq, fr_key = state.next_p2p(-1 if peer is None else int(peer), spec.op == "send")
            note = Note(spec.op, state, seq, fr_key, peer, nbytes, dtype)
        if self._herald is not None:
            self._herald(note)  # before the queue: the recorder adopts its ids
        self._queue.append(note)
        return note

    def finish(self, note: Note, spec: Spec, result: Any, args: tuple[Any, ...]) -> None:
        try:
            if type(result) is int and spec.op == "recv" and note.peer is None:
                # A recv from any source: now the sender is known, count it under the sender.
                recvs = note.group.recvs
                recvs[-1] = max(0, recvs.get(-1, 1) - 1)
                note.seq = recvs[result] = recvs.get(result, 0) + 1
                note.peer = result
            if isinstance(result, self._work_type):
                self._when_done(note, spec, result)
            elif result is None and spec.always_async and getattr(self._batch, "notes", None) is not None:
                self._batch.notes.append(note)  # coalesced in batch_isend_irecv: its works end it
            else:
                note.done()
        except Exception as exc:  # noqa: BLE001
            note.done()
            _report.report_exception("timing a torch.distributed op", exc)

    def _when_done(self, note: Note, spec: Spec, work: Any) -> None:
        if spec.op not in self._no_future:
            try:
                work.get_future().add_done_callback(note.done)
                return
            except RuntimeError:  # "Work::getFuture not implemented" (gloo send/recv)
                self._no_future.add(spec.op)
        note.work = work  # ended by Work.wait() returning (see WaitPatch), else the recorder polls is_completed()
        PENDING[id(work)] = note

    def fail(self, note: Note, exc: BaseException) -> None:
        note.error = f"{type(exc).__name__}: {_report.safe_str(exc, 200)}"
        note.done()

    def batch(self, original: Callable[..., Any], p2p_op_list: Any) -> Any:
        """``batch_isend_irecv``: each op is its own span (its isend/irecv is noted); coalesced ops
        (NCCL) end when the batch's works complete."""
        outer = getattr(self._batch, "notes", None)
        self._batch.notes = []
        try:
            works = original(p2p_op_list)
        except BaseException as exc:
            for note in self._batch.notes:
                self.fail(note, exc)
            raise
        finally:
            pending, self._batch.notes = self._batch.notes, outer
        try:
            if pending:
                last = works[-1] if works else None
                for note in pending:
                    if last is None:
                        note.done()
                    else:
                        self._when_done(note, SPECS["isend"], last)
        except Exception as exc:  # noqa: BLE001
            _report.report_exception("timing a batch_isend_irecv", exc)
        return works


class _Inside(threading.local):
    """Whether this thread is inside a wrapped call: one that calls another wrapped function
    (``all_gather_into_tensor`` and ``all_gather_single``, say) issues one op, not two."""

    busy = False


_inside = _Inside()


def _wrap(name: str, original: Callable[..., Any], maker: NoteMaker) -> Callable[..., Any]:
    spec = SPECS[name]
    begin, finish, fail, inside = maker.begin, maker.finish, maker.fail, _inside
    blocking = not spec.always_async

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if inside.busy:
            return original(*args, **kwargs)
        note = begin(spec, args, kwargs)
        if note is None:
            return original(*args, **kwargs)
        inside.busy = True
        try:
            result = original(*args, **kwargs)
        except BaseException as exc:
            fail(note, exc)
            raise
        finally:
            inside.busy = False
        if result is None and blocking:
            note.end_ns = time_ns()  # the common case, inline: a blocking call returned
        else:
            finish(note, spec, result, args)
        return result

    functools.update_wrapper(wrapper, original)
    setattr(wrapper, ORIGINAL_ATTR, original)
    return wrapper


def _wrap_batch(original: Callable[..., Any], maker: NoteMaker, isend: Any, irecv: Any) -> Callable[..., Any]:
    originals = {getattr(isend, ORIGINAL_ATTR, None): isend, getattr(irecv, ORIGINAL_ATTR, None): irecv}

    def batch_isend_irecv(p2p_op_list: Any) -> Any:
        try:  # a P2POp made before we patched holds the original isend/irecv: give it ours
            for p2p in p2p_op_list:
                ours = originals.get(p2p.op)
                if ours is not None:
                    p2p.op = ours
        except Exception:  # noqa: BLE001 - a malformed list: the original says what is wrong
            pass
        return maker.batch(original, p2p_op_list)

    functools.update_wrapper(batch_isend_irecv, original)
    setattr(batch_isend_irecv, ORIGINAL_ATTR, original)
    return batch_isend_irecv


def _wrap_destroy(original: Callable[..., Any], patches: Patches) -> Callable[..., Any]:
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        gone = patches.destroying(args[0] if args else kwargs.get("group"))
        result = original(*args, **kwargs)
        patches.destroyed(gone)
        return result

    functools.update_wrapper(destroy_process_group, original)
    setattr(destroy_process_group, ORIGINAL_ATTR, original)
    return destroy_process_group


class WaitPatch:
    """``Work.wait``, wrapped: an op without a future ends for this rank when its wait returns (the host's
    view: the data arrived or the send left), not at the recorder's next look."""

    def __init__(self) -> None:
        self._installed: tuple[Any, Any, Any] | None = None

    def install(self) -> None:
        from torch.distributed import distributed_c10d as c10d

        work_type = c10d.Work
        original = work_type.__dict__.get("wait")
        if original is None or hasattr(original, ORIGINAL_ATTR):
            return
        pending = PENDING

        def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not pending:
                return original(self, *args, **kwargs)
            try:
                result = original(self, *args, **kwargs)
            except BaseException as exc:
                note = pending.pop(id(self), None)
                if note is not None:
                    note.error = f"{type(exc).__name__}: {_report.safe_str(exc, 200)}"
                    note.done()
                raise
            note = pending.pop(id(self), None)
            if note is not None:
                note.done()
            return result

        functools.update_wrapper(wait, original)
        setattr(wait, ORIGINAL_ATTR, original)
        work_type.wait = wait
        self._installed = (work_type, original, wait)

    def remove(self) -> None:
        if self._installed is not None:
            work_type, original, wait = self._installed
            if work_type.__dict__.get("wait") is wait:
                work_type.wait = original
            self._installed = None


class Patches:
    """The installed wrappers; ``remove()`` restores every original that a wrapper of ours still replaces.

    A wrapper may outlive ``remove()``: a module that took ``torch.distributed.broadcast`` while it was
    ours, a ``P2POp`` that holds our ``isend``. It then calls the original and nothing else, and it holds
    nothing of the session: ``remove()`` drops the recorder's flush, and the session empties the group
    table once the recorder has stopped (process groups, kept alive by it, would otherwise live until the
    interpreter exits). The table also forgets each group ``destroy_process_group`` destroys, as it
    destroys it.
    """

    def __init__(self, maker: NoteMaker, before_destroy: Callable[[], None] | None = None) -> None:
        self.maker = maker
        self.before_destroy = before_destroy  # the recorder's flush: groups and their buffer go with destroy
        self._wait = WaitPatch()
        self._installed: list[tuple[Any, str, Any, Any]] = []  # (module, name, original, wrapper)

    def install(self) -> list[str]:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        wrappers: dict[str, Any] = {}
        for name in SPECS:
            original = getattr(c10d, name, None)
            if original is None or hasattr(original, ORIGINAL_ATTR):
                continue
            wrappers[name] = _wrap(name, original, self.maker)
        batch = getattr(c10d, "batch_isend_irecv", None)
        if batch is not None and not hasattr(batch, ORIGINAL_ATTR) and "isend" in wrappers:
            wrappers["batch_isend_irecv"] = _wrap_batch(batch, self.maker, wrappers["isend"], wrappers["irecv"])
        destroy = getattr(c10d, "destroy_process_group", None)
        if destroy is not None and not hasattr(destroy, ORIGINAL_ATTR):
            wrappers["destroy_process_group"] = _wrap_destroy(destroy, self)
        for name, wrapper in wrappers.items():
            original = getattr(wrapper, ORIGINAL_ATTR)
            for module in (c10d, dist):
                if getattr(module, name, None) is original:
                    setattr(module, name, wrapper)
                    self._installed.append((module, name, original, wrapper))
        try:
            self._wait.install()
        except Exception as exc:  # noqa: BLE001 - a torch whose Work cannot take it: polling still ends them
            _report.report_exception("wrapping Work.wait (send/recv end at the recorder's next look)", exc)
        return sorted(wrappers)

    def destroying(self, group: Any) -> Any:
        """Before ``destroy_process_group(group)``: the recorder writes what it holds (the groups' buffer
        goes with them). Returns what it destroys: ``group``, or None for every group (None, WORLD)."""
        gone: Any = _KEEP
        try:
            from torch.distributed import distributed_c10d as c10d

            gone = None if group is None or group is c10d.GroupMember.WORLD else group
            if self.before_destroy is not None:
                self.before_destroy()
        except Exception as exc:  # noqa: BLE001
            _report.report_exception("recording the ops before destroy_process_group", exc)
        return gone

    def destroyed(self, gone: Any) -> None:
        """After ``destroy_process_group`` returned: the table forgets what it destroyed."""
        if gone is not _KEEP:
            self.maker.forget(gone)

    def remove(self) -> None:
        self.maker.active = False
        self.before_destroy = None
        self._wait.remove()
        for module, name, original, wrapper in reversed(self._installed):
            if getattr(module, name, None) is wrapper:
                setattr(module, name, original)
        self._installed = []


def c10d_loaded() -> bool:
    """Whether ``torch.distributed`` is imported (and usable) in this process."""
    return "torch.distributed.distributed_c10d" in sys.modules
