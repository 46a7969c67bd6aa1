"""`capsnet.v1.CapsNetService`: our API, a thin layer over the shared request path.

A request names a model and version (model_name, model_version) or takes the server's one model and its default
version; the response names the version that answered. Errors are raised as `serving/errors.py` kinds; the
interceptor turns them into gRPC statuses.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
from google.protobuf.duration_pb2 import Duration

from capsnet.model_description.classes import PRESENT_THRESHOLD
from capsnet.serving.engine.decoder import check_takes_images
from capsnet.serving.engine.model_manager import ModelManager, ModelRef
from capsnet.serving.engine.service import InferenceResult, ModelSpec
from capsnet.serving.errors import InvalidInput, ServerNotReady
from capsnet.serving.lifecycle import SHUTTING_DOWN
from capsnet.serving.protocol.images import decode_images
from capsnet.v1 import capsnet_pb2 as pb
from capsnet.v1 import capsnet_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CapsNetService"].full_name


def add_to_server(server: grpc.aio.Server, models: ModelManager, max_image_scale: int) -> None:
    pb_grpc.add_CapsNetServiceServicer_to_server(CapsNetServicer(models, max_image_scale), server)


class CapsNetServicer(pb_grpc.CapsNetServiceServicer):
    def __init__(self, models: ModelManager, max_image_scale: int):
        self.models = models
        self.max_image_scale = max_image_scale

    def _ref(self, request) -> ModelRef:
        """The model a ClassifyRequest or GetModelInfoRequest names, or the server's one model."""
        return ModelRef(request.model_name or self.models.default_model("model_name"), request.model_version)

    async def Classify(self, request, context):
        return await self._classify(request, context, time.monotonic())

    async def ClassifyStream(self, request_iterator, context):
        # Requests are classified concurrently (so they batch together) and answered in order; at most
        # max_batch_size are in progress, which slows a client that sends faster than it is answered.
        slots = asyncio.Semaphore(self.models.config.max_batch_size)
        pending: asyncio.Queue[asyncio.Future | None] = asyncio.Queue()

        def end_after_answered(err: Exception) -> None:
            """End the stream with `err` once the requests already in progress are answered."""
            failed = asyncio.get_running_loop().create_future()
            failed.set_exception(err)
            pending.put_nowait(failed)

        async def read() -> None:
            try:
                async for request in request_iterator:
                    await slots.acquire()
                    pending.put_nowait(asyncio.create_task(self._classify(request, context, time.monotonic())))
            except InvalidInput as err:  # an unparseable message
                end_after_answered(err)
            finally:
                pending.put_nowait(None)  # end of the requests

        async def end_at_shutdown() -> None:
            # An open stream would otherwise hold the shutdown for its whole grace period.
            await self.models.lifecycle.refusing.wait()
            end_after_answered(ServerNotReady(SHUTTING_DOWN))

        helpers = [asyncio.create_task(read()), asyncio.create_task(end_at_shutdown())]
        try:
            while (task := await pending.get()) is not None:
                response = await task  # a ServingError ends the stream with its status (the interceptor's)
                slots.release()
                yield response
        finally:
            for helper in helpers:
                helper.cancel()
            while not pending.empty():
                if task := pending.get_nowait():
                    task.cancel()  # on a task that already failed, this drops its error unlogged

    async def GetModelInfo(self, request, context):
        spec = self.models.resolve(self._ref(request)).spec
        check_takes_images(spec)
        check = spec.self_check
        return pb.GetModelInfoResponse(
            name=spec.name,
            version=spec.version,
            input_name=spec.input_name,
            input_shape=spec.input_shape,
            class_names=spec.class_names,
            pose_dim=spec.pose_dim,
            output_names=spec.output_names,
            max_batch_size=spec.max_batch_size,
            backend=spec.backend,
            precision=spec.precision,
            routing=pb.Routing(variant=spec.routing.get("variant", ""), iterations=spec.routing.get("iterations", 0),
                               squash_constant=spec.routing.get("squash_constant", 0.0)),
            self_check=pb.SelfCheck(precision=check.precision, images=check.images,
                                    argmax_agreement=check.argmax_agreement, max_abs_diff=check.max_abs_diff,
                                    passed=check.passed, cpu=check.cpu),
            choice=spec.choice,
            input_sizes=[spec.sizes.channels, spec.sizes.min_height, spec.sizes.min_width, spec.sizes.max_height,
                         spec.sizes.max_width],
        )

    async def _classify(self, request: pb.ClassifyRequest, context, started: float) -> pb.ClassifyResponse:
        with self.models.use(self._ref(request)) as service:
            spec = service.spec
            check_takes_images(spec)
            if request.top_k > len(spec.class_names):
                raise InvalidInput(f"top_k: expected 0 to {len(spec.class_names)} (the number of classes), got "
                                   f"{request.top_k}")
            threshold = present_threshold(request)
            service.check_arrival(started)
            service.check_batch_size(len(request.images), "images")
            if any(image.WhichOneof("data") == "encoded" for image in request.images):
                # PNG/JPEG decoding can take milliseconds: off the event loop.
                decoded = await asyncio.to_thread(decode_images, request.images, spec.sizes, spec.input_shape,
                                                  self.max_image_scale)
            else:
                decoded = decode_images(request.images, spec.sizes, spec.input_shape, self.max_image_scale)
            remaining = context.time_remaining()
            deadline = None if remaining is None else time.monotonic() + remaining
            # one tensor per image size (a model of any size may be sent several in one request), inferred together
            by_size: dict[tuple[int, ...], list[int]] = {}
            for index, image in enumerate(decoded.images):
                by_size.setdefault(image.shape, []).append(index)
            results = await service.infer_sizes(
                [np.stack([decoded.images[index] for index in indices]) for indices in by_size.values()],
                field="images", reconstruction=request.include_reconstruction, deadline=deadline, arrival=started)
            return _response(spec, request, _in_request_order(list(by_size.values()), results), threshold,
                             decoded.resized_from, started)


def present_threshold(request: pb.ClassifyRequest) -> float:
    """The request's present_threshold, or the default; InvalidInput outside [0, 1]."""
    if not request.HasField("present_threshold"):
        return PRESENT_THRESHOLD
    threshold = request.present_threshold
    if not 0 <= threshold <= 1:  # `not`: NaN is refused too
        raise InvalidInput(f"present_threshold: expected 0 to 1 (a capsule length), got {threshold:g}")
    return threshold


def _in_request_order(groups: list[list[int]], results: list[InferenceResult]) -> InferenceResult:
    """The results of each size's images (`groups`: their indices in the request) as one, in the request's order."""
    if len(results) == 1:
        return results[0]
    order = np.argsort(np.concatenate(groups), kind="stable")  # (N,): request index -> row of the concatenation

    def joined(arrays: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(arrays)[order]

    return InferenceResult(  # one model answered every size: each result has the same outputs
        {name: joined([result.outputs[name] for result in results]) for name in results[0].outputs},
        queue_seconds=max(result.queue_seconds for result in results),  # the sizes waited side by side
        compute_seconds=sum(result.compute_seconds for result in results),
    )


def _response(spec: ModelSpec, request: pb.ClassifyRequest, result: InferenceResult, threshold: float,
              resized_from: list, started: float) -> pb.ClassifyResponse:
    classes, pose_dim = len(spec.class_names), spec.pose_dim
    all_probabilities, poses = result.outputs["probabilities"], result.outputs.get("poses")
    reconstruction = result.outputs.get("reconstruction")
    predicted = all_probabilities.argmax(axis=1)  # (N,)
    ranked = np.argsort(-all_probabilities, axis=1, kind="stable")  # (N, J): most probable first
    response = pb.ClassifyResponse(model_name=spec.name, model_version=spec.version, request_id=request.request_id)
    for index, probabilities in enumerate(all_probabilities):
        item = response.results.add(probabilities=probabilities.tolist(), predicted_class=int(predicted[index]),
                                    predicted_name=spec.class_names[predicted[index]],
                                    resized_from=resized_from[index] or ())
        if not request.exclude_poses and poses is not None:  # a CNN baseline has none: left empty
            item.poses.shape[:] = (classes, pose_dim)
            item.poses.values[:] = poses[index].ravel().tolist()
        if reconstruction is not None:
            item.reconstruction.shape[:] = spec.input_shape
            item.reconstruction.values[:] = reconstruction[index].tolist()
        for label in ranked[index, :request.top_k]:
            item.top_classes.add(index=int(label), name=spec.class_names[label],
                                 probability=float(probabilities[label]))
        for label in ranked[index]:
            if probabilities[label] > threshold:
                item.present_classes.add(index=int(label), name=spec.class_names[label],
                                         probability=float(probabilities[label]))
    response.timing.queue.CopyFrom(_duration(result.queue_seconds))
    response.timing.compute.CopyFrom(_duration(result.compute_seconds))
    response.timing.total.CopyFrom(_duration(time.monotonic() - started))
    return response


def _duration(seconds: float) -> Duration:
    duration = Duration()
    duration.FromNanoseconds(round(seconds * 1e9))
    return duration
