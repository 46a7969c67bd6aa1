"""The engine core: model versions and their repository, each version's batcher and backend, the self-check before
a version serves. Validated tensors in, outputs out (or into sinks): the same code in one process and behind front-end
processes; it imports no transport and no protocol."""
