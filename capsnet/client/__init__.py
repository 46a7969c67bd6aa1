"""The client side, which imports no server code: the CapsNet API client and health check, and the `capsnet
predict` and `capsnet health` commands. The load generator, which also times a backend in process, is
capsnet/bench/loadgen.py."""
