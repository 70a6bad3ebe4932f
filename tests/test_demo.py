"""`kvferry demo` end to end on the cpu executor: every profile passes, faults are caught."""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path
from typing import Any

import attrs
import pytest

from kvferry.adapters import cli
from kvferry.adapters import demo as demo_module
from kvferry.adapters.config import KvferryConfig
from kvferry.adapters.demo import DemoOptions, ProgressBar, run_demo, tier_shortfall
from kvferry.adapters.demo_profiles import PROFILES, ProfileName, check_profile
from kvferry.adapters.demo_report import DemoReport
from kvferry.adapters.demo_verify import VerificationFailedError
from kvferry.core.bound import BoundPlan
from kvferry.core.errors import InvalidInputError
from kvferry.core.expand import expand_pages
from kvferry.core.plan import Direction
from kvferry.executors.cpu import CpuExecutor

REQUESTS = 24


def run(profile: ProfileName, **options: Any) -> DemoReport:
    return run_demo(DemoOptions(profile=profile, requests=REQUESTS, seed=1), **options)


@pytest.fixture(scope="module", params=list(ProfileName), ids=lambda p: p.value)
def report(request: pytest.FixtureRequest) -> DemoReport:
    profile: ProfileName = request.param
    return run(profile)


def test_every_profile_serves_every_request(report: DemoReport) -> None:
    assert report.requests == REQUESTS


def test_every_profile_loads_from_the_cpu_tier_and_verifies_the_pages(report: DemoReport) -> None:
    assert report.loaded_tokens > 0
    assert report.bytes_loaded > 0
    assert report.pages_verified > 0


def test_every_profile_evicts_gpu_blocks_and_stores_chunks(report: DemoReport) -> None:
    assert report.gpu_evictions > 0
    assert report.chunks_stored > 0
    assert report.bytes_stored > 0


def test_prompt_tokens_split_into_gpu_hits_loads_and_recomputation(report: DemoReport) -> None:
    parts = report.gpu_hit_tokens + report.loaded_tokens + report.recomputed_tokens
    assert parts == report.prompt_tokens
    assert min(report.gpu_hit_tokens, report.loaded_tokens, report.recomputed_tokens) >= 0


def test_the_table_ends_with_all_pages_verified(report: DemoReport) -> None:
    table = report.to_table()
    assert table.rstrip().endswith(f"all {report.pages_verified} pages verified")
    for row in ("prompt tokens", "loaded from CPU tier", "recomputed", "GPU prefix-cache hits"):
        assert row in table


def test_windowed_groups_load_less_than_every_block_of_the_hit() -> None:
    report = run(ProfileName.GPT_OSS)
    assert 0 < report.windowed_bytes_loaded < report.windowed_bytes_all_blocks
    assert "saved" in report.to_table()


def test_full_attention_profile_has_no_window_savings_line() -> None:
    report = run(ProfileName.LLAMA)
    assert report.windowed_bytes_all_blocks == 0
    assert "windowed groups loaded" not in report.to_table()


def test_the_same_seed_gives_the_same_counts() -> None:
    first, second = run(ProfileName.LLAMA), run(ProfileName.LLAMA)
    keep = {"wall_seconds", "store_seconds", "load_seconds"}
    same = [a.name for a in attrs.fields(DemoReport) if a.name not in keep]
    assert all(getattr(first, name) == getattr(second, name) for name in same)


# -- faults are caught ----------------------------------------------------------------------------


class _FlipTierByte(CpuExecutor):
    """Flips one byte of the first row a load reads, before copying it."""

    flipped = False

    def _enqueue(self, bound: BoundPlan) -> float:
        if bound.plan.direction is Direction.LOAD and not _FlipTierByte.flipped:
            _FlipTierByte.flipped = True
            offset = int(expand_pages(bound, self.layout, self.host_tier.tier).cpu_offset[0]) + 5
            self.host_tier.array[offset] ^= 0x01
        return super()._enqueue(bound)


class _SwapDestinations(CpuExecutor):
    """Writes a load's first two pages into each other's GPU blocks."""

    def submit(self, bound: BoundPlan) -> int:
        plan = bound.plan
        if plan.direction is Direction.LOAD and len(plan.gpu_block_ids) >= 2:
            ids = plan.gpu_block_ids.copy()
            ids[[0, 1]] = ids[[1, 0]]
            plan = type(plan)(
                request_id=plan.request_id,
                direction=plan.direction,
                blocks_per_chunk=plan.blocks_per_chunk,
                keys=plan.keys,
                gpu_block_ids=ids,
                group_sizes=plan.group_sizes,
                block_indices=plan.block_indices,
            )
            bound = BoundPlan(
                job_id=bound.job_id,
                plan=plan,
                cpu_rows=bound.cpu_rows,
                layout_fingerprint=bound.layout_fingerprint,
            )
        return super().submit(bound)


def test_one_flipped_tier_byte_fails_the_run() -> None:
    _FlipTierByte.flipped = False
    with pytest.raises(VerificationFailedError) as caught:
        run(ProfileName.LLAMA, executor_factory=lambda name, **kw: _FlipTierByte(**kw))
    assert _FlipTierByte.flipped
    assert caught.value.byte_offset == 0  # byte 5 lies in the page's first 8-byte word
    assert "differs from its expected bytes" in str(caught.value)


def test_a_load_into_the_wrong_gpu_block_fails_the_run() -> None:
    with pytest.raises(VerificationFailedError):
        run(ProfileName.LLAMA, executor_factory=lambda name, **kw: _SwapDestinations(**kw))


def test_the_command_exits_1_when_a_page_does_not_verify(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def corrupted(options: DemoOptions, **_: Any) -> DemoReport:
        return run(options.profile, executor_factory=lambda name, **kw: _FlipTierByte(**kw))

    _FlipTierByte.flipped = False
    monkeypatch.setattr(demo_module, "run_demo", corrupted)
    assert cli.main(["demo", "--no-progress"]) == cli.EXIT_FAILED
    assert "FAILED" in capsys.readouterr().err


# -- the command line -----------------------------------------------------------------------------


def test_the_command_prints_the_table_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--requests", "16", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert out.rstrip().splitlines()[-1].startswith("all ")
    assert out.rstrip().endswith("pages verified")
    assert err == ""


def test_the_command_prints_json_with_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--requests", "16", "--no-progress", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["requests"] == 16
    assert data["verified"] == f"all {data['pages_verified']} pages verified"


def test_a_run_that_verifies_no_page_exits_1_with_one_line_on_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["demo", "--requests", "2", "--no-progress"]) == cli.EXIT_FAILED
    out, err = capsys.readouterr()
    assert out.rstrip().endswith("no page verified: nothing was loaded from the CPU tier")
    (line,) = err.splitlines()
    assert line.startswith("kvferry: FAILED: no page verified")


def test_a_tier_smaller_than_one_prefill_steps_chunks_warns_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cli.main(["demo", "--requests", "2", "--no-progress", "--cpu-tier-bytes", "8MiB"])
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [
        "kvferry: warning: the CPU tier holds 8 chunk(s) of group 0, fewer than the 32 a "
        "2048-token prefill step completes; a store takes all of a step's chunks or none, so such "
        "steps store nothing (a larger --cpu-tier-bytes stores them)"
    ]


def test_every_profile_s_default_tier_holds_a_prefill_steps_chunks() -> None:
    for profile in PROFILES.values():
        report = run_demo(DemoOptions(profile=profile.name, requests=1))
        offload = profile.offload_config(report.blocks_per_chunk, store_decoded_tokens=True)
        assert tier_shortfall(profile, offload, report.cpu_tier_rows) is None, profile.name


def test_the_shortfall_is_the_chunks_of_one_full_prefill_step() -> None:
    profile = PROFILES[ProfileName.LLAMA]  # 2048-token steps, 16-token blocks
    offload = profile.offload_config(4, store_decoded_tokens=True)  # 64-token chunks
    assert tier_shortfall(profile, offload, 32) is None
    assert "fewer than the 32" in str(tier_shortfall(profile, offload, 31))


def test_the_shortfall_names_the_group_whose_rows_are_short() -> None:
    profile = PROFILES[ProfileName.GPT_OSS]
    offload = profile.offload_config(4, store_decoded_tokens=True)
    need = -(-profile.step_tokens // offload.chunk_tokens(1))
    assert tier_shortfall(profile, offload, (need, need)) is None
    assert "of group 1" in str(tier_shortfall(profile, offload, (need, need - 1)))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_draws_on_a_terminal() -> None:
    stream = _Terminal()
    bar = ProgressBar(stream)
    bar(2, 4, 7)
    bar.close()
    assert "/4 [" in stream.getvalue()  # tqdm's "n/total [elapsed<remaining, rate]"
    assert "request" in stream.getvalue()


def test_the_progress_bar_writes_nothing_to_a_log() -> None:
    stream = io.StringIO()
    bar = ProgressBar(stream)
    bar(2, 4, 7)
    bar.close()
    assert stream.getvalue() == ""


def test_the_command_draws_no_progress_when_stderr_is_not_a_terminal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["demo", "--requests", "16"]) == 0
    assert capsys.readouterr().err == ""


def test_the_command_takes_settings_from_a_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "kvferry.toml"
    path.write_text('eviction_policy = "arc"\ncpu_tier_bytes = "64MiB"\n', encoding="utf-8")
    assert cli.main(["demo", "--requests", "16", "--no-progress", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "eviction arc" in out
    assert "CPU tier: 67.1 MB, eviction arc; chunks per group:" in out
    assert "group 0 (full_attention): 64 chunks of 1.0 MB" in out


def test_an_unknown_profile_exits_2_and_suggests_a_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--profile", "lama", "--no-progress"]) == cli.EXIT_INPUT
    assert "did you mean 'llama'" in capsys.readouterr().err


def test_a_tier_smaller_than_one_row_is_refused() -> None:
    config = KvferryConfig.from_mapping({"cpu_tier_bytes": 1000})
    with pytest.raises(InvalidInputError, match="cpu_tier_bytes"):
        run_demo(DemoOptions(requests=2, config=config))


def test_the_plan_command_still_prints_a_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    scenario = Path(__file__).parent / "golden" / "two_full_groups_design_example.scenario.json"
    assert cli.main(["plan", str(scenario)]) == 0
    assert '"schema_version": 1' in capsys.readouterr().out


# -- the torch executor's copy path, on cpu tensors -----------------------------------------------


def _torch_on_cpu() -> Any:
    pytest.importorskip("torch")
    path = Path(__file__).parent / "executors" / "_torch_on_cpu.py"
    spec = importlib.util.spec_from_file_location("_torch_on_cpu_for_demo", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TorchOnCpuExecutor


@pytest.mark.parametrize("profile", [ProfileName.GPT_OSS, ProfileName.JAMBA], ids=lambda p: p.value)
def test_torch_tensors_and_the_torch_copy_path_verify(profile: ProfileName) -> None:
    executor = _torch_on_cpu()
    report = run_demo(
        DemoOptions(profile=profile, requests=20, seed=0),
        executor_factory=lambda name, **kw: executor(**kw),
        torch_device="cpu",
    )
    assert report.pages_verified > 0


def test_every_profile_passes_its_shape_checks() -> None:
    for profile in PROFILES.values():
        check_profile(profile)


def test_a_page_that_is_not_whole_words_is_refused() -> None:
    profile = PROFILES[ProfileName.GPT_OSS]
    odd = attrs.evolve(profile.groups[0], kv_heads=1, head_dim=63)
    with pytest.raises(InvalidInputError, match="multiple of 8"):
        check_profile(attrs.evolve(profile, groups=(odd, profile.groups[1])))


@pytest.mark.parametrize("profile", [ProfileName.LLAMA, ProfileName.JAMBA], ids=lambda p: p.value)
def test_long_answers_in_a_small_pool_preempt_and_still_verify(
    profile: ProfileName, monkeypatch: pytest.MonkeyPatch
) -> None:
    tight = attrs.evolve(
        PROFILES[profile],
        gpu_blocks=120 if profile is ProfileName.LLAMA else 30,
        answer_tokens=(300, 600),
        system_prompt_tokens=(100, 300),
    )
    monkeypatch.setitem(PROFILES, profile, tight)
    report = run_demo(DemoOptions(profile=profile, requests=16, seed=1))
    assert report.preemptions > 0
    assert report.requests == 16
    assert report.pages_verified > 0
