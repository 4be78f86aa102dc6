"""Fidelity regression: today's simulator must still predict every committed measurement
(reports/<device>/<scenario>/) within the tolerance band recorded beside it."""
import pandas as pd
import pytest

from sim.predict import predict
from validate.compare import check_within
from validate.regression import REPORTS, report_folders, repredict

FOLDERS = report_folders()


@pytest.mark.parametrize("folder", FOLDERS, ids=[str(f.relative_to(REPORTS)) for f in FOLDERS])
def test_committed_measurement_is_still_predicted(folder):
    table, _ = repredict(folder)
    assert table["tolerance"].notna().any(), "a report without tolerances checks nothing"
    assert not check_within(table), "\n".join(check_within(table))


def test_there_are_committed_measurements():
    assert FOLDERS, "reports/ holds no measured runs with tolerances"


# Every request arrives at t=0, so each step's composition is policy, not timing: the engine's
# steps must be the simulator's, row for row (a static batch's padding rows included).
AT_T0 = [f for f in FOLDERS if f.parent.name == "seed_static_vs_continuous"]
STEP_POLICY = ["num_seqs", "decode_seqs", "prefill_tokens", "batch_tokens", "kv_blocks_used"]


@pytest.mark.parametrize("folder", AT_T0, ids=[str(f.relative_to(REPORTS)) for f in AT_T0])
def test_committed_step_composition_is_predicted_exactly(folder):
    _, scenario = repredict(folder)
    predicted = predict(scenario).steps[STEP_POLICY].reset_index(drop=True)
    measured = pd.read_csv(folder / "measured" / "steps.csv")[STEP_POLICY]
    pd.testing.assert_frame_equal(measured, predicted, check_dtype=False)


def test_the_static_measurement_holds_padding_rows():
    assert any(f.name == "static" for f in AT_T0)
    steps = pd.read_csv(REPORTS / "cpu" / "seed_static_vs_continuous" / "static" / "measured" / "steps.csv")
    assert (steps["num_seqs"] == 2).all() and len(steps) == 1000      # two rows until 500 tokens end
