"""ByteCheckpoint 0.0.2 as the second peer of `shardwise bench checkpoint`.

Install it into the same environment without letting pip touch torch (its
metadata asks for torch<=2.5.0, so a resolver would refuse it or replace the
pinned CPU torch; that is also why it is no `bench` extra in pyproject.toml):

    pip install -c requirements/constraints.txt --no-deps bytecheckpoint==0.0.2
    pip install -c requirements/constraints.txt "mmh3>=4.1.0,<=4.2.0" \\
        "universal-pathlib>=0.2.2,<=1.0.0" "cachetools>=5.4.0,<=10.0.0" \\
        grpcio==1.69.0 protobuf==3.20.3

(the second line is its declared dependencies other than torch, numpy,
safetensors and typing-extensions, which shardwise's test environment has).

How it is called: its `ddp` framework, the one for state dicts every rank
passes whole (plain tensors are replicated, deduplicated on save):
`bytecheckpoint.save(path, {"model": m}, framework="ddp")` and
`bytecheckpoint.load(path, {"model": m}, framework="ddp")`, where
`m.state_dict()` is the very dict the other engines get. Its planners are
DCP's, so shardwise ShardedTensors go through their DCP hooks as they do with
stock `dcp.save`; loads fill the targets in place. It runs on CPU under torch
2.13 (its "torch 2.1 to 2.5" assertion compares version strings, and
"2.13.0" < "2.6.0" as text).

One change to how it runs: rank 0 of ByteCheckpoint starts a gRPC "report"
server (it gathers every rank's write status) in a spawned child process and
announces the address of the machine's outward interface. The benchmark's
ranks are daemonic processes, which may not start children, and the benchmark
talks to 127.0.0.1 only, so `setup()` starts the same servicer
(ByteCheckpoint's own `ReportServicer`) in a thread of rank 0 listening on
127.0.0.1, before anything is timed (ByteCheckpoint also starts it once and
keeps it).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

NAME = "ByteCheckpoint 0.0.2"
INSTALL = "pip install --no-deps bytecheckpoint==0.0.2"


class _Model:
    """The `{"model": ...}` value ByteCheckpoint takes: `state_dict()` is the benchmark's state."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def _loopback_server(world_size: int) -> str:
    """ByteCheckpoint's report service in a thread of this process, on 127.0.0.1."""
    import asyncio

    import grpc
    from bytecheckpoint.utilities.server import report_service_pb2_grpc, server_lib

    ready = threading.Event()
    address: list[str] = []

    async def serve() -> None:
        server = grpc.aio.server(options=server_lib._GRPC_OPTIONS)
        report_service_pb2_grpc.add_ByteCheckpointReportServiceServicer_to_server(
            server_lib.ReportServicer(world_size), server
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address.append(f"127.0.0.1:{port}")
        ready.set()
        await server.wait_for_termination()

    threading.Thread(target=lambda: asyncio.run(serve()), daemon=True).start()
    if not ready.wait(60):
        raise TimeoutError("ByteCheckpoint's report server did not start within 60 s")
    return address[0]


def setup() -> str | None:
    """Import ByteCheckpoint and start its report service. Collective.

    Returns None when it is ready, else why not (e.g. not installed): the same
    answer on every rank, as they share one environment.
    """
    os.environ.setdefault("BYTECHECKPOINT_LOGGING_LEVEL", "ERROR")  # it logs INFO per call
    try:
        import bytecheckpoint  # noqa: F401
        from bytecheckpoint.distributed import rpc_context
        from bytecheckpoint.utilities.server import server_lib
    except Exception as e:  # not installed, a dependency missing, or its import-time checks
        return f"{type(e).__name__}: {e}"
    server_lib.start_server_in_new_process = _loopback_server
    server_lib._get_local_ip = lambda: "127.0.0.1"
    rpc_context.setup_rpc_service()
    return None


def save(state: dict[str, Any], path: Path) -> None:
    import bytecheckpoint

    bytecheckpoint.save(str(path), {"model": _Model(state)}, framework="ddp")


def load(state: dict[str, Any], path: Path) -> None:
    import bytecheckpoint

    bytecheckpoint.load(str(path), {"model": _Model(state)}, framework="ddp")
