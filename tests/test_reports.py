"""Fidelity regression: today's simulator must still predict every committed measurement
(reports/<device>/<scenario>/) within the tolerance band recorded beside it."""
import pytest

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
