"""uvicorn's server with a shutdown that drains: stop taking requests, let those in flight finish
for a while, then end the rest with an error (streams get an error event and [DONE])."""

from __future__ import annotations

import asyncio

import uvicorn


class DrainingServer(uvicorn.Server):
    """app.state.draining turns new requests into 503s; client is the EngineClient whose pending
    requests are waited for (drain_s seconds at most) and then ended."""

    def __init__(self, config: uvicorn.Config, app, client, drain_s: float):
        super().__init__(config)
        self.app, self.client, self.drain_s = app, client, drain_s

    async def shutdown(self, sockets=None) -> None:
        self.app.state.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_s
        while self.client.num_pending and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.client.num_pending:
            self.client.end_all("the server is shutting down; the request was not finished")
            await asyncio.sleep(0.1)  # the streams write their error events
        await super().shutdown(sockets)
