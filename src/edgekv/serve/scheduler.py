"""Worker threads, fed fairly: a bounded FIFO per tenant, served round-robin.

Why one worker by default: EdgeKV's engine holds one sequence. With `--parallel N` the engine
has N slots (`parallel.open_slots`) whose tokens are batched together, and N workers take jobs
from the same queues, worker i always on slot i (`Job.worker`). Why per-tenant queues: a tenant
that sends fifty requests must not make another tenant's single request wait behind all fifty;
tenants take turns, each in arrival order. Why bounded: a request that cannot start soon is
better refused at once (429, the client backs off) than held until it times out.

The worker communicates with the asyncio side only through `Job.emit`, which hands each event
to the request's event loop thread-safely.

A request that fails on the worker is logged by the servers' one policy (`errorlog`): its
error's type, place and request id at ERROR, the traceback only at DEBUG, never its prompt.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from ..errorlog import log_internal_error
from .errors import APIError

__all__ = ["FinalEvent", "Job", "QueueFull", "Scheduler"]

log = logging.getLogger(__name__)


class FinalEvent:
    """The base of a job's last event (a result); an `APIError` is a last event too."""

    __slots__ = ()


class QueueFull(APIError):
    def __init__(self, message: str) -> None:
        super().__init__(429, message, type="rate_limit_error", code="queue_full",
                         headers={"Retry-After": "1"})


class Job:
    """One request's work (run on the worker thread) and its event channel back to asyncio."""

    def __init__(self, tenant: str, work: Callable[[Job], None],
                 loop: asyncio.AbstractEventLoop, request_id: str = "") -> None:
        self.tenant, self.work, self.loop = tenant, work, loop
        self.request_id = request_id  # the response's id: what a log line names
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        self.cancelled = threading.Event()  # checked by the work between tokens
        self.arrived = time.perf_counter()
        self.started: float | None = None
        self.worker = 0  # which worker (and engine slot) runs it
        self.done = False  # set by the consumer once it has the final event

    async def next_event(self, gone: asyncio.Future[None]) -> object | None:
        """The next event for the request, or None if `gone` (the client left) came first;
        the final event (a result or an error) marks the job done."""
        get = asyncio.ensure_future(self.events.get())
        finished, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
        if get not in finished:
            get.cancel()
            return None
        event = get.result()
        if isinstance(event, (APIError, FinalEvent)):
            self.done = True
        return event

    def emit(self, event: object) -> None:
        """Queue `event` for the request (from any thread); a closed loop drops it."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass


class Scheduler:
    """Fair FIFO queues and the worker thread that runs each job's `work` in turn."""

    def __init__(self, *, max_queue: int = 16, max_waiting: int | None = None,
                 on_cancel: Callable[[str], None] | None = None) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue={max_queue} must be >= 1")
        self.max_queue = max_queue
        self.max_waiting = max_waiting or 4 * max_queue
        self._queues: OrderedDict[str, deque[Job]] = OrderedDict()
        self._cond = threading.Condition()
        self._running: set[Job] = set()
        self._waiting = 0
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self._on_cancel = on_cancel or (lambda stage: None)
        self.ready = threading.Event()  # set once `setup` has run
        self.load_error: BaseException | None = None

    # -- public API ----------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def workers(self) -> int:
        return len(self._threads)

    def start(self, setup: Callable[[], int | None] | None = None,
              on_error: Callable[[BaseException], None] | None = None) -> None:
        """Start the first worker; it runs `setup` (loading the model) before the first job.
        `setup` returns how many workers to run in all (None: one); the others start then."""
        self._spawn(0, setup, on_error)

    def add_workers(self, total: int) -> None:
        """Run `total` workers in all (a server whose slots opened after its first start);
        worker i runs on slot i from its next job on."""
        with self._cond:
            if self._stopping:
                return
            for i in range(len(self._threads), total):
                self._spawn(i)

    def submit(self, job: Job) -> None:
        """Queue `job` behind its tenant's earlier jobs, or raise QueueFull (429) at once."""
        with self._cond:
            if self._stopping:
                raise APIError(503, "the server is shutting down; retry on another instance",
                               type="server_error", code="shutting_down")
            q = self._queues.get(job.tenant)
            if q is not None and len(q) >= self.max_queue:
                raise QueueFull(f"this tenant already has {len(q)} requests waiting (the "
                                f"limit, --max-queue); retry after one finishes")
            if self._waiting >= self.max_waiting:
                raise QueueFull(f"{self._waiting} requests are waiting (the server's limit); "
                                "retry in a moment")
            self._queues.setdefault(job.tenant, deque()).append(job)
            self._waiting += 1
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: drop `job` if it waits, ask it to stop if it runs."""
        if job.done:
            return
        with self._cond:
            q = self._queues.get(job.tenant)
            if q is not None and job in q:
                q.remove(job)
                self._waiting -= 1
                if not q:
                    del self._queues[job.tenant]
                self._on_cancel("waiting")
                return
            if job in self._running and not job.cancelled.is_set():
                job.cancelled.set()
                self._on_cancel("running")

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new jobs, fail the waiting ones, stop the running one, join the worker."""
        with self._cond:
            self._stopping = True
            dropped = [j for q in self._queues.values() for j in q]
            self._queues.clear()
            self._waiting = 0
            for job in self._running:
                job.cancelled.set()
            self._cond.notify_all()
        for job in dropped:
            job.emit(APIError(503, "the server is shutting down", type="server_error",
                              code="shutting_down"))
        deadline = time.monotonic() + timeout
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("the worker %s did not stop within %.0f s", thread.name, timeout)

    # -- private helpers -----------------------------------------------------------------

    def _spawn(self, index: int, setup: Callable[[], int | None] | None = None,
               on_error: Callable[[BaseException], None] | None = None) -> None:
        thread = threading.Thread(target=self._loop, args=(index, setup, on_error),
                                  name=f"edgekv-serve-worker-{index}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _next(self, worker: int) -> Job | None:
        with self._cond:
            while not self._stopping and not self._queues:
                self._cond.wait()
            if self._stopping:
                return None
            tenant, q = next(iter(self._queues.items()))
            job = q.popleft()
            if q:
                self._queues.move_to_end(tenant)  # the tenant's next job waits for the others
            else:
                del self._queues[tenant]
            self._waiting -= 1
            self._running.add(job)
            job.started = time.perf_counter()
            job.worker = worker
            return job

    def _loop(self, index: int, setup: Callable[[], int | None] | None,
              on_error: Callable[[BaseException], None] | None) -> None:
        if index == 0:  # the first worker loads, then starts the others
            workers = 1
            try:
                workers = (setup() if setup is not None else None) or 1
            except BaseException as e:  # noqa: BLE001 - reported, and the server says so
                log.error("loading the model failed: %s", e)  # a path, not a request
                log.debug("loading the model failed", exc_info=e)
                self.load_error = e
                if on_error is not None:
                    on_error(e)
                return
            self.add_workers(workers)  # those the setup did not start already
            self.ready.set()
        while (job := self._next(index)) is not None:
            try:
                job.work(job)
            except BaseException as e:  # noqa: BLE001 - the worker must outlive any request
                log_internal_error(log, e, where="the worker", request_id=job.request_id)
                job.emit(APIError(500, f"internal error ({type(e).__name__}) in request "
                                  f"{job.request_id or '?'}; the server's log has it",
                                  type="server_error", code="internal_error"))
            finally:
                with self._cond:
                    self._running.discard(job)
