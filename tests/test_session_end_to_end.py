"""The session driving real (cpu reference) executors through the message bytes: a prompt's KV
stored by one request comes back, byte for byte, into another request's blocks."""

from __future__ import annotations

import numpy as np
from session_fakes import blocks, prefix_hashes

from kvferry.adapters.messages import (
    decode_completions,
    decode_jobs,
    encode_completions,
    encode_jobs,
)
from kvferry.adapters.session import OffloadSession, RunningRequest
from kvferry.core.bound import BoundPlan
from kvferry.core.catalog import Catalog, CatalogConfig
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.layout import TensorLayout
from kvferry.core.lookup import LookupResult
from kvferry.executors import Executor, KVTensor, make_executor

CONFIG = OffloadConfig(
    hash_block_size=4,
    blocks_per_chunk=2,
    groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=4),),
)
NUM_BLOCKS = 24


def run(session: OffloadSession, workers: list[Executor], jobs: list[BoundPlan]) -> None:
    """Send `jobs` to every worker as bytes, and their results back to the session as bytes."""
    message = encode_jobs(jobs)
    for rank, worker in enumerate(workers):
        received = decode_jobs(message)
        for job in received:
            worker.submit(job)
        results = worker.wait([job.job_id for job in received])
        reply = decode_completions(encode_completions(rank, results))
        session.report(reply.worker, reply.results)


def test_a_stored_prompt_is_loaded_back_byte_for_byte_on_every_worker() -> None:
    rng = np.random.default_rng(7)
    caches = [rng.random((NUM_BLOCKS, 2, 4, 8), dtype=np.float32) for _ in range(2)]
    workers = [
        make_executor(
            "cpu",
            kv_caches=[[KVTensor(tensor=cache, layout=TensorLayout.BLOCKS_FIRST)]],
            blocks_per_chunk=2,
            num_rows=8,
        )
        for cache in caches
    ]
    catalog = Catalog(CatalogConfig(capacity_rows=8))
    session = OffloadSession(
        CONFIG, catalog, world_size=2, layout_fingerprint=workers[0].layout.fingerprint
    )
    hashes = prefix_hashes(4)
    first = [3, 7, 1, 5]
    step = session.start_stores(
        [
            RunningRequest(
                request_id="r1",
                blocks=[blocks(first)],
                num_computed_tokens=0,
                num_scheduled_tokens=16,
                num_tokens=16,
                block_hashes=hashes,
            )
        ]
    )
    run(session, workers, list(step.jobs))
    assert session.finish("r1") == frozenset()
    originals = [cache[first].copy() for cache in caches]
    for cache in caches:
        cache[first] = 0.0  # the engine reuses r1's blocks

    found = session.lookup("r2", block_hashes=hashes, num_tokens=17, num_computed_tokens=0)
    assert found == LookupResult(tokens=16)
    second = [20, 11, 12, 9, 2]
    job = session.start_load("r2", [blocks(second)], num_computed_tokens=0, hit_tokens=16)
    assert job is not None
    run(session, workers, [job])

    assert session.in_flight() == frozenset()
    for cache, original in zip(caches, originals, strict=True):
        np.testing.assert_array_equal(cache[second[:4]], original)
    counters = session.counters()
    assert (counters.stores, counters.hits) == (2, 2)
