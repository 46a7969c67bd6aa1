"""One server as N front-end processes and one engine process: the supervisor that starts and watches them, the
front end's engine client, the engine process, and the typed messages and shared-memory slots between them."""
