"""The first start's one time-left estimate across its phases (subspec.progress) and the plan's prediction of it."""
from __future__ import annotations

import io

import pytest

from subspec import progress
from subspec.loading import open_model
from subspec.plan import first_start_work, make_plan
from subspec.runtime import Options, load

from conftest import save_tiny, tiny_config


def test_time_left_is_the_running_phase_by_its_rate_plus_the_rest_scaled_by_the_phases_done(monkeypatch):
    """Predicted conversion 10 s, substitutes 20 s, calibration 10 s. Half-way through the conversion after 5 s: 5 s
    of it left plus 30 s. The conversion took 8 s (0.8 of its prediction): the phases to come are scaled by 0.8. A
    phase 5 % done runs on its own rate. A phase that showed no bar (coding here) is over when a later one begins."""
    now = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    start = progress.StartProgress({"conversion": 10, "substitutes": 20, "coding": 4, "calibration": 10})
    assert start.left() == pytest.approx(44)
    start.begin("conversion")
    now[0] = 5.0
    start.progress(0.5)
    assert start.left() == pytest.approx(5 + 20 + 4 + 10)
    now[0] = 8.0
    start.begin("substitutes")  # the conversion ends at 8 s
    assert start.scale() == pytest.approx(0.8)
    assert start.left() == pytest.approx(0.8 * (20 + 4 + 10))
    now[0] = 9.0
    start.progress(0.02)  # too little done to trust its own rate: the scaled prediction, less the time spent
    assert start.left() == pytest.approx(0.8 * 20 - 1 + 0.8 * (4 + 10))
    now[0] = 12.0
    start.progress(0.25)  # 4 s for a quarter: 12 s left of it
    assert start.left() == pytest.approx(12 + 0.8 * (4 + 10))
    now[0] = 24.0
    start.begin("calibration")  # substitutes took 16 s (0.8 again); coding showed no bar: over, out of the scale
    assert start.actual["coding"] == 0 and start.scale() == pytest.approx(0.8)
    assert start.left() == pytest.approx(0.8 * 10)
    start.end()
    assert start.left() == 0


def test_a_first_start_shows_the_whole_starts_time_left_and_a_second_start_has_nothing_to_do(tmp_path, monkeypatch,
                                                                                              capsys):
    """The plan predicts every phase of a first start (`subspec plan` prints the total); a load of an empty cache runs
    its phases with bars that say the whole start's time left; afterwards nothing is pending."""
    monkeypatch.setenv("SUBSPEC_CACHE", str(tmp_path / "cache"))
    path = save_tiny(tmp_path / "m", tiny_config("llama", False, vocab=128, layers=6))
    opts = Options(model=str(path), dtype="float32", max_context=128, device_memory=1 << 30, max_resident=2, topk=2)
    plan = make_plan(opts, open_model(path, convert=False))
    whole = dict(plan.first_start)
    assert {"content digest", "substitutes", "calibration"} <= set(whole) and all(s > 0 for s in whole.values())
    assert "first start: about" in plan.describe()
    pending = first_start_work(plan, open_model(path, convert=False))
    assert set(pending) == {"content digest", "substitutes", "packing", "calibration"}
    rt = load(opts, plan=plan)
    rt.close()
    err = capsys.readouterr().err
    assert "quantizing substitutes" in err and "first start: ~" in err and "calibrating" in err
    assert first_start_work(plan, open_model(path, convert=False)) == {}
    rt = load(opts, plan=plan)
    rt.close()
    assert "first start: ~" not in capsys.readouterr().err


def test_a_phase_of_unequal_items_counts_the_weight_done_not_the_items(monkeypatch):
    """Calibration measures four quick draft steps (1 s each), then verifies of 8 s: after the first verify (12 s in,
    5 of 9 items) the time left is the four verifies to come (32 s), not the item rate's 9.6 s (the 7B's bar said
    "~9 s left" with 30 s to go). A plain tqdm ignores the weights."""
    now = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    start = progress.StartProgress({"calibration": 20})
    b = start.bar("calibration", total=9, file=io.StringIO())  # a real bar, written to a string
    for _ in range(4):
        now[0] += 1.0
        b.update(1)
    assert start.left() == pytest.approx(4.0 * 5 / 4)  # uniform until a verify is measured
    now[0] += 8.0
    progress.weigh(b, [1, 1, 1, 1, 8, 8, 8, 8, 8])
    b.update(1)
    assert start.left() == pytest.approx(32.0)
    b.close()
    progress.weigh(progress.tqdm(disable=True), [1, 2])  # no error, no effect
