"""A model repository on disk: which models and versions there are, and which of them each model serves.

    DIR/<model>/<version>/       an export folder (`capsnet export`), as `--model` serves
    DIR/<model>/config.json      optional: {"version_policy": ...}, Triton's JSON form of its version policy

Versions are positive integers, as Triton's, so that "the newest" has one meaning. A model's version policy (Triton's
`version_policy`) selects the versions it serves among those on disk: the newest N (`{"latest": {"num_versions":
N}}`), the ones listed (`{"specific": {"versions": [1, 3]}}`) or all (`{"all": {}}`); without config.json, the
server's --version-policy. `--model DIR` is the one-model repository: the model and version model.json names.
A model whose versions were exported with their decoder (`--reconstruction`) has it served beside it as a model of
its own, `<model>-decoder`, of the same folders: the versions that have one, as the model's policy selects.

Names that come from clients (a request's model or version, a load or unload) are checked against NAME before
anything is looked up, and a model is found among the entries the repository directory lists, never by joining a
client's text to a path: no file outside the repository is read for a client.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from capsnet.errors import CapsNetError, first_line
from capsnet.model_description.decoder import CLASSIFIER_PART, DECODER_PART, DECODER_SUFFIX, decoder_model_name
from capsnet.model_description.files import SIDECAR_NAME
from capsnet.model_description.schema import ModelDescription
from capsnet.serving.errors import InvalidInput, ModelNotFound
from capsnet.serving.version_policy import VersionPolicy

log = logging.getLogger(__name__)

# A model's or a version's name: what a file name may be on every file system, with no path separator, no "..", no
# leading dot (hidden entries, "." itself) and no NUL; at most 128 characters (a request's names also label metrics).
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
# A repository version folder: Triton's, a positive integer without leading zeros (so one number has one folder).
VERSION_FOLDER = re.compile(r"[1-9][0-9]{0,17}")
MODEL_CONFIG = "config.json"


def check_name(value: str, field_name: str, what: str = "model name") -> str:
    """`value` when it is a NAME; InvalidInput naming the field otherwise (a long value is quoted cut)."""
    if NAME.fullmatch(value):
        return value
    shown = repr(value[:40]) + (f" (cut from {len(value)} characters)" if len(value) > 40 else "")
    raise InvalidInput(f"{field_name}: {shown} is not a {what}: expected 1 to 128 letters, digits, '_', '.' or '-', "
                       "starting with a letter or digit")


@dataclass(frozen=True)
class ModelOnDisk:
    """A model as the repository holds it now: its versions' folders and the policy that picks among them."""

    name: str
    versions: dict[str, Path]  # version -> its export folder
    policy: VersionPolicy
    fingerprints: dict[str, str] = field(default_factory=dict)  # version -> digest of its model.json
    part: str = CLASSIFIER_PART  # the folders' classifier, or their decoder alone (serving/engine/decoder.py)

    def selected(self) -> list[str]:
        return self.policy.select(list(self.versions))


def has_decoder(folder: Path) -> bool:
    """Whether the export in `folder` says it has the decoder alone (unreadable: no; loading it says why)."""
    try:
        return json.loads((folder / SIDECAR_NAME).read_bytes()).get("decoder") is not None
    except (OSError, ValueError, AttributeError):
        return False


def decoder_of(on_disk: ModelOnDisk) -> ModelOnDisk:
    """The decoder alone of `on_disk`'s versions that have one, under the decoder's name, by the same policy."""
    versions = {version: folder for version, folder in on_disk.versions.items() if has_decoder(folder)}
    return ModelOnDisk(decoder_model_name(on_disk.name), versions, on_disk.policy,
                       {version: on_disk.fingerprints[version] for version in versions}, DECODER_PART)


def fingerprint(folder: Path) -> str:
    """What tells a version changed on disk: its model.json, which records every file's digest ("" if unreadable:
    loading it says why)."""
    try:
        return hashlib.sha256((folder / SIDECAR_NAME).read_bytes()).hexdigest()
    except OSError:
        return ""


class RepositoryDir:
    """`--model-repository DIR`: models are DIR's folders, each version a numbered folder in it."""

    def __init__(self, root: Path, default_policy: VersionPolicy):
        self.root = root
        self.default_policy = default_policy
        self._skipped: set[str] = set()  # folders logged as not model names (once each: a poll lists them often)

    def check(self) -> None:
        """At startup: CapsNetError unless the repository is a readable folder."""
        if not self.root.is_dir():
            raise CapsNetError(f"--model-repository {self.root}: "
                               f"{'not a directory' if self.root.exists() else 'no such directory'}")
        self.model_names()

    def model_names(self) -> list[str]:
        """The models in the repository: its folders with a NAME (others, such as lost+found, are skipped, and
        logged the first time), and `<folder>-decoder` beside a folder with a version exported with its decoder."""
        folders = self._folders()
        decoders = [decoder_model_name(name) for name in folders
                    if any(map(has_decoder, self._versions(self.root / name, quiet=True).values()))]
        return sorted({*folders, *decoders})

    def _decoder_base(self, name: str, folders: list[str]) -> str | None:
        """The folder whose decoder `name` is served as, unless a folder of that name is there."""
        base = name.removesuffix(DECODER_SUFFIX)
        return base if name != base and base in folders and name not in folders else None

    def _folders(self) -> list[str]:
        try:
            with os.scandir(self.root) as entries:
                folders = sorted(entry.name for entry in entries if entry.is_dir())
        except OSError as err:
            raise CapsNetError(f"cannot read the model repository {self.root}: {err.strerror or err}") from None
        if skipped := [name for name in folders if not NAME.fullmatch(name) and name not in self._skipped]:
            self._skipped.update(skipped)
            log.warning("model repository %s: skipping folders that are not model names: %s", self.root,
                        ", ".join(repr(name[:40]) for name in skipped[:10]))
        return [name for name in folders if NAME.fullmatch(name)]

    def read(self, name: str) -> ModelOnDisk:
        """Model `name` (a checked NAME) as on disk now; ModelNotFound when the repository has no such folder,
        CapsNetError when its config.json or folder is unusable."""
        folders = self._folders()
        if (base := self._decoder_base(name, folders)) is not None:
            return decoder_of(self._read(base))
        if name not in folders:  # looked up among the listed entries, never joined to a path first
            raise ModelNotFound(f"model {name!r} is not in the model repository; it has "
                                f"{', '.join(map(repr, self.model_names())) or 'no models'}")
        return self._read(name)

    def _read(self, name: str) -> ModelOnDisk:
        folder = self.root / name
        versions = self._versions(folder)
        return ModelOnDisk(name, versions, self._policy(folder),
                           {version: fingerprint(path) for version, path in versions.items()})

    @staticmethod
    def _versions(folder: Path, quiet: bool = False) -> dict[str, Path]:
        """A model folder's version folders; unreadable: CapsNetError, or none when `quiet`."""
        try:
            with os.scandir(folder) as entries:
                return {entry.name: folder / entry.name for entry in entries
                        if entry.is_dir() and VERSION_FOLDER.fullmatch(entry.name)}
        except OSError as err:
            if quiet:
                return {}
            raise CapsNetError(f"cannot read {folder}: {err.strerror or err}") from None

    def _policy(self, folder: Path) -> VersionPolicy:
        path = folder / MODEL_CONFIG
        if not path.exists():
            return self.default_policy
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise CapsNetError(f"cannot read {path}: {first_line(err)}") from None
        if not isinstance(config, dict) or set(config) - {"version_policy"}:
            raise CapsNetError(f"{path}: only version_policy is read from a model's config.json, got "
                               f"{', '.join(map(repr, config)) if isinstance(config, dict) else type(config).__name__}")
        if "version_policy" not in config:
            return self.default_policy
        return VersionPolicy.from_json(config["version_policy"], str(path))


class OneModel:
    """`--model DIR`: one model, the name and version its model.json gives, loaded at start and never changed."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._description: ModelDescription | None = None

    def check(self) -> None:
        self._description = ModelDescription.read(self.folder)

    @property
    def description(self) -> ModelDescription:
        assert self._description is not None, "check() first"
        return self._description

    def model_names(self) -> list[str]:
        name = self.description.name
        return [name, *([decoder_model_name(name)] if self.description.decoder is not None else [])]

    def read(self, name: str) -> ModelOnDisk:
        model = self._model()
        if name == decoder_model_name(model.name) and self.description.decoder is not None:
            return decoder_of(model)
        if name != model.name:
            raise ModelNotFound(f"model {name!r} is not served; this server serves "
                                f"{', '.join(map(repr, self.model_names()))}")
        return model

    def _model(self) -> ModelOnDisk:
        version = self.description.version
        return ModelOnDisk(self.description.name, {version: self.folder}, VersionPolicy("all"),
                           {version: fingerprint(self.folder)})
