"""Signals: SIGTERM mid-run leaves the folder marked incomplete and no temp files; an interrupt
that surfaces wrapped in another error is still an interrupt."""
from __future__ import annotations

from pathlib import Path

from support import SMALL


def test_sigterm_mid_run_leaves_incomplete_and_no_temp_files(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from sim.output.run_dir import INCOMPLETE

    out = tmp_path / "out"
    path = tmp_path / "s.yaml"
    path.write_text(SMALL.replace("num_requests: 4", "num_requests: 200000").replace("output_len: 4", "output_len: 64"))
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "sim.cli", str(path), "--out", str(out), "--quiet"], cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)}, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120          # a bound for a stuck start, not a timing assumption
    while not (out / INCOMPLETE).exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None and (out / INCOMPLETE).exists()     # our handler is in place from here on
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    # communicate() returning means every process holding stderr (the figure workers) has ended
    assert proc.returncode == 130, err[-500:]
    assert (out / INCOMPLETE).exists() and not list(out.rglob("*.tmp"))
    assert "Traceback" not in err and "Exception ignored" not in err, err[-500:]


def test_an_interrupt_surfacing_wrapped_in_another_error_is_still_an_interrupt(monkeypatch, capsys):
    # An error after a signal asked to stop (a worker process that ended, say) is part of the
    # interruption: the run ends as interrupted (130), not as a crash.
    import sim.cli
    from sim import stop

    def interrupted_inside_an_import(*_):
        stop._asked = "SIGTERM"
        raise RuntimeError("Error calling __set_name__ on 'Field' instance 'fields' in 'Task'")

    monkeypatch.setattr(stop, "_asked", None)
    monkeypatch.setattr(sim.cli, "run_command", interrupted_inside_an_import)
    assert sim.cli.main(["whatever.yaml"]) == 130
    assert "interrupted" in capsys.readouterr().err
