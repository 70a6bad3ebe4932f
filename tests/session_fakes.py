"""Test helpers for the session: a fake engine's inputs and fake workers that finish jobs on
command (through the process-boundary messages, as real workers would)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from kvferry.adapters.messages import (
    decode_completions,
    decode_jobs,
    encode_completions,
    encode_jobs,
)
from kvferry.adapters.session import CompletionReport, OffloadSession
from kvferry.core.blocks import GroupBlocks
from kvferry.core.bound import BoundPlan, JobResult


def prefix_hashes(count: int, family: int = 0, shared: int = 0) -> tuple[bytes, ...]:
    """Return `count` chained stand-in hashes; two families share their first `shared`."""
    return tuple(
        bytes([0 if i < shared else family + 1]) + i.to_bytes(4, "big") for i in range(count)
    )


def blocks(ids: Sequence[int], *, cached: Sequence[int] = ()) -> GroupBlocks:
    """Return one group's block list."""
    return GroupBlocks.of(list(ids), cached=list(cached))


def merge(reports: Iterable[CompletionReport]) -> CompletionReport:
    """Return the reports of several `report` calls as one."""
    reports = list(reports)
    return CompletionReport(
        completed=tuple(j for r in reports for j in r.completed),
        failed=tuple(j for r in reports for j in r.failed),
        recompute=tuple(x for r in reports for x in r.recompute),
        released=tuple(x for r in reports for x in r.released),
    )


@attrs.define
class FakeWorkers:
    """`world_size` workers holding submitted jobs until told to finish them."""

    session: OffloadSession
    pending: dict[int, BoundPlan] = attrs.field(factory=dict)

    def submit(self, jobs: Iterable[BoundPlan | None]) -> list[BoundPlan]:
        """Send the jobs to every worker (as message bytes); return them as received."""
        received = list(decode_jobs(encode_jobs([job for job in jobs if job is not None])))
        for job in received:
            self.pending[job.job_id] = job
        return received

    def finish(
        self,
        job_id: int,
        *,
        success: bool = True,
        workers: Iterable[int] | None = None,
        failing_worker: int | None = None,
    ) -> CompletionReport:
        """Have `workers` (default: all) report `job_id`; `failing_worker` (or every worker
        when `success` is False) reports a failure."""
        ranks = list(range(self.session.world_size)) if workers is None else list(workers)
        reports = []
        for rank in ranks:
            ok = success and rank != failing_worker
            result = JobResult(
                job_id=job_id, success=ok, nbytes=0, seconds=0.0, error=None if ok else "boom"
            )
            message = decode_completions(encode_completions(rank, [result]))
            reports.append(self.session.report(message.worker, message.results))
        if job_id not in self.session.in_flight():
            self.pending.pop(job_id, None)
        return merge(reports)

    def finish_all(self, *, success: bool = True) -> CompletionReport:
        """Finish every pending job, oldest first."""
        return merge(self.finish(job_id, success=success) for job_id in sorted(self.pending))
