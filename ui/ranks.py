"""The web demo on several ranks: rank 0 serves Gradio and leads, the other ranks follow its jobs.

Every rank holds the same pipeline. Rank 0's app sees a `Leader`: each run first sends the job (its
requests and variant) to the followers, and after every denoising step sends one flag saying
whether the job goes on, so Stop (or any error raised by the step callback) ends the job at the same
step on every rank. A job refused by the argument checks fails the same way on every rank. When the app
exits, the leader tells the followers to quit.
"""

from collections.abc import Callable
from typing import Any

from qwen_image_fusion.models.errors import QwenImageError
from qwen_image_fusion.ui.generation import Pipeline


def serve(pipe: Any, run_app: Callable[[Pipeline], None]) -> None:
    """`run_app(pipe)` in one process; with ranks, rank 0 runs it on a `Leader` and the others `follow`."""
    if pipe.ranks is None:
        run_app(pipe)
    elif pipe.ranks.is_leader:
        leader = Leader(pipe)
        try:
            run_app(leader)
        finally:
            leader.close()
    else:
        follow(pipe)


class Leader:
    """Rank 0's pipeline as the app sees it: the same object, except that `run` leads the followers."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    def set_variant(self, variant: str) -> None:
        self._pipe.set_variant(variant)  # the followers switch with the next job

    def run(
        self, requests: list[Any], slots: int | None = None, on_step: Callable[[int, int], None] | None = None
    ) -> list[Any]:
        ranks = self._pipe.ranks
        ranks.share({"requests": requests, "slots": slots, "variant": self._pipe.variant})

        def step(i: int, total: int) -> None:
            try:
                if on_step is not None:
                    on_step(i, total)
            except BaseException:
                ranks.share_flag(True)
                raise
            ranks.share_flag(False)

        return self._pipe.run(requests, slots, on_step=step)

    def close(self) -> None:
        """Tell the followers to quit."""
        self._pipe.ranks.share(None)


class StoppedOnLeader(Exception):
    """Rank 0 ended the job after this step (Stop, a cancel, a lost client, the time limit or an error)."""


def follow(pipe: Any) -> None:
    """Run rank 0's jobs until it quits; a job's error or stop was already reported by rank 0."""
    ranks = pipe.ranks

    def step(i: int, total: int) -> None:
        if ranks.share_flag(False):
            raise StoppedOnLeader()

    while (job := ranks.share(None)) is not None:
        variant = job.pop("variant")
        try:
            if variant != pipe.variant:
                pipe.set_variant(variant)
            pipe.run(job["requests"], job["slots"], on_step=step)
        except (QwenImageError, StoppedOnLeader):
            continue
