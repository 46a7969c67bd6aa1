"""Checkpoints: bit-identical round trip, the metadata training records, clear errors for bad files, no litter."""

from __future__ import annotations

import pickletools
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from capsnet.errors import CapsNetError
from capsnet.models.checkpoint import FORMAT_VERSION, load_checkpoint
from capsnet.training.checkpoint import remove_leftover_temporaries, save_checkpoint
from capsnet.training.distributed import DistributedContext
from capsnet.training.train import prepare_output
from capsnet.training.data import load_embedded, to_float

# Checkpoints that an earlier capsnet-serve wrote, when the models lived in capsnet.training (their README.md)
FORMAT_1_CHECKPOINTS = Path(__file__).parent / "fixtures" / "checkpoint-format-1"


def test_round_trip_is_bit_identical(trained_tiny_checkpoint, tmp_path):
    original = load_checkpoint(trained_tiny_checkpoint)
    copy_path = tmp_path / "copy.ckpt"
    save_checkpoint(original, copy_path)
    copy = load_checkpoint(copy_path)
    assert copy.config == original.config and copy.class_names == original.class_names
    assert copy.metrics == original.metrics and copy.history == original.history
    assert all(torch.equal(copy.state_dict[name], value) for name, value in original.state_dict.items())
    images = to_float(load_embedded().test.images[::50])  # (20, 1, 28, 28)
    with torch.no_grad():
        expected, actual = original.build_model()(images), copy.build_model()(images)
    for name, value in expected._asdict().items():
        assert torch.equal(value, getattr(actual, name)), name


def test_training_records_what_export_and_serving_need(trained_tiny_checkpoint):
    checkpoint = load_checkpoint(trained_tiny_checkpoint)
    assert checkpoint.class_names == [str(d) for d in range(10)]
    assert checkpoint.config.routing == "sabour" and checkpoint.config.routing_iterations == 3
    assert checkpoint.config.input_mean == (0.0,) and checkpoint.config.input_std == (1.0,)
    assert checkpoint.dataset == "embedded-mnist-5k"
    assert checkpoint.optimizer_state is not None and checkpoint.scheduler_state is not None
    metrics = checkpoint.metrics
    for key in ("test_accuracy", "test_loss", "train_loss", "train_accuracy", "train_images_per_second", "lr",
                "validation_fraction"):
        assert isinstance(metrics[key], float), key
    assert metrics["epoch"] == checkpoint.epoch
    assert metrics["parameters"] == sum(t.numel() for t in checkpoint.state_dict.values())
    assert set(metrics["test_per_class_accuracy"]) == set(checkpoint.class_names)
    # the fixture trains on every training digit (--val-fraction 0): no validation figures
    assert (metrics["train_images"], metrics["validation_images"], metrics["test_images"]) == (4000, 0, 1000)
    assert "validation_accuracy" not in metrics and "validation_per_class_accuracy" not in metrics
    assert [record["epoch"] for record in checkpoint.history] == list(range(1, checkpoint.epoch + 1))


def rewrite_payload(path, **changes):
    payload = torch.load(path, weights_only=True)
    payload.update(changes)
    torch.save(payload, path)


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "damaged or not a capsnet checkpoint"),
    (lambda p: p.write_bytes(b""), "damaged or not a capsnet checkpoint"),
    (lambda p: p.write_bytes(b"not a checkpoint at all\n" * 100), "damaged or not a capsnet checkpoint"),
    (lambda p: torch.save({"weights": torch.zeros(3)}, p), "is not a capsnet checkpoint"),
    (lambda p: rewrite_payload(p, format_version=FORMAT_VERSION + 1), f"format version {FORMAT_VERSION + 1}"),
    (lambda p: rewrite_payload(p, state_dict={}), "is damaged: Error"),
    (lambda p: rewrite_payload(p, class_names=["a", "b"]), "2 class names for 10 classes"),
    # fields of the wrong kind: a traceback later, or (a string of ten names) no error at all
    (lambda p: rewrite_payload(p, class_names="0123456789"), "is damaged: its class_names is not a list of names"),
    (lambda p: rewrite_payload(p, config=None), "is damaged: its config is not a dict: None"),
    (lambda p: rewrite_payload(p, metrics=[1, 2]), "is damaged: its metrics is not a dict: \\[1, 2\\]"),
    (lambda p: rewrite_payload(p, epoch=-3), "is damaged: its epoch is not a count of epochs: -3"),
    (lambda p: rewrite_payload(p, epoch="2"), "is damaged: its epoch is not a count of epochs: '2'"),
    (lambda p: rewrite_payload(p, history=5), "is damaged: its history is not a list of per-epoch records: 5"),
    (lambda p: rewrite_payload(p, history=[1]), "is damaged: its history is not a list of per-epoch records"),
    (lambda p: rewrite_payload(p, optimizer_state="x"), "is damaged: its optimizer_state is not a dict: 'x'"),
    (lambda p: rewrite_payload(p, epoch_progress=[1, 2]), "is damaged: its epoch_progress is not a dict"),
])
def test_damaged_checkpoint_is_a_clear_error(random_tiny_checkpoint, copy_of, damage, message):
    path = copy_of(random_tiny_checkpoint)
    damage(path)
    with pytest.raises(CapsNetError, match=message):
        load_checkpoint(path)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CapsNetError, match="does not exist"):
        load_checkpoint(tmp_path / "absent.ckpt")
    with pytest.raises(CapsNetError, match="is not a file"):
        load_checkpoint(tmp_path)


def test_a_save_killed_midway_leaves_a_temporary_that_the_next_run_removes(random_tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "model.ckpt"
    # a real save, SIGKILLed while torch.save writes (the payload's first bytes are out, then it stalls)
    script = ("import sys, time, torch\n"
              "from capsnet.models.checkpoint import load_checkpoint\n"
              "from capsnet.training.checkpoint import save_checkpoint\n"
              "def stalled_save(payload, f):\n"
              "    f.write(b'PK'); f.flush(); print('saving', flush=True); time.sleep(60)\n"
              "torch.save = stalled_save\n"
              "save_checkpoint(load_checkpoint(sys.argv[1]), sys.argv[2])\n")
    saver = subprocess.Popen([sys.executable, "-c", script, str(random_tiny_checkpoint), str(out)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert saver.stdout.readline() == "saving\n"
    finally:
        saver.kill()
        saver.wait(timeout=30)
        saver.stdout.close()
    (leftover,) = tmp_path.glob(".model.ckpt.*.tmp")
    others = [tmp_path / ".other.ckpt.abc.tmp", tmp_path / "model.ckpt.abc.tmp", tmp_path / ".model.ckpt.keep"]
    for other in others:
        other.write_bytes(b"not ours")
    last_leftover = tmp_path / ".model.last.ckpt.x1y2z3.tmp"
    last_leftover.write_bytes(b"PK")
    prepare_output(out, DistributedContext())
    assert capsys.readouterr().out.splitlines() == [
        f"removed {leftover}, left by a run killed while saving",
        f"removed {last_leftover}, left by a run killed while saving",
    ]
    assert sorted(tmp_path.iterdir()) == sorted(others)
    assert remove_leftover_temporaries(out) == []


@pytest.mark.parametrize("arch", ["capsnet", "em", "shared-capsnet", "gap-cnn"])
def test_a_checkpoint_an_earlier_version_wrote_still_loads(arch, tmp_path):
    checkpoint = load_checkpoint(FORMAT_1_CHECKPOINTS / f"{arch}.ckpt")
    assert checkpoint.config.arch == arch and checkpoint.epoch == 1 and checkpoint.dataset == "embedded-mnist-5k"
    model = checkpoint.build_model()
    assert all(torch.equal(value, checkpoint.state_dict[name]) for name, value in model.state_dict().items())
    sizes = checkpoint.config.input_sizes
    with torch.no_grad():
        probabilities = model(torch.rand(2, sizes.channels, sizes.min_height, sizes.min_width)).probabilities
    assert probabilities.shape == (2, 10) and torch.isfinite(probabilities).all()
    if checkpoint.optimizer_state is not None:  # what --resume hands back to the optimiser
        torch.optim.Adam(model.parameters()).load_state_dict(checkpoint.optimizer_state)
    # and today's writer keeps the format: a copy loads to the same
    save_checkpoint(checkpoint, tmp_path / "copy.ckpt")
    copy = load_checkpoint(tmp_path / "copy.ckpt")
    assert copy.config == checkpoint.config and copy.history == checkpoint.history
    assert copy.optimizer_state is None or copy.optimizer_state["param_groups"] == checkpoint.optimizer_state[
        "param_groups"]


def _pickled_globals(path: Path) -> set[str]:
    """The module-level names (classes, functions) that a checkpoint's pickle refers to."""
    with zipfile.ZipFile(path) as archive:
        (pickle_name,) = [name for name in archive.namelist() if name.endswith("/data.pkl")]
        data = archive.read(pickle_name)
    names, strings = set(), []
    for opcode, argument, _ in pickletools.genops(data):
        if opcode.name == "GLOBAL":  # protocol 2, torch.save's: "module name"
            names.add(argument.replace(" ", "."))
        elif opcode.name == "STACK_GLOBAL":  # protocol 4 and up: module and name pushed as strings before it
            names.add(".".join(strings[-2:]))
        elif isinstance(argument, str):
            strings.append(argument)
    return names


def test_a_checkpoint_refers_to_no_module_of_capsnet(tmp_path):
    """Moving or renaming the code cannot break loading: the pickle names torch's tensor rebuilders and the
    standard library's containers only, never a class of capsnet (weights_only loading would refuse one anyway)."""
    checkpoint = load_checkpoint(FORMAT_1_CHECKPOINTS / "capsnet.ckpt")
    save_checkpoint(checkpoint, tmp_path / "today.ckpt")
    for path in (FORMAT_1_CHECKPOINTS / "capsnet.ckpt", tmp_path / "today.ckpt"):
        names = _pickled_globals(path)
        assert any(name.startswith("torch._utils._rebuild_tensor") for name in names), names
        assert not [name for name in names if name.split(".")[0] not in ("torch", "collections", "builtins")], names
