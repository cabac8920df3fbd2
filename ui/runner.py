"""The one place generations run, for the web demo and the HTTP server alike: a bounded queue, one worker
thread on the process's single pipeline, batches of requests that share a forward pass, per-job stop
flags, the time limit, and the counters /metrics reports.

A job's outcome is a `concurrent.futures.Future`: its images and RunInfo, or the error that ended it. Stop,
a cancelled or disconnected client and the time limit resolve it at once with `Stopped` (the caller is
answered then, not when the running step ends); the worker sees the flag after the step, drops the
job's rows and ends the batch when no job in it is left.
"""

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from qwen_image_fusion.models.errors import QwenImageError
from qwen_image_fusion.pipelines.generation_request import GenerationRequest
from qwen_image_fusion.ui.limits import Limits, work_of

# Why a job stopped (Job.stop_reason); the time limit's reason names the limit.
STOP_PRESSED = "Stop was pressed"
CANCELLED = "the client cancelled the request"
DISCONNECTED = "the page was closed or the client disconnected"
SHUTTING_DOWN = "the server is shutting down"
STAGES = ("text_encoding", "denoising", "decoding")
DEFAULT_WINDOW_S = 0.02  # how long an idle worker waits for requests that can share the first one's batch


class QueueFull(QwenImageError):
    """The queue holds as many jobs as the server allows; `retry_after_s` estimates when one leaves it."""

    def __init__(self, size: int, retry_after_s: float) -> None:
        super().__init__(f"the queue is full ({size} requests waiting): try again in {retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s


class Stopped(QwenImageError):
    """A job ended on its stop flag (Stop, a cancel, a lost client, the time limit) before its images."""

    def __init__(self, job: "Job") -> None:
        self.reason = job.stop_reason
        super().__init__(stop_message(job, self.reason))

    @property
    def by_user(self) -> bool:
        return self.reason == STOP_PRESSED


def stop_message(job: "Job", reason: str | None) -> str:
    """Where the job stopped, with the reason unless it was the user's own Stop."""
    tail = "." if reason in (None, STOP_PRESSED) else f": {reason}."
    return f"Stopped after {job.steps_done} of {job.total_steps} steps{tail}"


class Job:
    """One request: its client session, the variant it runs on, its resolved `GenerationRequest`, its own
    stop flag and step count. `on_step(step, total)` (progress) runs after each of its denoising steps."""

    def __init__(
        self,
        session: str | None,
        variant: str,
        request: GenerationRequest,
        on_step: Callable[[int, int], None] | None = None,
    ) -> None:
        self.session = session
        self.variant = variant
        self.request = request
        self.on_step = on_step
        self.ignored_seed: int | None = None  # the demo's: a seed given with randomize_seed on (not used)
        self.steps_done = 0
        self.stop_reason: str | None = None
        self.future: Future = Future()
        self.future.set_running_or_notify_cancel()
        self._lock = threading.Lock()  # a stop and a step count never interleave

    @property
    def total_steps(self) -> int:
        return self.request.num_inference_steps

    @property
    def work(self) -> float:
        r = self.request
        frames = 1 if r.layers is None else r.layers + 1
        steps, images = r.num_inference_steps, r.num_images_per_prompt
        return work_of(r.width, r.height, steps, images, r.true_cfg, len(r.images), frames)

    @property
    def done(self) -> bool:
        return self.future.done()

    @property
    def stopped(self) -> bool:
        """It ended on its stop flag."""
        return self.done and isinstance(self.future.exception(), Stopped)

    def stop(self, reason: str) -> None:
        """End the job now with Stopped (its step count as it stands); the first reason stays, and a job
        that already has its outcome keeps it."""
        with self._lock:
            if self.stop_reason is None and not self.done:
                self.stop_reason = reason
                self._settle(exception=Stopped(self))

    def count_step(self, step: int) -> bool:
        """Record that `step` steps are done; False (nothing recorded) when the job has already ended."""
        with self._lock:
            if self.done:
                return False
            self.steps_done = step
            return True

    def _settle(self, result: Any = None, exception: BaseException | None = None) -> None:
        try:
            if exception is None:
                self.future.set_result(result)
            else:
                self.future.set_exception(exception)
        except Exception:  # InvalidStateError: stopped while its result was on its way; the stop stands
            pass


@dataclass
class Counters:
    """What the runner has done, for /metrics."""

    jobs: dict[str, int] = field(default_factory=dict)  # by outcome: ok, stopped, failed, queue_full
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    stage_count: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STAGES, 0))
    batches: int = 0
    batch_requests: int = 0  # requests the batches held (their slots minus the padding)
    batch_slots: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, outcome: str) -> None:
        with self.lock:
            self.jobs[outcome] = self.jobs.get(outcome, 0) + 1

    def time(self, stage: str, seconds: float) -> None:
        with self.lock:
            self.stage_seconds[stage] += seconds
            self.stage_count[stage] += 1

    def batch(self, requests: int, slots: int) -> None:
        with self.lock:
            self.batches += 1
            self.batch_requests += requests
            self.batch_slots += slots


def batch_key(job: Job) -> tuple | None:
    """What jobs sharing a batch agree on: the variant they run on and their request's `batch_key` (None:
    the job runs alone)."""
    key = job.request.batch_key
    return None if key is None else (job.variant, key)


class Runner:
    """Runs jobs on the process's single pipeline, in arrival order, one batch at a time.

    With a `batch` plan (qwen_image_fusion.pipelines.batching.BatchPlan) of more than one image, jobs with the
    same batching key that arrive within `window_s` of the first (or wait while another batch runs) share its
    batch, up to `batch.slots(...)` jobs; every batch runs at that fixed size through `pipe.run`, so a job's
    images do not depend on its companions. Without one (or under several ranks) every job runs alone through
    `pipe.run`, as the CLI runs it.
    """

    def __init__(
        self, pipe: Any, limits: Limits, batch: Any = None, window_s: float = DEFAULT_WINDOW_S
    ) -> None:
        self._pipe = pipe
        self.limits = limits
        self.batch = batch
        self.window_s = window_s
        self.counters = Counters()
        self._cond = threading.Condition()
        self._queue: list[Job] = []  # waiting for the device
        self._running: list[Job] = []
        self._worker: threading.Thread | None = None
        self._closed = False
        self._recent_s = 1.0  # a running mean of seconds per run, for Retry-After

    @property
    def batching(self) -> bool:
        return (
            self.batch is not None
            and self.batch.max_images > 1
            and getattr(self._pipe, "ranks", None) is None
        )

    def jobs(self) -> list[Job]:
        """Jobs waiting for the device or running now (empty when the server is idle)."""
        with self._cond:
            return [job for job in self._running + self._queue if not job.done]

    def queue_depth(self) -> int:
        """Jobs waiting for the device."""
        with self._cond:
            return sum(not job.done for job in self._queue)

    def stop_session(self, session: str | None, reason: str) -> list[Job]:
        """Stop every job of `session`; returns them (empty when it has none)."""
        jobs = [job for job in self.jobs() if job.session == session]
        for job in jobs:
            job.stop(reason)
        return jobs

    def submit(self, job: Job) -> Future:
        """Queue `job`; its future holds (images, RunInfo) or the error. QueueFull when the queue is full."""
        with self._cond:
            if self._closed:
                raise QwenImageError(SHUTTING_DOWN)
            waiting = sum(not j.done for j in self._queue)
            if waiting >= self.limits.queue_size:
                self.counters.count("queue_full")
                slots = self.batch.max_images if self.batching else 1
                raise QueueFull(waiting, max(1.0, self._recent_s * (waiting + 1) / slots))
            job.future.add_done_callback(lambda future: self.counters.count(_outcome(future)))
            self._queue.append(job)
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="qwen-image-runner", daemon=True)
                self._worker.start()
            self._cond.notify_all()
        return job.future

    def run(
        self, job: Job, on_step: Callable[[int, int], None] | None = None
    ) -> tuple[list[Image.Image], Any]:
        """Submit `job` and wait for it: (images, RunInfo), or raises what ended it (Stopped, ...)."""
        job.on_step = on_step or job.on_step
        return self.submit(job).result()

    def close(self) -> None:
        """Stop taking jobs and stop the ones there are; the worker ends after the running step."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for job in self.jobs():
            job.stop(SHUTTING_DOWN)

    def _next(self) -> Job | None:
        """The oldest live job (None once closed), waiting for one."""
        with self._cond:
            while not self._closed and all(j.done for j in self._queue):
                self._cond.wait()
            self._queue = [j for j in self._queue if not j.done]
            return None if self._closed else self._queue[0]

    def _work(self) -> None:
        while (head := self._next()) is not None:
            start = time.monotonic()
            try:
                key = batch_key(head) if self.batching else None
                self._run([head]) if key is None else self._run(self._gather(head, key), key)
            except Exception as err:  # the worker never dies; the job says what went wrong
                head._settle(exception=err)
            finally:
                with self._cond:
                    self._running = []
                self._recent_s = 0.8 * self._recent_s + 0.2 * (time.monotonic() - start)

    def _take(self, jobs: list[Job]) -> None:
        """Move `jobs` from the queue to the device."""
        with self._cond:
            self._queue = [j for j in self._queue if j not in jobs]
            self._running = list(jobs)

    def _stepper(self, jobs: list[Job]) -> Callable[[int, int], None]:
        """The denoising loop's step callback for `jobs`: counts their steps, applies the time limit,
        reports progress, and ends the run once none of them is left."""
        deadline = time.monotonic() + self.limits.time_limit_s

        def step(i: int, total: int) -> None:
            for job in jobs:
                if not job.count_step(i):
                    continue
                if time.monotonic() > deadline:
                    job.stop(f"this server stops a request after {self.limits.time_limit_s:g} s")
                elif job.on_step is not None:
                    try:
                        job.on_step(i, total)
                    except Exception as err:  # the caller's progress callback failed: it ends that job
                        job._settle(exception=err)
            if all(job.done for job in jobs):
                raise _Abandoned()

        return step

    def _run(self, jobs: list[Job], key: tuple | None = None) -> None:
        """`pipe.run` on the jobs' requests on their variant: alone (`key` None, as the CLI runs one), or as
        one batch of the plan's fixed size."""
        self._take(jobs)
        if all(job.done for job in jobs):
            return
        head = jobs[0]
        if head.variant != self._pipe.variant:
            self._pipe.set_variant(head.variant)
        slots = None if key is None else self.batch.slots(head.request)
        try:
            results = self._pipe.run([job.request for job in jobs], slots, self._stepper(jobs))
        except _Abandoned:
            return
        except Exception as err:
            for job in jobs:
                job._settle(exception=err)
            return
        if key is not None:
            self.counters.batch(len(jobs), slots)
        for job, result in zip(jobs, results, strict=True):
            for stage in STAGES:  # shared denoising counted once across the requests that shared it
                share = result.info.shared_by if stage == "denoising" else 1
                self.counters.time(stage, result.info.timings.get(stage, 0.0) / share)
            job._settle((result.images, result.info))

    def _gather(self, head: Job, key: tuple) -> list[Job]:
        """`head` and the queued jobs with its batching key, in arrival order: waiting up to `window_s` for
        more while the batch has free slots."""
        slots = self.batch.slots(head.request)
        batch, seen = [head], {id(head)}
        deadline = time.monotonic() + self.window_s
        while len(batch) < slots:
            with self._cond:
                fresh = [j for j in self._queue if id(j) not in seen]
                if not fresh:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                    continue
            for job in fresh:
                seen.add(id(job))
                if not job.done and batch_key(job) == key:
                    batch.append(job)
                    if len(batch) == slots:
                        break
        return batch


def _outcome(future: Future) -> str:
    error = future.exception()
    return "ok" if error is None else "stopped" if isinstance(error, Stopped) else "failed"


class _Abandoned(Exception):
    """Every job of a run has been stopped: the run ends after this step."""
