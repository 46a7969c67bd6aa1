"""`capsnet bench` user errors: one line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import pytest

from capsnet.cli import main


def test_bench_missing_model_is_a_one_line_error(tmp_path, capsys):
    assert main(["bench", str(tmp_path / "nothing.ckpt"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("capsnet bench: error: ") and "does not exist" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, message", [
    (["--batch-sizes", "1,0"], "expected integers from 1 to 1024"),
    (["--batch-sizes", "1,100000000"], "expected integers from 1 to 1024"),  # was a NumPy out-of-memory traceback
    (["--concurrency", "100000000"], "expected integers from 1 to 1024"),
    (["--concurrency", "four"], "expected comma-separated integers"),
    (["--backends", "onnxruntime-fp32,tflite"], "unknown backend tflite"),
])
def test_bench_bad_flags_are_refused_by_the_parser(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", str(tmp_path), *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.fixture
def no_measuring(monkeypatch):
    """A check that lets a bad value through fails the test here, instead of starting a benchmark."""
    from capsnet.bench import suite

    def run_bench(options):
        raise AssertionError("the benchmark started")

    monkeypatch.setattr(suite, "run_bench", run_bench)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("capsnet bench: error: ") and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("flags", [
    ["--seconds", "0"],
    ["--seconds", "inf"],  # ran forever
    ["--seconds", "nan"],  # was accepted
    ["--peak-seconds", "nan"],
    ["--grpc-seconds", "-1"],
])
def test_bench_bad_durations_are_refused(tmp_path, capsys, no_measuring, flags):
    assert main(["bench", str(tmp_path), *flags]) == 2
    assert f"{flags[0]} must be finite and > 0" in one_error_line(capsys)


def test_bench_out_that_is_a_file_is_refused_before_measuring(tmp_path, capsys, no_measuring):
    (tmp_path / "taken").write_text("")
    for out in (tmp_path / "taken", tmp_path / "taken" / "sub"):
        assert main(["bench", str(tmp_path), "--out", str(out)]) == 2
        assert "is not a directory" in one_error_line(capsys)


def test_bench_unwritable_out_is_refused_before_measuring(tmp_path, capsys, no_measuring, monkeypatch):
    import tempfile

    def read_only(*args, **kwargs):  # chmod cannot stop root, who runs the tests in the container
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    assert main(["bench", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "cannot write in" in one_error_line(capsys) and not (tmp_path / "out").exists()


def test_bench_refuses_an_em_model_before_exporting_it(tmp_path, capsys, random_checkpoint):
    from capsnet.training.config import preset

    path = random_checkpoint(preset("em-tiny"), "em.ckpt")
    assert main(["bench", str(path), "--out", str(tmp_path / "out"), "--quick"]) == 2
    err = capsys.readouterr().err
    assert err == f"capsnet bench: error: capsnet bench measures dynamic-routing CapsNets; {path} holds a model of --arch em\n"
    assert not (tmp_path / "out").exists()
