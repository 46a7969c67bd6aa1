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
    (["--batch-sizes", "1,0"], "expected positive integers"),
    (["--concurrency", "four"], "expected comma-separated integers"),
    (["--backends", "onnxruntime-fp32,tflite"], "unknown backend tflite"),
])
def test_bench_bad_flags_are_refused_by_the_parser(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", str(tmp_path), *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_non_positive_durations_are_refused(tmp_path, capsys):
    assert main(["bench", str(tmp_path), "--seconds", "0"]) == 2
    assert "--seconds must be > 0" in capsys.readouterr().err


def test_bench_refuses_an_em_model_before_exporting_it(tmp_path, capsys, random_checkpoint):
    from capsnet.training.config import preset

    path = random_checkpoint(preset("em-tiny"), "em.ckpt")
    assert main(["bench", str(path), "--out", str(tmp_path / "out"), "--quick"]) == 2
    err = capsys.readouterr().err
    assert err == f"capsnet bench: error: capsnet bench measures dynamic-routing CapsNets; {path} holds a model of --arch em\n"
    assert not (tmp_path / "out").exists()
