"""An app served on 127.0.0.1 in a background thread, for the tests and the load benchmarks."""

import socket
import threading
import time
from typing import Any

import uvicorn


class InThread:
    """A server running `app` on 127.0.0.1 in a background thread (tests and benchmarks): `url`, `close()`."""

    def __init__(self, app: Any, host: str = "127.0.0.1") -> None:
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        # a connection still open a second after close() is cut: a Gradio client's heartbeat stream never
        # ends on its own, and waiting for it held close() for its whole 10 s join
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=1
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server did not start on {host}:{port}")
            time.sleep(0.01)
        self.url = f"http://{host}:{port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
