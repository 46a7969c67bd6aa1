"""The models a server serves and their versions: which version answers a request, and loading and unloading versions
without dropping a request (Triton's model control, KServe v2's repository extension).

Each model maps its serving versions to an InferenceService (its own backend, batcher, statistics and metrics); a
request that names no version gets the model's default, the newest serving. A (re)load of a model:

1. reads the model's folder and its version policy, and opens each selected version that is new or whose files
   changed: loaded and self-checked in a worker thread, then warmed up, while the current versions serve;
2. then switches at one instant: the new versions serve (the default moves to the newest), and the versions the policy
   no longer selects, or that a reload replaced, leave the model;
3. a request already given an old version finishes on it (it holds it: InferenceService.use());
4. an old version is closed in the background once no request holds it and its queue is empty: its backend freed and
   its metric series removed.

A version that cannot load (unreadable or altered files, a digest mismatch, a failed self-check) is refused: its
state is UNAVAILABLE with the reason, a log line and `capsnet_model_loads_total{outcome="refused"}` record it, the
load answers FAILED_PRECONDITION, and what served before serves on (no old version leaves while a new one failed).
A poll does not retry a refused version until its files change; an explicit load does.

Unloading a model takes all its versions out at once (its readiness turns false, later requests get UNAVAILABLE),
then answers once their requests are answered and their backends freed.

A backend that can no longer run (errors.BackendUnusable, a lost GPU) fails the whole server, not its model: one
server serves on one device (--gpu), which every model on it shares, so the orchestrator must restart it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from capsnet.errors import CapsNetError, first_line
from capsnet.model_description.decoder import DECODER_PART
from capsnet.serving.config import ServerConfig
from capsnet.serving.engine.repository import ModelOnDisk, check_name
from capsnet.serving.engine.service import InferenceService, ModelSpec
from capsnet.serving.errors import (ControlDenied, InvalidInput, ModelLoadFailed, ModelNotFound, ModelNotReady,
                                    ServerNotReady, ServingError, bounded_message)
from capsnet.serving.lifecycle import Lifecycle
from capsnet.serving.observability.metrics import Metrics
from capsnet.serving.observability.observe import CURRENT
from capsnet.serving.version_policy import version_order

log = logging.getLogger(__name__)

class VersionState(str, enum.Enum):
    """A version's state as Triton's RepositoryIndex names it: the member is its own string, for the index's
    messages and JSON."""

    READY = "READY"
    LOADING = "LOADING"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

UNLOADED = "unloaded"


class ModelRef(NamedTuple):
    """The model a request is for, and the fields its transport took the name and version from (for messages)."""
    name: str
    version: str = ""  # "": the model's default version
    name_field: str = "model_name"
    version_field: str = "model_version"


@dataclass
class VersionStatus:
    state: VersionState
    reason: str = ""


class ServedModel:
    """One model's serving versions, and the state of every version it has tried."""

    def __init__(self, name: str):
        self.name = name
        self._serving: dict[str, InferenceService] = {}
        self._default: InferenceService | None = None
        self.decoder_alone = False  # it serves a decoder alone: it takes poses, not images
        self.fingerprints: dict[str, str] = {}  # serving version -> its files' fingerprint
        self.status: dict[str, VersionStatus] = {}
        self.refused: dict[str, str] = {}  # version -> fingerprint of the files that were refused
        self.lock = asyncio.Lock()  # one load or unload of the model at a time

    @property
    def serving(self) -> dict[str, InferenceService]:
        """Its serving versions: replaced whole at each switch, never changed in place."""
        return self._serving

    @serving.setter
    def serving(self, versions: dict[str, InferenceService]) -> None:
        self._serving = versions
        # what requests read of it, worked out once per switch rather than once per request
        self._default = versions[max(versions, key=version_order)] if versions else None
        self.decoder_alone = any(service.spec.part == DECODER_PART for service in versions.values())

    @property
    def default(self) -> InferenceService | None:
        """The newest serving version, which a request that names none gets."""
        return self._default

    def expected_versions(self) -> str:
        versions = sorted(self.serving, key=version_order)
        listed = ", ".join(map(repr, versions))
        return "''" + (f" or {listed}" if len(versions) == 1 else f" or one of {listed}" if versions else "")


class ModelManager:
    """The served models of a model repository (`serving/engine/repository.py`: RepositoryDir or OneModel)."""

    def __init__(self, source, config: ServerConfig, metrics: Metrics, lifecycle: Lifecycle,
                 check_spec: Callable[[ModelSpec], None] = lambda spec: None):
        """`check_spec(spec)` raises CapsNetError for a version the server's listeners cannot carry."""
        self.source = source
        self.config = config
        self.metrics = metrics
        self.lifecycle = lifecycle
        self.check_spec = check_spec
        self.models: dict[str, ServedModel] = {}
        self._closing: set[asyncio.Task] = set()
        self._rescan_lock = asyncio.Lock()
        self._closed = False

    # -- startup and shutdown

    async def start(self) -> None:
        """Open every model's selected versions (not yet warmed up); CapsNetError naming the first that cannot
        serve (those opened are closed by close())."""
        self.source.check()
        names = self.source.model_names()
        if not names:
            raise CapsNetError(f"the model repository {self.config.model_repository} holds no model: put export "
                               "folders in <model>/<version>/ folders in it")
        for name in names:
            on_disk = self.source.read(name)
            selected = on_disk.selected()
            if not selected:
                raise CapsNetError(f"model {name}: {_no_version(on_disk)}")
            model = self.models.setdefault(name, ServedModel(name))
            for version in selected:
                try:
                    service = await self._open(name, version, on_disk)
                except CapsNetError as err:
                    if self.config.model_repository is None:  # --model: the folder is the one the user gave
                        raise
                    raise CapsNetError(f"model {name} version {version}: {err}") from None
                model.serving = {**model.serving, version: service}
                model.fingerprints[version] = on_disk.fingerprints[version]
                model.status[version] = VersionStatus(VersionState.READY)
                service.record_serving()

    async def warmup(self) -> None:
        for model in self.models.values():
            for service in model.serving.values():
                await self._warm_up(service)

    async def _warm_up(self, service: InferenceService) -> None:
        if self.config.warmup:  # --no-warmup: its first batches of each size warm it
            await service.warmup()

    def services(self) -> list[InferenceService]:
        """Every serving version."""
        return [service for model in self.models.values() for service in model.serving.values()]

    async def close(self) -> None:
        """Close every version once its requests are answered (shutdown, after the drain)."""
        self._closed = True
        for model in self.models.values():
            retired, model.serving = list(model.serving.values()), {}
            for service in retired:
                self._retire(model, service)
        if self._closing:
            await asyncio.gather(*self._closing)

    # -- requests

    def model(self, name: str, field: str) -> ServedModel:
        model = self.models.get(name)
        if model is None:  # a name the server has is a valid one
            check_name(name, field)
            raise ModelNotFound(f"{field}: unknown model {name!r}; this server serves "
                                f"{', '.join(map(repr, self.models))}")
        return model

    def default_model(self, field: str) -> str:
        """The model a request that names none is for: the server's one model that takes images (a decoder beside
        it takes poses)."""
        names = [name for name, model in self.models.items() if not model.decoder_alone]
        if len(names) != 1:
            raise InvalidInput(f"{field}: this server serves several models ({', '.join(map(repr, names))}); "
                               "name one")
        return names[0]

    def resolve(self, ref: ModelRef) -> InferenceService:
        """The serving version `ref` names (the default when it names none); ModelNotFound for a model or version the
        server does not have, ModelNotReady for one it has but not serving now."""
        model = self.model(ref.name, ref.name_field)
        if ref.version:
            service = model.serving.get(ref.version)
            if service is None:
                check_name(ref.version, ref.version_field, "model version")
                status = model.status.get(ref.version)
                if status is None or status.state == VersionState.READY:
                    raise ModelNotFound(f"{ref.version_field}: model {model.name!r} has no version {ref.version!r}; "
                                        f"expected {model.expected_versions()}")
                raise ModelNotReady(f"{ref.version_field}: version {ref.version!r} of model {model.name!r} is "
                                    f"{status.state.lower()}{f': {status.reason}' if status.reason else ''}; "
                                    f"expected {model.expected_versions()}")
        else:
            service = model.default
            if service is None:
                raise ModelNotReady(f"{ref.name_field}: model {model.name!r} has no version loaded "
                                    f"({_why_none(model)}); retry later, or on another replica")
        if (record := CURRENT.get()) is not None:
            record.served_by(service.spec.name, service.spec.version)
        return service

    def use(self, ref: ModelRef) -> InferenceService:
        """The version `ref` names, held until the request is answered (`with models.use(ref) as version:`)."""
        return self.resolve(ref).use()

    def ready(self, ref: ModelRef) -> bool:
        """A model's (or one version's) readiness: serving, while the server is. An unknown model or version is
        ModelNotFound."""
        try:
            self.resolve(ref)
        except ModelNotReady:
            return False
        return self.lifecycle.ready

    def versions(self, name: str) -> list[str]:
        return sorted(self.models[name].serving, key=version_order)

    async def statistics(self, ref: ModelRef) -> list[dict]:
        """Triton's statistics of the serving versions `ref` selects: every model's ("" name), a model's every
        version ("" version), or one version."""
        return [service.stats.to_json() for service in self.selected(ref)]

    def selected(self, ref: ModelRef) -> list[InferenceService]:
        """The serving versions a statistics request's `ref` selects."""
        if not ref.name:
            return [self.models[name].serving[version] for name in self.models for version in self.versions(name)]
        if not ref.version:
            model = self.model(ref.name, ref.name_field)
            return [model.serving[version] for version in self.versions(model.name)]
        return [self.resolve(ref)]

    # -- the repository extension

    def check_control(self) -> None:
        """ControlDenied unless loads and unloads may be asked for (--model-control explicit)."""
        mode = self.config.model_control
        if mode == "none":
            raise ControlDenied("model control is off on this server (--model-control none): it serves what it "
                                "loaded at start; start it with --model-repository DIR --model-control explicit to "
                                "load and unload models")
        if mode == "poll":
            raise ControlDenied(f"this server polls its model repository (--model-control poll, every "
                                f"{self.config.poll_interval_s:g} s): change the files, or send it SIGHUP, and the "
                                "next scan loads them")

    def index(self, ready_only: bool = False) -> list[dict]:
        """Every model of the repository and the state of each version it tried (a model never loaded: one entry
        without a version)."""
        try:
            names = set(self.source.model_names())
        except CapsNetError as err:
            log.warning("repository index: %s", err)
            names = set()
        entries = []
        for name in sorted(names | set(self.models)):
            model = self.models.get(name)
            statuses = sorted(model.status.items(), key=lambda item: version_order(item[0])) if model else []
            if not statuses and not ready_only:
                entries.append({"name": name, "version": "", "state": VersionState.UNAVAILABLE, "reason": "not loaded"})
            for version, status in statuses:
                if not ready_only or status.state == VersionState.READY:
                    entries.append({"name": name, "version": version, "state": status.state, "reason": status.reason})
        return entries

    async def load(self, name: str, field: str = "model_name") -> None:
        """Load, or reload, model `name` as on disk now; ModelLoadFailed naming each refused version."""
        check_name(name, field)
        try:
            on_disk = self.source.read(name)
        except CapsNetError as err:
            raise ModelLoadFailed(f"model {name!r}: {err}") from None
        model = self.models.setdefault(name, ServedModel(name))
        async with model.lock:
            failures = await self._apply(model, on_disk, retry_refused=True)
        if failures:
            raise ModelLoadFailed(bounded_message(f"model {name!r}: " + "; ".join(failures)))

    async def unload(self, name: str, field: str = "model_name") -> None:
        """Take every version of model `name` out at once; returns once their requests are answered."""
        check_name(name, field)
        model = self.models.get(name)
        if model is None:
            if name in self.source.model_names():
                return  # in the repository, never loaded: nothing to unload
            raise ModelNotFound(f"{field}: unknown model {name!r}; the repository has "
                                f"{', '.join(map(repr, self.source.model_names()))}")
        async with model.lock:
            retired, model.serving = list(model.serving.values()), {}
            closing = [self._retire(model, service) for service in retired]
        if retired:
            log.info("model %s unloaded: versions %s no longer take requests; they close once theirs are answered",
                     name, ", ".join(service.spec.version for service in retired))
        await asyncio.gather(*closing)

    async def rescan(self) -> None:
        """The repository as on disk now (SIGHUP, polling): every model loaded as its policy selects (new ones too),
        versions refused before not retried until their files change, models whose folder is gone unloaded."""
        async with self._rescan_lock:
            try:
                names = self.source.model_names()
            except CapsNetError as err:
                log.error("rescan: %s", err)
                return
            for name in names:
                try:
                    on_disk = self.source.read(name)
                except (CapsNetError, ServingError) as err:
                    log.error("rescan: model %s: %s", name, getattr(err, "message", err))
                    continue
                model = self.models.setdefault(name, ServedModel(name))
                async with model.lock:
                    try:
                        await self._apply(model, on_disk, retry_refused=False)
                    except ServerNotReady:  # the server began to stop meanwhile
                        return
            for name in set(self.models) - set(names):
                if self.models[name].serving:
                    log.info("rescan: model %s left the repository", name)
                    await self.unload(name)

    # -- loading

    async def _open(self, name: str, version: str, on_disk: ModelOnDisk) -> InferenceService:
        """Version `version`, loaded and self-checked, not yet warmed up; CapsNetError when it cannot serve."""
        try:
            service = await InferenceService.open(on_disk.versions[version], name, version, self.config, self.metrics,
                                                  self.lifecycle, on_disk.part)
        except CapsNetError:
            raise
        except Exception as err:  # whatever else a backend or a file raises: this version is refused, not the server
            log.debug("loading %s %s failed", name, version, exc_info=True)
            raise CapsNetError(f"{type(err).__name__}: {first_line(err)}") from None
        try:
            self.check_spec(service.spec)
        except CapsNetError:
            await service.close()
            if version not in self.models[name].serving:
                service.metrics.remove()
            raise
        return service

    async def _apply(self, model: ServedModel, on_disk: ModelOnDisk, retry_refused: bool) -> list[str]:
        """Open the selected versions that are new or changed, then switch; the refusals, one text each."""
        for version in [v for v, status in model.status.items() if v not in on_disk.versions and v not in model.serving
                        and status.state != VersionState.UNLOADING]:
            del model.status[version]  # gone from disk: the index lists the repository as it is
            model.refused.pop(version, None)
        selected = on_disk.selected()
        if not selected:
            log.error("model %s: %s; what it serves stays", model.name, _no_version(on_disk))
            return [_no_version(on_disk)]
        opened: dict[str, InferenceService] = {}
        failures = []
        held_back = False  # a selected version is refused: no old version leaves
        for version in selected:
            files = on_disk.fingerprints[version]
            if version in model.serving and model.fingerprints.get(version) == files:
                continue  # serving as it is on disk
            if not retry_refused and model.refused.get(version) == files:
                held_back = True  # refused as it is on disk: logged then
                continue
            if version not in model.serving:
                model.status[version] = VersionStatus(VersionState.LOADING)
            try:
                service = await self._open(model.name, version, on_disk)
                await self._warm_up(service)
            except CapsNetError as err:
                failures.append(self._refused(model, version, files, str(err)))
                held_back = True
                continue
            if self._closed:  # the server stopped meanwhile
                await service.close()
                raise ServerNotReady("the server is shutting down")
            opened[version] = service
            model.fingerprints[version] = files
            model.refused.pop(version, None)
            self.metrics.model_loads.labels(model.name, version, "loaded").inc()
        if not opened and (held_back or set(model.serving) <= set(selected)):
            return failures
        # The switch, at one instant: nothing below awaits until model.serving is replaced.
        replaced = [model.serving[version] for version in opened if version in model.serving]
        serving = {**model.serving, **opened}
        dropped = [] if held_back else [serving.pop(version) for version in list(serving) if version not in selected]
        model.serving = serving
        for version, service in opened.items():
            model.status[version] = VersionStatus(VersionState.READY)
            service.record_serving()
        for service in replaced + dropped:
            self._retire(model, service)
        default = model.default
        assert default is not None  # every selected version serves now, or a refusal held the old ones back
        log.info("model %s serves versions %s (default %s)%s", model.name, ", ".join(self.versions(model.name)),
                 default.spec.version, f"; closing {', '.join(s.spec.version for s in replaced + dropped)} "
                 "once their requests are answered" if replaced or dropped else "")
        return failures

    def _refused(self, model: ServedModel, version: str, files: str, reason: str) -> str:
        model.refused[version] = files
        if version in model.serving:
            model.status[version] = VersionStatus(VersionState.READY,
                                                  f"a reload was refused, the files loaded before serve: {reason}")
        else:
            model.status[version] = VersionStatus(VersionState.UNAVAILABLE, reason)
        self.metrics.model_loads.labels(model.name, version, "refused").inc()
        current = model.default
        log.error("model %s version %s refused: %s; %s", model.name, version, reason,
                  f"version {current.spec.version} serves on" if current else "the model serves no version")
        return f"version {version} refused: {reason}"

    def _retire(self, model: ServedModel, service: InferenceService) -> asyncio.Task:
        """Close `service`, out of model.serving already, once its requests are answered."""
        version = service.spec.version
        if version not in model.serving:
            model.status[version] = VersionStatus(VersionState.UNLOADING)
        task = asyncio.get_running_loop().create_task(self._close(model, service), name=f"close {model.name} {version}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return task

    async def _close(self, model: ServedModel, service: InferenceService) -> None:
        await service.close()
        version = service.spec.version
        if version not in model.serving:  # not replaced by a reload of the same version
            service.metrics.remove()
            model.status[version] = VersionStatus(VersionState.UNAVAILABLE, UNLOADED)
            model.fingerprints.pop(version, None)
        log.info("model %s version %s closed: its requests answered, its backend freed", model.name, version)


def _no_version(on_disk: ModelOnDisk) -> str:
    found = ", ".join(sorted(on_disk.versions, key=version_order)) or "none"
    return (f"no version folder matches its version policy {on_disk.policy.describe()} (version folders: {found}; "
            "a version is a folder named by a positive integer holding an export)")


def _why_none(model: ServedModel) -> str:
    """Why a model serves no version: it was unloaded, or its versions were refused (their reasons)."""
    if any(status.state == VersionState.UNLOADING or status.reason == UNLOADED for status in model.status.values()):
        return UNLOADED
    return "; ".join(f"version {version}: {status.reason}" for version, status in model.status.items()
                     if status.reason) or "not loaded"
