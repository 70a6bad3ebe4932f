"""The demo's result: one frozen value with every count, rendered as a table or as JSON.

Formatting only: it computes ratios from the counts it is given and never runs anything.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from kvferry.adapters.shared_tier import SharedTierCounters


@attrs.frozen(kw_only=True)
class DemoReport:
    """What one `kvferry demo` run did."""

    profile: str
    """Profile name."""
    title: str
    """What the profile imitates."""
    scale: str
    """Its layer counts against the real model's."""
    executor: str
    """Executor name."""
    device: str
    """Where the KV tensors lived."""
    seed: int
    """Workload seed."""
    blocks_per_chunk: int
    """`F`."""
    block_size: int
    """Tokens per GPU block."""
    gpu_blocks: int
    """GPU blocks per group in the pool."""
    cpu_tier_bytes: int
    """The CPU tier's budget."""
    cpu_tier_rows: tuple[int, ...]
    """Rows of each group it holds (one chunk each; every group has its own rows)."""
    cpu_tier_row_bytes: tuple[int, ...]
    """Bytes of one row of each group (one chunk of the whole model)."""
    group_kinds: tuple[str, ...]
    """Each group's kind."""
    eviction_policy: str
    """The catalog's eviction policy."""
    requests: int
    """Requests (chat turns) served."""
    steps: int
    """Engine steps run."""
    prompt_tokens: int
    """Prompt tokens over all requests."""
    gpu_hit_tokens: int
    """Prompt tokens found in the engine's own GPU prefix cache."""
    loaded_tokens: int
    """Prompt tokens loaded from the CPU tier."""
    recomputed_tokens: int
    """Prompt tokens computed (neither on the GPU nor in the tier)."""
    decoded_tokens: int
    """Tokens generated."""
    preemptions: int
    """Requests preempted for lack of GPU blocks (recomputed later)."""
    gpu_evictions: int
    """Cached GPU blocks reused for other tokens (the engine's prefix cache forgot them)."""
    load_jobs: int
    """Load jobs run."""
    store_jobs: int
    """Store jobs run."""
    chunks_stored: int
    """Chunks written to the CPU tier."""
    chunks_evicted: int
    """Chunks evicted from the CPU tier."""
    chunks_loaded: int
    """Chunks read from the CPU tier."""
    bytes_stored: int
    """Bytes copied GPU -> CPU."""
    bytes_loaded: int
    """Bytes copied CPU -> GPU."""
    store_seconds: float
    """Copy time of the stores, as the executor measured it."""
    load_seconds: float
    """Copy time of the loads, as the executor measured it."""
    windowed_bytes_loaded: int
    """Bytes loaded for sliding-window and Mamba groups."""
    windowed_bytes_all_blocks: int
    """Bytes those groups would have loaded with every block of the hit instead of the window
    (or state) only."""
    windowed_chunks_complete: int
    """Chunks of sliding-window, Mamba and chunked-local groups completed with real blocks."""
    windowed_chunks_not_stored: int
    """Those of them in no window a lookup can load: passed over, never stored."""
    windowed_bytes_complete: int
    """Bytes of those complete chunks."""
    windowed_bytes_not_stored: int
    """Bytes of the chunks passed over: copies and CPU-tier rows saved."""
    pages_verified: int
    """Loaded pages checked byte for byte (all equal, or the run would have failed)."""
    wall_seconds: float
    """Time of the whole run."""
    tp: int | None = None
    """Tensor-parallel ranks (worker processes); None: one rank in the demo's process."""
    rank_devices: tuple[str, ...] = ()
    """Where each rank's shard lived (empty without worker processes)."""
    ranks_note: str | None = None
    """Where the ranks ran, saying when several shared one GPU."""
    pages_verified_per_rank: tuple[int, ...] = ()
    shared_tier: str | None = None
    """The shared tier's URL (password hidden), or None when the run had none."""
    shared: SharedTierCounters | None = None
    """What the run did with the shared tier."""
    replica: str | None = None
    """Which replica this run was (A, B, ...) when several shared the tier."""
    """Loaded pages verified on each rank (each checks its own shard's bytes)."""

    @property
    def store_gbps(self) -> float:
        """Return the stores' GB/s (0 when nothing was stored)."""
        return self.bytes_stored / self.store_seconds / 1e9 if self.store_seconds else 0.0

    @property
    def load_gbps(self) -> float:
        """Return the loads' GB/s (0 when nothing was loaded)."""
        return self.bytes_loaded / self.load_seconds / 1e9 if self.load_seconds else 0.0

    @property
    def windowed_bytes_saved(self) -> int:
        """Return the bytes the window-only loads saved against loading every block."""
        return self.windowed_bytes_all_blocks - self.windowed_bytes_loaded

    @property
    def verified(self) -> str:
        """Return the closing line: "all N pages verified", or that nothing was verified."""
        if self.pages_verified == 0:
            return "no page verified: nothing was loaded from the CPU tier"
        return f"all {self.pages_verified} pages verified"

    def to_json(self) -> str:
        """Return the report as JSON (sorted keys), with the derived rates."""
        data: dict[str, Any] = attrs.asdict(self)
        data["store_gbps"] = self.store_gbps
        data["load_gbps"] = self.load_gbps
        data["windowed_bytes_saved"] = self.windowed_bytes_saved
        data["verified"] = self.verified
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    def to_table(self) -> str:
        """Return the report as a plain-text table ending with its `verified` line."""
        prompt = max(self.prompt_tokens, 1)

        def share(tokens: int) -> str:
            return f"{tokens:,} ({100 * tokens / prompt:.1f} %)"

        rows = [
            ("requests (chat turns)", f"{self.requests:,} in {self.steps:,} steps"),
            ("prompt tokens", f"{self.prompt_tokens:,}"),
            ("  GPU prefix-cache hits", share(self.gpu_hit_tokens)),
            ("  loaded from CPU tier", share(self.loaded_tokens)),
            ("  recomputed", share(self.recomputed_tokens)),
            ("decoded tokens", f"{self.decoded_tokens:,}"),
            ("GPU blocks evicted / preemptions", f"{self.gpu_evictions:,} / {self.preemptions}"),
            ("load jobs / store jobs", f"{self.load_jobs:,} / {self.store_jobs:,}"),
            (
                "chunks stored / evicted / loaded",
                f"{self.chunks_stored:,} / {self.chunks_evicted:,} / {self.chunks_loaded:,}",
            ),
            (
                "bytes stored GPU->CPU",
                f"{_size(self.bytes_stored)} at {self.store_gbps:.2f} GB/s",
            ),
            ("bytes loaded CPU->GPU", f"{_size(self.bytes_loaded)} at {self.load_gbps:.2f} GB/s"),
        ]
        if self.windowed_bytes_all_blocks:
            saved = self.windowed_bytes_saved
            rows.append(
                (
                    "windowed groups loaded",
                    f"{_size(self.windowed_bytes_loaded)} (window/state only); every block: "
                    f"{_size(self.windowed_bytes_all_blocks)}; saved {_size(saved)} "
                    f"({100 * saved / self.windowed_bytes_all_blocks:.1f} %)",
                )
            )
        if self.windowed_chunks_complete:
            rows.append(
                (
                    "windowed chunks not stored",
                    f"{self.windowed_chunks_not_stored:,} of {self.windowed_chunks_complete:,} "
                    f"complete: saved {_size(self.windowed_bytes_not_stored)} "
                    f"({100 * self.windowed_bytes_not_stored / self.windowed_bytes_complete:.1f} "
                    "%; in no window a lookup can load)",
                )
            )
        rows += self._shared_rows()
        rows += [
            ("pages verified", f"{self.pages_verified:,}"),
            ("wall time", f"{self.wall_seconds:.1f} s"),
        ]
        width = max(len(name) for name, _ in rows)
        replica = f"replica {self.replica}: " if self.replica else ""
        head = [
            f"kvferry demo: {replica}profile {self.profile}, executor {self.executor} "
            f"({self.device}), seed {self.seed}",
            f"  model: {self.title}",
            f"  scaled: {self.scale}; {self.block_size}-token blocks, F = "
            f"{self.blocks_per_chunk}, {self.gpu_blocks} GPU blocks per group",
            f"  CPU tier: {_size(self.cpu_tier_bytes)}, eviction {self.eviction_policy}; "
            "chunks per group:",
            *(
                f"    group {g} ({kind}): {rows:,} chunks of {_size(pitch)}"
                for g, (kind, rows, pitch) in enumerate(
                    zip(self.group_kinds, self.cpu_tier_rows, self.cpu_tier_row_bytes, strict=True)
                )
            ),
        ]
        if self.shared_tier is not None:
            head.append(f"  shared tier: {self.shared_tier}")
        verified = self.verified
        if self.ranks_note:
            head.append(f"  tensor parallel {self.tp}: {self.ranks_note}")
            per_rank = ", ".join(
                f"rank {rank}: {count}" for rank, count in enumerate(self.pages_verified_per_rank)
            )
            verified += f" ({per_rank})"
        body = [f"{name:<{width}}  {value}" for name, value in rows]
        return "\n".join([*head, "", *body, "", verified]) + "\n"

    def _shared_rows(self) -> list[tuple[str, str]]:
        """Return the table's rows of the shared tier (none without one)."""
        shared = self.shared
        if shared is None:
            return []
        failed = shared.promotion_failures + shared.write_failures + shared.no_room
        return [
            (
                "chunks loaded from CPU / shared",
                f"{self.chunks_loaded - shared.loaded_from_shared:,} / "
                f"{shared.loaded_from_shared:,}",
            ),
            (
                "shared tier asked / found",
                f"{shared.probes:,} / {shared.found:,} chunks",
            ),
            (
                "promoted shared->CPU",
                f"{shared.promoted:,} chunks, {_size(shared.promoted_bytes)}",
            ),
            (
                "written behind CPU->shared",
                f"{shared.written:,} chunks, {_size(shared.written_bytes)}",
            ),
            (
                "shared tier failures",
                f"{failed:,} chunks recomputed or not written ({shared.refused} refused, "
                f"{shared.timeouts} timeouts, {shared.errors} errors)",
            ),
        ]


def _size(nbytes: int) -> str:
    """Return `nbytes` in MB or GB (decimal), as bandwidths are quoted."""
    if nbytes >= 10**9:
        return f"{nbytes / 1e9:.2f} GB"
    return f"{nbytes / 1e6:.1f} MB"
