"""An in-process uvicorn server for tests that need a real HTTP port."""

from __future__ import annotations

import asyncio
import contextlib


@contextlib.asynccontextmanager
async def uvicorn_server(app, port: int):
    """Serve ``app`` on 127.0.0.1:``port`` in this event loop until the block ends."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    # uvicorn would install SIGINT/SIGTERM handlers in the main thread; the test run owns those
    server.install_signal_handlers = lambda: None
    task = asyncio.create_task(server.serve())
    for _ in range(400):
        if server.started or task.done():
            break
        await asyncio.sleep(0.05)
    if not server.started:
        task.cancel()
        raise RuntimeError("test server did not start")
    try:
        yield server
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
