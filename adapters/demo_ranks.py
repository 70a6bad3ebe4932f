"""Where the demo's KV tensors live: in this process, or one shard per tensor-parallel worker.

The demo engine talks to one `DemoRanks` whatever the world size: it submits jobs, writes the
forward pass's pages, poisons and verifies load destinations. It never plans and never decides
what a page holds (`demo_pages` does); a rank's failure is raised, never skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import attrs

from kvferry.adapters.demo_pages import DemoKVCache, ForwardBatch, PagePattern
from kvferry.adapters.demo_profiles import ModelProfile
from kvferry.adapters.demo_verify import PageVerifier, VerificationFailedError
from kvferry.adapters.messages import Completions
from kvferry.adapters.workers import Handler, WorkerPool, WorkerShard
from kvferry.core.bound import BoundPlan
from kvferry.core.plan import TransferPlan
from kvferry.executors.base import Executor
from kvferry.executors.registry import make_executor


class DemoRanks(Protocol):
    """The demo's KV shards and their executors, one per tensor-parallel rank."""

    @property
    def world_size(self) -> int:
        """Return the number of ranks (each must report a job before it completes)."""
        ...

    @property
    def page_bytes(self) -> list[int]:
        """Return, per group, the bytes of one GPU block over every ref and every rank."""
        ...

    @property
    def pages_verified(self) -> tuple[int, ...]:
        """Return the loaded pages verified so far, per rank."""
        ...

    def submit(self, jobs: Sequence[BoundPlan]) -> None:
        """Submit `jobs` on every rank (results come with a later `poll` or `wait`)."""
        ...

    def poll(self) -> list[Completions]:
        """Return, per rank, the jobs that ended since the last report."""
        ...

    def wait(self, job_ids: Iterable[int]) -> list[Completions]:
        """Block until `job_ids` ended on every rank; return, per rank, what ended."""
        ...

    def write(self, batch: ForwardBatch) -> None:
        """Write one forward pass's pages on every rank (each its own shard's bytes)."""
        ...

    def poison(self, plan: TransferPlan) -> None:
        """Fill the destination pages of load `plan` with poison on every rank."""
        ...

    def verify(self, plan: TransferPlan, ids: Any) -> None:
        """Check every destination page of the completed load `plan` on every rank; raise
        VerificationFailedError (naming the rank under tensor parallelism) at a wrong byte."""
        ...

    def close(self) -> list[Completions]:
        """Drain every rank and release it; return what was still unreported, per rank."""
        ...


def _poison(cache: DemoKVCache, plan: TransferPlan) -> None:
    import numpy as np

    for g, refs in enumerate(cache.refs):
        destinations = np.asarray(plan.gpu_ids_of(g), dtype=np.uint64)
        for ref in refs if len(destinations) else ():
            cache.poison(ref, destinations)


class LocalRanks:
    """One rank in this process: the executor over the whole model's tensors (no workers)."""

    def __init__(
        self, executor: Executor, cache: DemoKVCache, pattern: PagePattern, *, block_size: int
    ) -> None:
        self._executor = executor
        self._cache = cache
        self._pattern = pattern
        self._verifier = PageVerifier(cache=cache, pattern=pattern, block_size=block_size)
        self._in_flight: set[int] = set()

    @property
    def world_size(self) -> int:
        """Return 1."""
        return 1

    @property
    def executor(self) -> Executor:
        """Return the executor."""
        return self._executor

    @property
    def page_bytes(self) -> list[int]:
        """Return, per group, the bytes of one GPU block over every ref."""
        return [sum(r.page_bytes for r in refs) for refs in self._cache.refs]

    @property
    def pages_verified(self) -> tuple[int, ...]:
        """Return the loaded pages verified so far."""
        return (self._verifier.pages_verified,)

    def submit(self, jobs: Sequence[BoundPlan]) -> None:
        """Submit `jobs` to the executor."""
        for job in jobs:
            self._executor.submit(job)
            self._in_flight.add(job.job_id)

    def poll(self) -> list[Completions]:
        """Return the executor's ended jobs."""
        return self._completions(self._executor.poll())

    def wait(self, job_ids: Iterable[int]) -> list[Completions]:
        """Wait for those of `job_ids` still in flight; return what ended."""
        ids = [job for job in job_ids if job in self._in_flight]
        return self._completions(self._executor.wait(ids))

    def write(self, batch: ForwardBatch) -> None:
        """Write the forward pass's pages."""
        batch.write(self._cache, self._pattern)

    def poison(self, plan: TransferPlan) -> None:
        """Poison the destinations of load `plan`."""
        _poison(self._cache, plan)

    def verify(self, plan: TransferPlan, ids: Any) -> None:
        """Verify the destinations of load `plan` (raises VerificationFailedError)."""
        self._verifier.verify_load(plan, ids)

    def close(self) -> list[Completions]:
        """Close the executor (it drains); return what was unreported."""
        return self._completions(self._executor.close())

    def _completions(self, results: Sequence[Any]) -> list[Completions]:
        for result in results:
            self._in_flight.discard(result.job_id)
        return [Completions(worker=0, results=tuple(results))] if results else []


# -- tensor parallelism: one worker process per rank ----------------------------------------------


@attrs.frozen(kw_only=True)
class DemoShard:
    """Builds one rank's demo shard inside its worker process: the profile's share of the KV
    heads (`ModelProfile.sharded`), pages salted by rank, the executor named, on `cuda:rank`
    (round-robin over the GPUs there are) for a GPU executor."""

    profile: ModelProfile
    """The whole model's profile (each rank takes its share)."""
    executor: str
    """Executor name (`cpu`, `torch`, `cupy`)."""
    executor_options: dict[str, Any] = attrs.field(factory=dict)
    """Backend keyword arguments (e.g. `staging_bytes`)."""
    on_gpu: bool
    """Whether the executor copies CUDA memory (the KV tensors are torch tensors on a GPU)."""
    blocks_per_chunk: int
    """`F`."""
    num_rows: int | tuple[int, ...]
    """Rows of each group in every rank's CPU tier (the catalog's capacity)."""
    seed: int
    """Seed of the page patterns."""

    def __call__(self, rank: int, world_size: int) -> WorkerShard:
        """Return rank `rank`'s shard: its KV tensors, executor and demo commands."""
        profile = self.profile.sharded(world_size)
        device = None
        if self.on_gpu:
            import torch

            count = torch.cuda.device_count()
            device = f"cuda:{rank % count}" if count else "cuda"
            if count:
                torch.cuda.set_device(rank % count)
        cache = DemoKVCache(profile, torch_device=device)
        pattern = PagePattern(self.seed, cache.max_width(), rank=rank)
        verifier = PageVerifier(cache=cache, pattern=pattern, block_size=profile.block_size)
        executor = make_executor(
            self.executor,
            kv_caches=cache.kv_tensors,
            blocks_per_chunk=self.blocks_per_chunk,
            num_rows=self.num_rows,
            **self.executor_options,
        )

        def write(batch: ForwardBatch) -> None:
            batch.write(cache, pattern)

        def poison(plan: TransferPlan) -> None:
            _poison(cache, plan)

        def verify(payload: tuple[TransferPlan, Any]) -> dict[str, Any] | None:
            plan, ids = payload
            try:
                verifier.verify_load(plan, ids)
            except VerificationFailedError as error:
                return {
                    "request": error.request,
                    "group": error.group,
                    "ref": error.ref,
                    "block_id": error.block_id,
                    "position": error.position,
                    "word": error.word,
                }
            return None

        def counts(_: object) -> dict[str, Any]:
            return {
                "page_bytes": [sum(r.page_bytes for r in refs) for refs in cache.refs],
                "pages_verified": verifier.pages_verified,
            }

        handlers: dict[str, Handler] = {
            "write": write,
            "poison": poison,
            "verify": verify,
            "counts": counts,
        }
        return WorkerShard(executor=executor, handlers=handlers)


class ProcessRanks:
    """`world_size` worker processes, one rank's shard each (`kvferry.adapters.workers`).

    Completions that come back with a submission are held for the next `poll` or `wait`, so the
    engine sees results at the same points as with `LocalRanks`.
    """

    def __init__(self, pool: WorkerPool) -> None:
        self._pool = pool
        self._held: list[Completions] = []
        per_rank = [c["page_bytes"] for c in pool.call("counts")]
        self._page_bytes = [sum(group) for group in zip(*per_rank, strict=True)]

    @property
    def world_size(self) -> int:
        """Return the number of ranks."""
        return self._pool.world_size

    @property
    def pool(self) -> WorkerPool:
        """Return the worker pool."""
        return self._pool

    @property
    def page_bytes(self) -> list[int]:
        """Return, per group, the bytes of one GPU block over every ref and every rank."""
        return self._page_bytes

    @property
    def pages_verified(self) -> tuple[int, ...]:
        """Return the loaded pages verified so far, per rank (asks every rank)."""
        return tuple(int(c["pages_verified"]) for c in self._pool.call("counts"))

    def submit(self, jobs: Sequence[BoundPlan]) -> None:
        """Send `jobs` to every rank."""
        if jobs:
            self._held.extend(self._pool.submit(jobs))

    def poll(self) -> list[Completions]:
        """Return, per rank, what ended (held results first)."""
        return self._take(self._pool.poll())

    def wait(self, job_ids: Iterable[int]) -> list[Completions]:
        """Wait for `job_ids` on every rank; return what ended (held results first)."""
        return self._take(self._pool.wait(job_ids))

    def write(self, batch: ForwardBatch) -> None:
        """Write the forward pass's pages on every rank."""
        self._pool.call("write", batch)

    def poison(self, plan: TransferPlan) -> None:
        """Poison the destinations of load `plan` on every rank."""
        self._pool.call("poison", plan)

    def verify(self, plan: TransferPlan, ids: Any) -> None:
        """Verify load `plan` on every rank; raise VerificationFailedError naming the first
        rank with a wrong byte."""
        for rank, failure in enumerate(self._pool.call("verify", (plan, ids))):
            if failure is not None:
                raise VerificationFailedError(rank=rank, **failure)

    def close(self) -> list[Completions]:
        """Drain and end every worker; return what was unreported."""
        return self._take(self._pool.close())

    def _take(self, fresh: Sequence[Completions]) -> list[Completions]:
        out = [*self._held, *(c for c in fresh if c.results)]
        self._held = []
        return [c for c in out if c.results]
