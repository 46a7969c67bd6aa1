"""`capsnet train` and `capsnet eval` end to end on the embedded digits with the tiny preset."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from capsnet.cli import main
from capsnet.training import train as train_module
from capsnet.models.checkpoint import load_checkpoint
from capsnet.training.data import load_embedded, to_float
from capsnet.training.history import EpochRecord
from capsnet.training.options import RunOptions, TrainOptions
from capsnet.training.run import learning_rate_scheduler

# Measured with the conftest command (tiny, 2 epochs, batch 64, seed 0, all 4,000 training digits): 73.5% test
# accuracy; with 400 of them held out for validation, 73.8%. Chance is 10%.
TINY_TWO_EPOCH_ACCURACY_FLOOR = 0.60
TRAIN_ARGS = ["train", "--data", "embedded", "--preset", "tiny", "--batch-size", "64", "--seed", "0", "--no-progress"]
FIXTURE_ARGS = [*TRAIN_ARGS, "--val-fraction", "0"]  # the conftest's trained_tiny_checkpoint


def stop_after_mid_epoch_checkpoint(monkeypatch, step: int = 40) -> None:
    """Make the next training run die (KeyboardInterrupt) right after its checkpoint `step` steps into epoch 2."""
    real_save = train_module.save_checkpoint

    def save_then_stop(checkpoint, path):
        real_save(checkpoint, path)
        if checkpoint.epoch == 1 and (checkpoint.epoch_progress or {}).get("step") == step:
            raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "save_checkpoint", save_then_stop)


def assert_same_weights(got, expected) -> None:
    for name, value in expected.state_dict.items():
        assert torch.equal(got.state_dict[name], value), name


@pytest.fixture(scope="module")
def validated_tiny_checkpoint(tmp_path_factory):
    """The conftest's run with the default validation split: 3,600 training and 400 validation digits."""
    path = tmp_path_factory.mktemp("validated-tiny") / "model.ckpt"
    assert main([*TRAIN_ARGS, "--epochs", "2", "--out", str(path)]) == 0
    return path


def test_tiny_model_beats_chance_by_a_wide_margin(trained_tiny_checkpoint, capsys):
    assert main(["eval", str(trained_tiny_checkpoint), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["images"] == 1000 and report["split"] == "test"
    assert report["accuracy"] >= TINY_TWO_EPOCH_ACCURACY_FLOOR
    # eval recomputes what training recorded for the same weights
    metrics = load_checkpoint(trained_tiny_checkpoint).metrics
    assert report["accuracy"] == metrics["test_accuracy"]
    assert report["loss"] == pytest.approx(metrics["test_loss"], rel=1e-5)
    assert report["per_class_accuracy"] == pytest.approx(metrics["test_per_class_accuracy"])
    confusion = torch.tensor(report["confusion_matrix"])
    assert confusion.shape == (10, 10) and confusion.sum() == 1000 and confusion.trace() == report["correct"]
    assert confusion.sum(dim=1).tolist() == [100] * 10  # rows are true classes


def test_eval_text_report(trained_tiny_checkpoint, capsys):
    assert main(["eval", str(trained_tiny_checkpoint), "--split", "train", "--batch-size", "500"]) == 0
    text = capsys.readouterr().out
    assert "train split" in text and "/4000)" in text
    assert "confusion matrix (rows: true class, columns: predicted class):" in text
    assert sum(line.rstrip().endswith("/400)") for line in text.splitlines()) == 10  # one line per class


def test_last_checkpoint_holds_the_whole_history(trained_tiny_checkpoint):
    last = load_checkpoint(trained_tiny_checkpoint.with_name("model.last.ckpt"))
    assert last.epoch == 2 and [record["epoch"] for record in last.history] == [1, 2]
    lrs = [record["lr"] for record in last.history]
    assert lrs == pytest.approx([1e-3, 1e-3 * 0.9])  # ExponentialLR, default --lr-decay 0.9
    # without a validation split nothing is selected: --out holds the last epoch
    assert load_checkpoint(trained_tiny_checkpoint).epoch == 2 and "validation_accuracy" not in last.history[-1]
    for record in last.history:
        assert record["train_images_per_second"] > 0 and 0 <= record["train_accuracy"] <= 1


def test_the_history_records_write_back_what_they_read(trained_tiny_checkpoint, validated_tiny_checkpoint):
    """Typed in training, a checkpoint's history is the same dicts on disk: the first format's lines (rate and
    training figures only) and this format's, with and without a validation split, keys in their order."""
    format_1 = Path(__file__).parent / "fixtures" / "checkpoint-format-1"
    lines = [record for path in sorted(format_1.glob("*.ckpt")) for record in load_checkpoint(path).history]
    for path in (trained_tiny_checkpoint, validated_tiny_checkpoint):
        lines += load_checkpoint(path.with_name("model.last.ckpt")).history
    assert {len(line) for line in lines} == {4, 9, 11}  # the first format's, without validation, with it
    for line in lines:
        written = EpochRecord.from_dict(line).to_dict()
        assert written == line and list(written) == list(line)


def test_the_best_epoch_is_chosen_on_validation_and_eval_scores_that_split(validated_tiny_checkpoint, capsys):
    last = load_checkpoint(validated_tiny_checkpoint.with_name("model.last.ckpt"))
    best = max(last.history, key=lambda record: record["validation_accuracy"])
    assert load_checkpoint(validated_tiny_checkpoint).epoch == best["epoch"]
    metrics = load_checkpoint(validated_tiny_checkpoint).metrics
    assert (metrics["train_images"], metrics["validation_images"], metrics["test_images"]) == (3600, 400, 1000)
    assert set(metrics["validation_per_class_accuracy"]) == set(metrics["test_per_class_accuracy"])
    assert main(["eval", str(validated_tiny_checkpoint), "--split", "train", "--batch-size", "1000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["images"] == 3600  # the training digits less the validation split
    assert main(["eval", str(validated_tiny_checkpoint), "--split", "validation", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["split"] == "validation" and report["validation_fraction"] == 0.1
    assert report["images"] == 400 and report["accuracy"] == metrics["validation_accuracy"]
    assert report["per_class_accuracy"] == pytest.approx(metrics["validation_per_class_accuracy"])
    assert torch.tensor(report["confusion_matrix"]).sum(dim=1).tolist() == [40] * 10  # stratified: 10% of each class


def test_the_test_split_never_chooses_the_best_checkpoint(validated_tiny_checkpoint, idx_dataset, tmp_path, capsys):
    """The same run with test labels that the best epoch's model gets all wrong saves the same best checkpoint."""
    best = load_checkpoint(validated_tiny_checkpoint)
    digits = load_embedded()
    with torch.no_grad():
        predicted = best.build_model()(to_float(digits.test.images)).probabilities.argmax(dim=1).numpy()  # (1000,)
    wrong = (predicted + 1) % 10
    directory = idx_dataset(digits.train.images[:, 0], digits.train.labels, digits.test.images[:, 0], wrong)
    out = tmp_path / "model.ckpt"
    assert main([*TRAIN_ARGS, "--epochs", "2", "--data", str(directory), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| validation loss " in printed and "| test loss " in printed
    chosen = best.metrics["validation_accuracy"]
    assert f"best validation accuracy {100 * chosen:.2f}% after epoch {best.epoch}" in printed
    corrupted = load_checkpoint(out)
    assert corrupted.epoch == best.epoch and corrupted.metrics["test_accuracy"] == 0.0
    assert_same_weights(corrupted, best)
    # chosen by the test split, the best would be another epoch: one that scores above 0 on these labels
    history = load_checkpoint(out.with_name("model.last.ckpt")).history
    assert max(record["test_accuracy"] for record in history) > 0.0
    clean = load_checkpoint(validated_tiny_checkpoint.with_name("model.last.ckpt")).history
    assert [r["validation_accuracy"] for r in history] == [r["validation_accuracy"] for r in clean]


def test_resume_refuses_another_validation_split(trained_tiny_checkpoint, copy_of, capsys):
    last = copy_of(trained_tiny_checkpoint.with_name("model.last.ckpt"))
    out = last.with_name("model.ckpt")
    assert main([*TRAIN_ARGS, "--epochs", "3", "--out", str(out), "--resume", str(last), "--val-fraction", "0.1"]) == 2
    assert "--val-fraction 0.1 (checkpoint: 0.0)" in capsys.readouterr().err


def test_a_checkpoint_from_before_the_validation_split_evaluates(trained_tiny_checkpoint, tmp_path, capsys):
    payload = torch.load(trained_tiny_checkpoint, weights_only=True)
    for key in ("validation_fraction", "validation_images"):
        del payload["metrics"][key]
    old = tmp_path / "old.ckpt"
    torch.save(payload, old)
    assert main(["eval", str(old), "--split", "train", "--batch-size", "1000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["images"] == 4000  # it trained on every training digit
    assert main(["eval", str(old), "--split", "validation"]) == 2
    assert f"checkpoint {old} was trained without a validation split" in capsys.readouterr().err


def test_resume_continues_the_same_run(trained_tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "model.ckpt"
    assert main([*FIXTURE_ARGS, "--epochs", "1", "--out", str(out)]) == 0
    assert main([*FIXTURE_ARGS, "--epochs", "2", "--out", str(out), "--resume"]) == 0
    assert "epoch 1/2" not in capsys.readouterr().out
    resumed = load_checkpoint(out.with_name("model.last.ckpt"))
    straight = load_checkpoint(trained_tiny_checkpoint.with_name("model.last.ckpt"))
    assert resumed.epoch == 2 and len(resumed.history) == 2
    # seeds derive from --seed and the epoch, and the optimizer state travels: the same weights as one run
    assert_same_weights(resumed, straight)
    assert resumed.metrics["test_accuracy"] == straight.metrics["test_accuracy"]


def test_resume_keeps_the_learning_rate_and_records_it(tmp_path, capsys):
    """The rate travels in the optimizer state, which a resume loads: another --lr would be ignored."""
    out = tmp_path / "model.ckpt"
    assert main([*FIXTURE_ARGS, "--epochs", "1", "--lr", "0.002", "--out", str(out)]) == 0
    assert main([*FIXTURE_ARGS, "--epochs", "2", "--lr", "0.05", "--out", str(out), "--resume"]) == 2
    assert "--resume continues the checkpoint's learning rate: --lr 0.05 (checkpoint: 0.002)" in capsys.readouterr().err
    # left out, it is the checkpoint's, and the metrics say so (not the default 0.001)
    assert main([*FIXTURE_ARGS, "--epochs", "2", "--out", str(out), "--resume"]) == 0
    resumed = load_checkpoint(out.with_name("model.last.ckpt"))
    assert resumed.metrics["initial_lr"] == 0.002
    assert [record["lr"] for record in resumed.history] == pytest.approx([0.002, 0.002 * 0.9])
    # given again, the same rate is accepted
    assert main([*FIXTURE_ARGS, "--epochs", "3", "--lr", "0.002", "--out", str(out), "--resume"]) == 0
    assert load_checkpoint(out.with_name("model.last.ckpt")).metrics["initial_lr"] == 0.002


def test_resume_mid_epoch_continues_the_same_run(trained_tiny_checkpoint, tmp_path, monkeypatch, capsys):
    out = tmp_path / "model.ckpt"
    last = out.with_name("model.last.ckpt")
    stop_after_mid_epoch_checkpoint(monkeypatch)  # killed right after the checkpoint at step 40 of epoch 2
    assert main([*FIXTURE_ARGS, "--epochs", "2", "--out", str(out), "--checkpoint-every", "20"]) == 130
    monkeypatch.undo()
    interrupted = load_checkpoint(last)
    assert interrupted.epoch == 1 and interrupted.epoch_progress["step"] == 40
    assert interrupted.metrics["steps_into_epoch"] == 40 and "test_accuracy" not in interrupted.metrics

    # the interrupted epoch's batches depend on these; a mid-epoch resume refuses to change them
    assert main([*FIXTURE_ARGS, "--epochs", "2", "--out", str(out), "--resume", "--batch-size", "32",
                 "--erase", "0.5"]) == 2
    assert (f"{last} stopped 40 steps into epoch 2; continuing that epoch needs its batches: "
            "--batch-size 32 (checkpoint: 64), --erase 0.5 (checkpoint: 0.0)") in capsys.readouterr().err

    payload = torch.load(last, weights_only=True)
    del payload["epoch_progress"]["batch_plan"]
    damaged = tmp_path / "damaged.ckpt"
    torch.save(payload, damaged)
    assert main([*FIXTURE_ARGS, "--epochs", "2", "--out", str(out), "--resume", str(damaged)]) == 2
    assert f"checkpoint {damaged} is damaged: its progress into epoch 2 is incomplete" in capsys.readouterr().err

    # every setting that fixes the epoch's batches is recorded: a plan without one is damaged, not guessed
    payload = torch.load(last, weights_only=True)
    del payload["epoch_progress"]["batch_plan"]["erase"]
    torch.save(payload, damaged)
    assert main([*FIXTURE_ARGS, "--epochs", "2", "--out", str(out), "--resume", str(damaged)]) == 2
    assert f"checkpoint {damaged} is damaged: its progress into epoch 2 is incomplete" in capsys.readouterr().err
    # and so is a checkpoint whose metrics lack a setting the run keeps
    payload = torch.load(last, weights_only=True)
    del payload["metrics"]["erase"], payload["metrics"]["lr_schedule"]
    torch.save(payload, damaged)
    assert main([*FIXTURE_ARGS, "--epochs", "2", "--out", str(out), "--resume", str(damaged)]) == 2
    assert f"checkpoint {damaged} is damaged: its metrics lack lr_schedule, erase" in capsys.readouterr().err

    assert main([*FIXTURE_ARGS, "--epochs", "2", "--out", str(out), "--resume"]) == 0
    assert "resuming epoch 2 after step 40" in capsys.readouterr().out
    resumed = load_checkpoint(last)
    straight = load_checkpoint(trained_tiny_checkpoint.with_name("model.last.ckpt"))
    assert resumed.epoch == 2 and resumed.epoch_progress is None
    # the same batches, shifts and optimizer steps as the uninterrupted run: identical weights
    assert_same_weights(resumed, straight)
    # and the interrupted epoch's training figures count the steps before the interruption
    for key in ("train_loss", "train_accuracy", "test_accuracy"):
        assert resumed.history[1][key] == straight.history[1][key], key


@pytest.fixture(scope="module")
def deterministic_cuda():
    """CUDA kernels that give the same bits on every run, so two CUDA runs can be compared exactly."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition for reproducible matmuls
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(False)


@pytest.fixture(scope="module")
def cuda_amp_run(deterministic_cuda, tmp_path_factory):
    out = tmp_path_factory.mktemp("cuda-amp") / "cuda.ckpt"
    assert main([*TRAIN_ARGS, "--epochs", "2", "--device", "cuda", "--amp", "--out", str(out)]) == 0
    return out


@pytest.mark.gpu
def test_cuda_mixed_precision_training(cuda_amp_run):
    metrics = load_checkpoint(cuda_amp_run).metrics
    assert metrics["device"] == "cuda" and metrics["amp"] is True
    # fp16 with gradient scaling learns like the CPU runs (73-74%); it rounds otherwise than bf16, hence the wider
    # margin
    assert metrics["test_accuracy"] >= 0.5
    assert load_checkpoint(cuda_amp_run.with_name("cuda.last.ckpt")).scaler_state["scale"] > 0


@pytest.mark.gpu
def test_cuda_mixed_precision_resume_mid_epoch_keeps_the_loss_scale(cuda_amp_run, tmp_path, monkeypatch, capsys):
    out = tmp_path / "cuda.ckpt"
    last = out.with_name("cuda.last.ckpt")
    cuda_args = [*TRAIN_ARGS, "--epochs", "2", "--device", "cuda", "--amp", "--out", str(out)]
    stop_after_mid_epoch_checkpoint(monkeypatch)
    assert main([*cuda_args, "--checkpoint-every", "20"]) == 130
    monkeypatch.undo()
    assert load_checkpoint(last).scaler_state["scale"] > 0
    assert main([*cuda_args, "--resume"]) == 0
    assert "resuming epoch 2 after step 40" in capsys.readouterr().out
    resumed = load_checkpoint(last)
    straight = load_checkpoint(cuda_amp_run.with_name("cuda.last.ckpt"))
    # fp16 gradients are scaled before they are rounded: a loss scale restarted at its default would change them
    assert resumed.scaler_state == straight.scaler_state
    assert_same_weights(resumed, straight)


def test_the_linear_schedule_warms_up_then_falls_towards_zero():
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.Adam([weight], lr=0.01)
    given = TrainOptions(epochs=3, lr_schedule="linear", warmup=0.1)
    options = RunOptions.completed(given, {})
    scheduler = learning_rate_scheduler(optimizer, options, steps_per_epoch=10)  # 30 steps, 3 rising
    rates = []
    for _ in range(30):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates[:3] == pytest.approx([0.01 / 3, 0.02 / 3, 0.01])
    assert max(rates) == pytest.approx(0.01) and rates[-1] == pytest.approx(0.01 / 27)
    falls = [earlier - later for earlier, later in itertools.pairwise(rates[3:])]
    assert falls == pytest.approx([0.01 / 27] * 26)  # a straight line from the peak to 0 one step past the end


@pytest.fixture(scope="module")
def linear_schedule_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("linear-tiny") / "model.ckpt"
    assert main([*FIXTURE_ARGS, "--epochs", "2", "--lr-schedule", "linear", "--out", str(path)]) == 0
    return path


def test_a_linear_schedule_resumes_mid_epoch_and_keeps_its_length(linear_schedule_run, tmp_path, monkeypatch, capsys):
    straight = load_checkpoint(linear_schedule_run.with_name("model.last.ckpt"))
    schedule = (straight.metrics["lr_schedule"], straight.metrics["warmup"], straight.metrics["epochs"])
    assert schedule == ("linear", 0.1, 2)
    assert straight.metrics["lr_decay"] is None
    assert main([*FIXTURE_ARGS, "--epochs", "3", "--out", str(linear_schedule_run), "--resume"]) == 2
    assert "has finished its linear learning-rate schedule (the rate fell to 0 in epoch 2)" in capsys.readouterr().err
    out = tmp_path / "model.ckpt"
    args = [*FIXTURE_ARGS, "--lr-schedule", "linear", "--out", str(out)]
    stop_after_mid_epoch_checkpoint(monkeypatch)
    assert main([*args, "--epochs", "2", "--checkpoint-every", "20"]) == 130
    monkeypatch.undo()
    # the rate reaches 0 at the end of the planned epochs, so the plan cannot change on the way
    for flags, message in ((["--epochs", "3"], "ends after epoch 2; resume it with --epochs 2"),
                           (["--epochs", "2", "--lr-schedule", "exponential"],
                            "--lr-schedule exponential (checkpoint: linear)"),
                           (["--epochs", "2", "--warmup", "0.2"], "--warmup 0.2 (checkpoint: 0.1)")):
        assert main([*args, *flags, "--resume"]) == 2
        assert message in capsys.readouterr().err
    # the schedule is the checkpoint's without --lr-schedule, and its steps go on where they stopped
    assert main([*FIXTURE_ARGS, "--epochs", "2", "--out", str(out), "--resume"]) == 0
    assert "resuming epoch 2 after step 40" in capsys.readouterr().out
    assert_same_weights(load_checkpoint(out.with_name("model.last.ckpt")), straight)
