"""Process groups and collectives.

Every collective elixir issues goes through this module, so:
- the names that changed across torch versions (``all_gather_single`` vs ``all_gather_into_tensor``,
  ``reduce_scatter_single`` vs ``reduce_scatter_tensor``) are resolved once;
- a single-process run (no process group initialised) works with the same calls, as world size 1;
- tests can count collectives with :func:`count_collectives`;
- every asynchronous work handle it returns is tracked until finished, so :func:`drain` (and
  :func:`shutdown`, and an exit hook) can wait for work still in flight before teardown.

Why teardown needs care: a gloo worker thread that finishes a collective drops its reference to
the work, and the work's last reference may hold Python objects: the tensors involved, and the
thread-local state captured when the collective was issued. During ``loss.backward()`` that state
holds a Python object (torch stashes the caller's ``contextvars`` context in it for the autograd
engine), so every collective issued from a backward hook carries one. Dropping it takes the GIL.
If the interpreter has started finalizing while that thread waits for the GIL, CPython ends the
thread with ``pthread_exit``; the unwind crosses a ``noexcept`` destructor and the process aborts
("terminate called without an active exception"), after the script has finished and even after
``destroy_process_group`` (whose gloo threads can outlive it). So, in the library:

- every collective here is issued with that stashed object taken out of the thread-local state
  (:func:`_python_free_tls`): its work then holds no Python object but its tensors;
- an exit hook, registered with the first collective, waits for elixir's asynchronous work still
  in flight and then releases the GIL for a moment, so a gloo thread that is just letting go of a
  work does so before finalization;
- :func:`shutdown` (drain, barrier, destroy) ends a run with every gloo thread idle;
- collectives issued by torch's own engines during a backward (DTensor's, under tensor
  parallelism) do not go through here: :func:`python_free_backward`, called when such a backward
  starts, takes the stashed object out for the rest of it.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from elixir.device import default_device

ProcessGroup = Optional["dist.ProcessGroup"]


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: its rank, the world, the backend and its compute device."""

    rank: int
    world_size: int
    local_rank: int
    backend: Optional[str]
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def default_backend() -> str:
    """nccl when CUDA is available, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


#: How long a collective waits for a peer before the backend raises (``init_process_group``'s
#: ``timeout``): a rank that died mid-step turns into an error on the others within this bound.
#: gloo usually fails sooner, when the dead peer's socket closes. Override per call or with
#: the ``ELIXIR_PG_TIMEOUT_S`` environment variable.
DEFAULT_PG_TIMEOUT_S = 120.0
_pg_timeout_s: Optional[float] = None  # the timeout the process group was created with here


def pg_timeout_s(timeout_s: Optional[float] = None) -> float:
    """``timeout_s``, else ``$ELIXIR_PG_TIMEOUT_S``, else :data:`DEFAULT_PG_TIMEOUT_S`."""
    if timeout_s is not None:
        return float(timeout_s)
    env = os.environ.get("ELIXIR_PG_TIMEOUT_S")
    if env:
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"ELIXIR_PG_TIMEOUT_S={env!r} is not a number of seconds") from None
        if value <= 0:
            raise ValueError(f"ELIXIR_PG_TIMEOUT_S={env!r} must be positive")
        return value
    return DEFAULT_PG_TIMEOUT_S


def _restart_store(timeout: datetime.timedelta):
    """Under torchrun, after a restart (``TORCHELASTIC_RESTART_COUNT`` > 0) with the agent's store
    (``TORCHELASTIC_USE_AGENT_STORE``): that store, with this generation's keys under a prefix of
    their own; else None (``init_process_group`` makes its own). The agent keeps one store across
    restarts, so without the prefix a new generation could read the killed generation's gloo
    addresses (measured: a restarted rank failed in ``connectFullMesh`` with "Connection refused"
    to an address of the old generation, in about one restart out of two here)."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"elixir/restart-{restart}", client)


def init_distributed(backend: Optional[str] = None, timeout_s: Optional[float] = None) -> DistInfo:
    """Initialise from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or
    run as a single process when those are absent. Safe to call twice.

    ``timeout_s``: how long a collective waits for its peers before failing (see
    :func:`pg_timeout_s`; default :data:`DEFAULT_PG_TIMEOUT_S`, 2 minutes)."""
    global _pg_timeout_s
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if not dist.is_initialized() and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _pg_timeout_s = pg_timeout_s(timeout_s)
        timeout = datetime.timedelta(seconds=_pg_timeout_s)
        store = _restart_store(timeout)
        if store is None:
            dist.init_process_group(backend=backend or default_backend(), timeout=timeout)
        else:
            dist.init_process_group(backend=backend or default_backend(), timeout=timeout, store=store,
                                    rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        _register_exit_drain()
    if dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dist.get_backend(), default_device())
    return DistInfo(0, 1, 0, None, default_device())


def bind_device() -> Optional[torch.device]:
    """Make this rank's CUDA device the current one; return it (None without CUDA).

    :func:`init_distributed` does this, but a user who creates the process group himself may not
    have: every rank then runs NCCL's object collectives and ``barrier()`` on ``cuda:0``. The
    device is ``LOCAL_RANK``'s when the launcher set it; else, in an initialised process group
    whose current device is still ``cuda:0``, the rank modulo the ranks per node
    (``LOCAL_WORLD_SIZE``, else the devices visible); else the current device stays (a device the
    user chose). :class:`~elixir.wrapper.ElixirModule` calls it first thing."""
    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    current = torch.cuda.current_device()
    if "LOCAL_RANK" in os.environ:
        index = int(os.environ["LOCAL_RANK"]) % count
    elif is_initialized() and current == 0:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or count
        index = dist.get_rank() % per_node % count
    else:
        index = current
    if index != current:
        torch.cuda.set_device(index)
    return torch.device("cuda", index)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: ProcessGroup = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: ProcessGroup = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def barrier(group: ProcessGroup = None) -> None:
    if get_world_size(group) > 1:
        dist.barrier(group)


# ---------------------------------------------------------------------------------------------
# asynchronous work in flight, and teardown

_pending: list = []  # async work handles returned by this module and not yet known finished
EXIT_DRAIN_TIMEOUT_S = 10.0  # how long the exit hook waits for elixir's own work in flight


def _track(work):
    """Remember an async work handle (forgetting those already finished); return it."""
    if work is not None:
        _pending[:] = [w for w in _pending if not _completed(w)]
        _pending.append(work)
    return work


def _completed(work) -> bool:
    try:
        return bool(work.is_completed())
    except RuntimeError:  # a failed collective is finished too
        return True


def wait_work(work) -> None:
    """Wait for an async work handle returned by this module, and stop tracking it."""
    try:
        work.wait()
    except CollectiveFailed:
        raise
    except RuntimeError as e:
        raise _failed("waiting for an asynchronous collective", e) from e
    finally:
        for i, w in enumerate(_pending):
            if w is work:
                del _pending[i]
                break


def pending_works() -> int:
    """How many asynchronous collectives issued through this module may still be running."""
    _pending[:] = [w for w in _pending if not _completed(w)]
    return len(_pending)


def drain(timeout_s: Optional[float] = None) -> bool:
    """Wait for every asynchronous collective issued through this module.

    With ``timeout_s``, poll instead of blocking and give up after that many seconds (returns
    False if some work is still running). Errors of failed collectives are not raised here: the
    code that issued them sees them when it waits. Returns True when nothing is in flight.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while _pending:
        work = _pending[0]
        if deadline is None:
            with contextlib.suppress(RuntimeError):
                work.wait()
        elif not _completed(work):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)  # releases the GIL: a finishing gloo thread may need it
            continue
        _pending.pop(0)
    return True


def shutdown() -> None:
    """End a multi-rank run cleanly: wait for elixir's work in flight, then (all ranks together)
    a barrier and ``destroy_process_group``. Call it on every rank as the last collective step.

    Without it, a rank can reach interpreter shutdown while a gloo thread still finishes a
    collective, and abort (see the module docstring). Note that torch may keep the gloo threads
    alive after ``destroy_process_group`` (after some dispatch modes, such as the flop counter,
    have run), so only draining and the barrier make sure they are idle.
    """
    drain()
    if is_initialized():
        dist.barrier()
        dist.destroy_process_group()


_exit_drain_registered = False
EXIT_GIL_RELEASE_S = 0.02  # how long the exit hook lets gloo threads finish letting go of works


def _register_exit_drain() -> None:
    global _exit_drain_registered
    if not _exit_drain_registered:
        _exit_drain_registered = True
        atexit.register(_drain_at_exit)


def _drain_at_exit() -> None:
    # Exit hooks run before the interpreter starts finalizing: let elixir's own collectives still
    # in flight (a prefetch of a module freed mid-iteration, say) finish while the GIL can still be
    # handed to the gloo threads. Bounded: after a failure a peer may never join them.
    if _pending and is_initialized():
        drain(timeout_s=EXIT_DRAIN_TIMEOUT_S)
    time.sleep(EXIT_GIL_RELEASE_S)  # a gloo thread dropping a finished work's tensors gets the GIL now


# Keys torch stashes as Python objects in the thread-local state that a collective's work copies:
# "context" is the caller's contextvars context, stashed by ``torch.autograd.backward``.
_TLS_PYTHON_KEYS = ("context",)
_tls_api = all(
    hasattr(torch._C, f) for f in ("_is_key_in_tls", "_get_obj_in_tls", "_remove_obj_from_tls", "_stash_obj_in_tls")
)


@contextlib.contextmanager
def _python_free_tls() -> Iterator[None]:
    """Take the Python objects torch stashed in the thread-local state out of it while a collective
    is issued (and put them back after), so its work, which copies that state and may be dropped
    last by a gloo thread, holds no Python object (see the module docstring)."""
    stashed = []
    if _tls_api:
        for key in _TLS_PYTHON_KEYS:
            if torch._C._is_key_in_tls(key):
                stashed.append((key, torch._C._get_obj_in_tls(key)))
                torch._C._remove_obj_from_tls(key)
    try:
        yield
    finally:
        for key, obj in stashed:
            torch._C._stash_obj_in_tls(key, obj)


@contextlib.contextmanager
def engine_collectives(what: str = "a collective of torch's engines") -> Iterator[None]:
    """Around code whose collectives torch's own engines issue (a pipeline schedule's
    point-to-point sends, DTensor's tensor-parallel collectives): they are issued with no Python
    object in the thread state, the exit hook that lets gloo threads finish letting go of works is
    registered (see the module docstring), and a backend failure (:func:`is_backend_failure`: a
    peer died) is raised as :class:`CollectiveFailed` naming ``what`` ("pipeline send/recv") and
    where this rank was, as elixir's own collectives do."""
    _register_exit_drain()
    try:
        with _python_free_tls():
            yield
    except RuntimeError as e:
        failure = _named_backend_failure(what, e)
        if failure is None:
            raise
        raise failure from e


def _named_backend_failure(what: str, e: RuntimeError) -> Optional[CollectiveFailed]:
    """The :class:`CollectiveFailed` naming ``what`` to raise for ``e``; None where ``e`` passes
    through unchanged (elixir's own CollectiveFailed, no process group, not a peer's death)."""
    if isinstance(e, CollectiveFailed) or not is_initialized() or not is_backend_failure(e):
        return None
    return _failed(what, e)


_backward_named = False


def name_backward_failures(what: str) -> None:
    """From now on, a backend failure raised out of any ``loss.backward()`` (``Tensor.backward``
    and ``torch.autograd.backward``) is a :class:`CollectiveFailed` naming ``what`` and where this
    rank was. Collectives torch's engines issue inside a backward (DTensor's, under tensor
    parallelism) fail inside the autograd engine, out of reach of any context elixir puts around
    its own code: a bare ``loss.backward()`` (not ``ElixirOptimizer.backward``) gave gloo's raw
    error. Installed once, by the first tensor-parallel module; every other error, and elixir's own
    CollectiveFailed, passes through unchanged (a CollectiveFailed is a RuntimeError)."""
    global _backward_named
    if _backward_named:
        return
    _backward_named = True
    inner = torch.autograd.backward

    @functools.wraps(inner)
    def backward(*args, **kwargs):
        try:
            return inner(*args, **kwargs)
        except RuntimeError as e:
            failure = _named_backend_failure(what, e)
            if failure is None:
                raise
            raise failure from e

    torch.autograd.backward = backward


def is_backend_failure(e: BaseException) -> bool:
    """``e`` came from the communication backend (a lost peer, a timeout), not from the model's
    own code: torch's ``DistError`` family, or gloo's plain ``RuntimeError`` whose text names gloo."""
    return isinstance(e, dist.DistError) or "gloo" in str(e).lower()


def mesh_backend_options(ndim: int) -> dict:
    """``init_device_mesh``'s ``backend_override`` giving each of ``ndim`` mesh dimensions' groups
    the process group's timeout (:func:`pg_timeout_s`): torch creates a mesh's groups with its own
    default (30 minutes) otherwise, so a rank waiting on a dead peer in a tensor-parallel
    collective or a pipeline send would not fail within ``ELIXIR_PG_TIMEOUT_S``."""
    backend = dist.get_backend() if is_initialized() else default_backend()
    cls = {"gloo": getattr(dist, "ProcessGroupGloo", None), "nccl": getattr(dist, "ProcessGroupNCCL", None)}.get(backend)
    options = getattr(cls, "_Options", None) or getattr(cls, "Options", None)
    if options is None:
        return {}
    timeout = datetime.timedelta(seconds=_pg_timeout_s if _pg_timeout_s is not None else pg_timeout_s())
    out = {}
    for i in range(ndim):
        opts = options()
        opts._timeout = timeout
        out[i] = (backend, opts)
    return out


def python_free_backward() -> None:
    """Take the ``contextvars`` context torch stashed for the running backward out of this thread's
    state, for the rest of that backward (torch erases it at the end anyway). On a CPU device the
    backward runs on this thread, which needs no copy of it; without it, the collectives other
    engines issue during backward (DTensor's redistributions, which do not go through this module)
    hold no Python object either (see the module docstring). A no-op on an accelerator, whose
    backward threads read it."""
    if _tls_api and default_device().type == "cpu":
        for key in _TLS_PYTHON_KEYS:
            torch._C._remove_obj_from_tls(key)


class CollectiveFailed(RuntimeError):
    """A collective failed: most often a peer rank died, or did not answer within the process
    group's timeout. The message says where in training (:func:`set_where`) and keeps the
    backend's own text (gloo raises a plain ``RuntimeError`` for a lost peer, so every
    ``RuntimeError`` out of a collective is wrapped; the original is the ``__cause__``)."""


_where = [""]  # what this rank is doing, for CollectiveFailed's message (set by the runtime)


def set_where(text: str) -> None:
    """Record what this rank is doing ("step 3, backward"), named if a collective fails."""
    _where[0] = text


@contextlib.contextmanager
def where(text: str) -> Iterator[None]:
    """:func:`set_where` for the block only (a checkpoint save between steps, say); the previous
    text is back after it."""
    previous = _where[0]
    _where[0] = text
    try:
        yield
    finally:
        _where[0] = previous


def _failed(what: str, e: BaseException) -> CollectiveFailed:
    timeout = _pg_timeout_s if _pg_timeout_s is not None else pg_timeout_s()
    return CollectiveFailed(
        f"elixir: {what} failed at {_where[0] or 'an unknown point'}: most often a peer rank died or "
        f"did not answer within the process group's timeout ({timeout:.0f} s; set it with "
        f"init_distributed(timeout_s=...) or ELIXIR_PG_TIMEOUT_S). Restart from the last checkpoint. "
        f"Backend: {e}"
    )


def _collective(fn):
    """Issue ``fn``'s collectives with a Python-free thread-local state, make sure the exit hook
    is registered (user scripts may call ``dist.init_process_group`` themselves), and turn a
    backend failure into :class:`CollectiveFailed` naming where this rank was."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _exit_drain_registered and is_initialized():
            _register_exit_drain()
        try:
            with _python_free_tls():
                return fn(*args, **kwargs)
        except CollectiveFailed:
            raise
        except RuntimeError as e:
            if not is_initialized():
                raise
            raise _failed(fn.__name__, e) from e

    return wrapper


# ---------------------------------------------------------------------------------------------
# collective counter (for tests: "no collective inside no_sync")

_counters: list[Counter] = []


def _count(name: str) -> None:
    for c in _counters:
        c[name] += 1


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter]:
    """Count the collectives elixir issues inside the block, by name (world size 1 counts too)."""
    counter: Counter = Counter()
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)


# ---------------------------------------------------------------------------------------------
# collectives

_all_gather_base = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_base = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

#: Backends whose collectives take accelerator tensors only. Host tensors given to them (flags,
#: masks, norms, a state dict's host buffers) travel through the compute device and back.
DEVICE_ONLY_BACKENDS = {"nccl"}


class _Done:
    """The work handle of a collective that already finished."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _staged(group, *tensors: torch.Tensor) -> bool:
    """Whether ``tensors`` must be staged on the compute device for ``group``'s backend."""
    return dist.get_backend(group) in DEVICE_ONLY_BACKENDS and any(t.device.type == "cpu" for t in tensors)


def _on_device(t: torch.Tensor) -> torch.Tensor:
    return t.to(default_device(), copy=True)


def _done(async_op: bool):
    return _Done() if async_op else None


@_collective
def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup = None, async_op=False):
    """Gather equal ``shard``s from every rank into the flat ``output`` (rank order)."""
    _count("all_gather")
    if get_world_size(group) == 1:
        if output.data_ptr() != shard.data_ptr():
            output.copy_(shard)
        return None
    if _staged(group, output, shard):
        out = _on_device(output)
        _all_gather_base(out, _on_device(shard), group=group)
        output.copy_(out)
        return _done(async_op)
    work = _all_gather_base(output, shard, group=group, async_op=async_op)
    return _track(work) if async_op else work


class _ThenCopy:
    """A collective's work handle that copies a slice of its result once waited on."""

    def __init__(self, work, dst: torch.Tensor, src: torch.Tensor):
        self._work, self._dst, self._src = work, dst, src

    def wait(self, timeout=None) -> bool:
        wait_work(self._work)
        self._dst.copy_(self._src)
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()


@_collective
def reduce_scatter_into(
    shard_out: torch.Tensor, full: torch.Tensor, group: ProcessGroup = None, op=None, async_op=False
):
    """Sum (or ``op``) the flat ``full`` tensors across ranks and keep this rank's slice in ``shard_out``.

    ``full`` is scratch: its contents are undefined afterwards. On gloo the reduction is an
    in-place all-reduce of ``full`` plus a slice copy, which gloo runs 1.5-2x faster than its
    reduce-scatter at chunk-size messages (27 MiB: 20 vs 30 ms; 100 MiB: 71 vs 133 ms, 2 ranks).
    """
    _count("reduce_scatter")
    world = get_world_size(group)
    if world == 1:
        if shard_out.data_ptr() != full.data_ptr():
            shard_out.copy_(full)
        return None
    op = op or dist.ReduceOp.SUM
    if _staged(group, shard_out, full):
        out = _on_device(shard_out)
        _reduce_scatter_base(out, _on_device(full), op=op, group=group)
        shard_out.copy_(out)
        return _done(async_op)
    if dist.get_backend(group) == "gloo":
        n = shard_out.numel()
        start = get_rank(group) * n
        work = dist.all_reduce(full, op=op, group=group, async_op=async_op)
        if async_op:
            return _ThenCopy(_track(work), shard_out, full[start : start + n])
        shard_out.copy_(full[start : start + n])
        return None
    work = _reduce_scatter_base(shard_out, full, op=op, group=group, async_op=async_op)
    return _track(work) if async_op else work


@_collective
def all_reduce(tensor: torch.Tensor, group: ProcessGroup = None, op=None, async_op=False):
    _count("all_reduce")
    if get_world_size(group) == 1:
        return None
    if _staged(group, tensor):
        t = _on_device(tensor)
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group)
        tensor.copy_(t)
        return _done(async_op)
    work = dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=group, async_op=async_op)
    return _track(work) if async_op else work


@_collective
def broadcast(tensor: torch.Tensor, src: int = 0, group: ProcessGroup = None, async_op=False):
    _count("broadcast")
    if get_world_size(group) == 1:
        return None
    global_src = dist.get_global_rank(group, src) if group is not None else src
    if _staged(group, tensor):
        t = _on_device(tensor)
        dist.broadcast(t, src=global_src, group=group)
        tensor.copy_(t)
        return _done(async_op)
    work = dist.broadcast(tensor, src=global_src, group=group, async_op=async_op)
    return _track(work) if async_op else work


@_collective
def all_gather_object(obj, group: ProcessGroup = None) -> list:
    _count("all_gather_object")
    if get_world_size(group) == 1:
        return [obj]
    out = [None] * get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


@_collective
def broadcast_object(obj, src: int = 0, group: ProcessGroup = None):
    _count("broadcast_object")
    if get_world_size(group) == 1:
        return obj
    box = [obj]
    global_src = dist.get_global_rank(group, src) if group is not None else src
    dist.broadcast_object_list(box, src=global_src, group=group)
    return box[0]


# ---------------------------------------------------------------------------------------------
# disk faults agreed across ranks


class DiskFault(OSError):
    """A disk fault that every rank raises at the same point (:func:`agree_on_disk_fault`):
    ``rank`` is the rank whose disk failed (this one or another); ``errno`` is its error code."""

    def __init__(self, code: Optional[int], message: str, rank: int) -> None:
        super().__init__(*((code, message) if code is not None else (message,)))
        self.rank = rank


def agree_on_disk_fault(error: Optional[OSError], group: ProcessGroup = None, during: str = "", then: str = "") -> None:
    """Raise :class:`DiskFault` on every rank if ``error`` is set on any rank; else return.

    Collective: every rank calls it at the same point with its own outcome (``None``: its disk
    worked). Without it the ranks whose disks worked would go on into the next collective and wait
    there for the rank that raised, until the process group's timeout (or for ever, if that rank
    catches the error and lives on). ``during`` says where ("step 3, forward: reading chunk 5's
    compute shard"); ``then`` is appended to every rank's message (what state is current, what to
    do). The faulty rank's message is its own error's; the others' name it. Costs one one-element
    all-reduce (and an object gather only when a rank failed); nothing at world size 1."""
    world = get_world_size(group)
    rank = get_rank(group) if world > 1 else 0
    faulty = rank if error is not None else None
    if world > 1:
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        all_reduce(flag, group=group)
        if int(flag.item()):
            mine = None if error is None else (error.errno, error.strerror or str(error))
            reports = all_gather_object(mine, group=group)
            if error is None:
                faulty, (code, text) = next((r, x) for r, x in enumerate(reports) if x is not None)
                raise DiskFault(code, f"rank {faulty}'s offload disk failed ({during}), so every rank stops here: "
                                      f"{text}{then}", faulty)
    if error is not None:
        text = error.strerror or str(error)
        raise DiskFault(error.errno, f"rank {faulty}'s offload disk failed ({during}): {text}{then}", faulty) from error


def where_now() -> str:
    """What this rank is doing, as last recorded by :func:`set_where` ("step 3, forward")."""
    return _where[0]
