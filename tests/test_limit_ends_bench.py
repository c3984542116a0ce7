"""`benchmarks.limit_ends` on a small HF Qwen3 stack: at no checkpointing's measured rise every
block runs plain within it; at must-only's plus a tenth of the gap the first planned step stays
under the limit, uses most of the headroom and is predicted at most 1% above what it metered.
Memory only: the benchmark's times are ratios printed for the note, never asserted."""

import pytest
import torch

from benchmarks.limit_ends import main, planned, rise
from benchmarks.plan_stability import _fresh, _step
from benchmarks.steady_state import hf_stack


@pytest.mark.slow
@pytest.mark.bench
def test_plans_spend_the_limit_between_must_only_and_no_checkpointing() -> None:
    torch.set_num_threads(1)
    _, _, seq, batch = hf_stack(64)
    ids = torch.randint(0, 1024, (batch, seq), generator=torch.Generator().manual_seed(0))
    rises = {}
    for checkpointed in (False, True):
        model = _fresh(64, checkpointed=checkpointed)
        _step(model, ids)
        rises[checkpointed] = rise(lambda m=model: _step(m, ids))
    none, must = rises[False], rises[True]
    assert must < none

    at_none = planned(64, ids, none)
    assert at_none.plan.regions["Qwen3DecoderLayer"].block_entries() == ["plain"] * 4
    assert at_none.metered <= none

    allowed = must + (none - must) // 10
    between = planned(64, ids, allowed)
    assert between.metered <= allowed
    assert between.metered - must >= 0.85 * (allowed - must)  # headroom used
    assert between.metered <= between.predicted <= 1.01 * between.metered


@pytest.mark.slow
@pytest.mark.bench
def test_limit_ends_prints_a_row_per_limit(capsys, monkeypatch) -> None:
    monkeypatch.setattr(
        "sys.argv", ["limit_ends", "--hidden", "64", "--rounds", "1", "--reps", "1"]
    )
    main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 64 |")]
    assert len(rows) == 3
    assert "[P,P,P,P]" in rows[0] and "vs none" in rows[0] and "vs full" in rows[1]
    assert "headroom used" in rows[2]
