"""tests/reaped.py: a command's detached descendants (torchrun starts each rank in a session of its
own) are ended when it returns, and when its time is up (they hold its output pipes too)."""

import subprocess
import sys

import pytest

from reaped import run_reaped

_DETACHED = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import "
             "signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(1000)'], "
             "start_new_session=True); time.sleep({})")


def test_detached_children_are_ended_when_the_command_exits():
    run = run_reaped([sys.executable, "-c", _DETACHED.format(5)], timeout=120)
    assert run.returncode == 0 and run.descendants
    assert not any(p.is_running() for p in run.descendants)


def test_detached_children_are_ended_when_the_time_is_up():
    with pytest.raises(subprocess.TimeoutExpired):
        run_reaped([sys.executable, "-c", _DETACHED.format(1000)], timeout=3)
    # the helper's own record of the children is gone with the exception: look for survivors
    survivors = subprocess.run(["pgrep", "-f", "signal.SIG_IGN); time.sleep(1000)"],
                               capture_output=True, text=True).stdout.split()
    assert not survivors, survivors
