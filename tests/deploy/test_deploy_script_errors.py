"""User mistakes with deploy/loadtest.py and deploy/local_stack.py: one line and exit code 2, never a traceback or a
run that does not end. (What they do when used right is checked against a live stack in test_deploy_topology.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from deploy_support import DEPLOY, free_port


def loadtest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DEPLOY / "loadtest.py"), *args], capture_output=True, text=True,
                          timeout=60)


def test_deploy_loadtest_without_a_server_is_a_one_line_error():
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    result = loadtest("--server", address, "--duration", "1", "--warmup", "0")
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.startswith(f"loadtest: {address}: UNAVAILABLE: ") and len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize("flags", [["--duration", "inf"], ["--duration", "nan"], ["--warmup", "inf"],
                                   ["--warmup", "nan"]])
def test_deploy_loadtest_refuses_durations_that_never_end_or_mean_nothing(flags):
    # infinity sent requests for ever; NaN sent none and printed an empty result (exit 1)
    result = loadtest("--server", f"127.0.0.1:{free_port()}", *flags)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--duration a finite number > 0, --warmup finite and >= 0" in result.stderr.splitlines()[-1]


def test_deploy_local_stack_unusable_workdir_is_a_one_line_error(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.json").write_text("{}")  # passes the script's own check; nothing starts anyway
    (tmp_path / "file").write_text("")
    result = subprocess.run([sys.executable, str(DEPLOY / "local_stack.py"), "--model", str(tmp_path / "model"),
                             "--no-prometheus", "--workdir", str(tmp_path / "file" / "sub")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines()[-1] == (f"local_stack.py: error: --workdir {tmp_path / 'file' / 'sub'}: "
                                              "Not a directory")
