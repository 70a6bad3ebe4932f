"""`kvferry demo` reports the windowed chunks kvferry passes over because no lookup can load
them: none where every group shares one chunk grid, some for Llama-4-like local attention."""

from __future__ import annotations

import attrs

from kvferry.adapters.demo import DemoOptions, run_demo
from kvferry.adapters.demo_profiles import ProfileName
from kvferry.adapters.demo_report import DemoReport


def run(profile: ProfileName) -> DemoReport:
    return run_demo(DemoOptions(profile=profile, requests=16, seed=1))


def test_local_attention_chunks_closing_an_attention_chunk_are_not_stored() -> None:
    report = run(ProfileName.LLAMA4)
    assert 0 < report.windowed_chunks_not_stored < report.windowed_chunks_complete
    assert 0 < report.windowed_bytes_not_stored < report.windowed_bytes_complete


def test_a_window_on_the_full_groups_grid_keeps_every_chunk() -> None:
    report = run(ProfileName.GPT_OSS)
    assert report.windowed_chunks_complete > 0
    assert report.windowed_chunks_not_stored == 0


def test_the_table_reports_the_windowed_chunks_not_stored() -> None:
    report = attrs.evolve(
        run(ProfileName.LLAMA),
        windowed_chunks_complete=8,
        windowed_chunks_not_stored=2,
        windowed_bytes_complete=8 * 10**6,
        windowed_bytes_not_stored=2 * 10**6,
    )
    (row,) = [line for line in report.to_table().splitlines() if "not stored" in line]
    assert row.startswith("windowed chunks not stored")
    assert row.endswith("2 of 8 complete: saved 2.0 MB (25.0 %; in no window a lookup can load)")
