"""The messages between front-end processes and their engine: typed, tagged by kind, read in bursts whatever the
reads split, and errors that keep their kind across the link."""

from __future__ import annotations

import asyncio

import pytest

from capsnet.serving import errors
from capsnet.serving.processes import engine_link
from capsnet.serving.processes.engine_link import (Answered, Cancel, Failed, Failure, Inbox, Infer, Kind, Outbox,
                                                   Report, ReportWanted, Slots, Specs, Statistics, StatisticsQuery)

MESSAGES = [Specs(b"\x80\x05specs"), Slots("capsnet-1-0-1", 80, 4096), Infer(7, 0, 3, (2, 1, 28, 28), 12.5),
            Infer(8, 1, 4, (1, 1, 28, 28), None), Cancel(7, True),
            Answered([(3, 1.0, 1.1, 1.2, 1.3)], [(7, [0]), (8, [0])]), Failed(9, Failure.QUEUE_FULL, "queue full"),
            StatisticsQuery(10, [0, 1]), Statistics(10, [{"name": "capsnet"}]), ReportWanted(2), Report(2, [{}])]


def test_each_message_is_tagged_with_its_kind_and_read_back_as_sent():
    for message in MESSAGES:
        encoded = engine_link._encode(message)
        assert encoded[1] == type(message).__struct_config__.tag  # a MessagePack array, its kind first
        assert engine_link._decode(encoded) == message
    assert {type(message).__struct_config__.tag for message in MESSAGES} == set(Kind)


def test_a_burst_is_read_in_one_wake_up_whatever_the_reads_split():
    async def main() -> list:
        reader = asyncio.StreamReader()
        read: list = []

        class Writer:  # what Outbox writes, fed to the reader in pieces of 5 bytes
            def is_closing(self) -> bool:
                return False

            def write(self, data: bytes) -> None:
                for start in range(0, len(data), 5):
                    reader.feed_data(data[start:start + 5])

        outbox = Outbox(Writer())  # type: ignore[arg-type]
        for message in MESSAGES:
            outbox.send(message)
        await asyncio.sleep(0)  # the one write of this loop iteration
        inbox = Inbox(reader)
        while len(read) < len(MESSAGES):
            read += await inbox.receive()
        reader.feed_eof()
        with pytest.raises(asyncio.IncompleteReadError):
            await inbox.receive()
        return read

    assert asyncio.run(main()) == MESSAGES


def test_errors_keep_their_kind_across_the_link():
    for err in (errors.QueueFull("full"), errors.DeadlineExceeded("late"), errors.BackendUnusable("gone"),
                errors.InferenceError("failed"), errors.RequestTimeout("cancelled")):
        failed = engine_link.failure_of(err)
        back = engine_link.error_from(failed.failure, failed.message)
        assert type(back) is type(err) and str(back) == str(err)
    fault = engine_link.failure_of(ValueError("bad"))
    assert fault.failure is Failure.INFERENCE and fault.message == "ValueError: bad"
