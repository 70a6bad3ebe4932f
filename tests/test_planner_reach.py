"""Which windowed chunks a configuration keeps: those in the window of some boundary a lookup
can answer (docs/semantics.md, "Which windowed chunks are stored")."""

from __future__ import annotations

from kvferry.core import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.reach import MAX_PERIOD

FULL16 = GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16)


def config(*groups: GroupSpec, hash_block_size: int = 4) -> OffloadConfig:
    return OffloadConfig(hash_block_size=hash_block_size, blocks_per_chunk=1, groups=groups)


def kept(config: OffloadConfig, group: int, count: int) -> list[int]:
    return [j for j in range(count) if config.keeps_chunk(group, j)]


def test_a_window_on_the_full_groups_grid_keeps_every_chunk() -> None:
    window = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=128)
    assert config(FULL16, window).keeps_every_chunk(1)


def test_a_finer_window_keeps_the_chunks_before_each_full_chunk_end() -> None:
    window = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=4, sliding_window=9)
    assert kept(config(FULL16, window), 1, 12) == [2, 3, 6, 7, 10, 11]


def test_retained_tokens_widen_the_kept_windows() -> None:
    window = GroupSpec(
        kind=GroupKind.SLIDING_WINDOW, block_size=4, sliding_window=9, extra_retained_tokens=4
    )
    assert kept(config(FULL16, window), 1, 8) == [1, 2, 3, 5, 6, 7]


def test_finer_mamba_keeps_the_states_at_full_chunk_ends() -> None:
    mamba = GroupSpec(kind=GroupKind.MAMBA, block_size=4)
    assert kept(config(FULL16, mamba), 1, 12) == [3, 7, 11]


def test_a_window_alone_keeps_every_chunk_on_its_own_grid() -> None:
    window = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=4, sliding_window=9)
    assert config(window).keeps_every_chunk(0)


def test_full_attention_keeps_every_chunk() -> None:
    window = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=4, sliding_window=9)
    assert config(FULL16, window).keeps_every_chunk(0)


def test_grids_repeating_beyond_the_limit_keep_every_chunk() -> None:
    coarse = GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=MAX_PERIOD + 1)
    window = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=2, sliding_window=3)
    assert config(coarse, window, hash_block_size=1).keeps_every_chunk(1)
