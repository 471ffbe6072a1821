"""A live HTTP server over an in-process engine (``create_app`` under uvicorn in a thread) and a
``RolloutClient`` of it, for the tests that drive the trainer side over real HTTP."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from trainer_bridge import RolloutClient
from trainer_bridge.transports.group_ranks import free_port

ADMIN_KEY = "admin-secret"


@contextmanager
def live_client(engine: Any) -> Iterator[tuple[RolloutClient, set[str]]]:
    """(a client of a server over ``engine`` with admin key ``ADMIN_KEY``, the app's route
    paths); the server stops when the block ends."""
    import uvicorn

    from rollout_engine.entrypoints.http_server import create_app

    app = create_app(engine, admin_api_key=ADMIN_KEY)
    routes = {getattr(r, "path", "") for r in app.routes}
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    client = RolloutClient(f"http://127.0.0.1:{port}", admin_api_key=ADMIN_KEY, timeout=120)
    try:
        client.wait_healthy(30)
        yield client, routes
    finally:
        client.close()
        server.should_exit = True
        thread.join(timeout=10)
