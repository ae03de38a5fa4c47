"""A rogue worker for the security tests: registered in Redis as an idle worker, its certificate of another CA.

`python -m tests.rogue_worker --redis-url URL --revision REV --state JSON --cert PEM --key PEM --log FILE`
prints `READY <host:port>` once registered. The registered address is a TCP front that logs each
connection (`connect`) and relays it to a real `epd.v1.Worker` gRPC server with that certificate,
which logs every RPC it receives (`rpc <method>`). So a test can tell "the router tried this
address" from "the router sent it a request".
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import grpc

from services.common.registry import Registry
from services.common.rpc.epd.v1 import worker_pb2_grpc


class Logbook:
    def __init__(self, path: Path) -> None:
        self._path = path

    def write(self, line: str) -> None:
        with self._path.open("a") as log:
            log.write(line + "\n")


class RogueWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, log: Logbook) -> None:
        self._log = log

    async def Generate(self, request, context):  # noqa: ANN001, ANN201, N802
        self._log.write("rpc Generate")
        await context.abort(grpc.StatusCode.INTERNAL, "rogue")
        yield  # pragma: no cover

    async def PushEmbeddings(self, request_iterator, context):  # noqa: ANN001, ANN201, N802
        self._log.write("rpc PushEmbeddings")
        await context.abort(grpc.StatusCode.INTERNAL, "rogue")

    async def Abort(self, request, context):  # noqa: ANN001, ANN201, N802
        self._log.write("rpc Abort")
        await context.abort(grpc.StatusCode.INTERNAL, "rogue")


async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def main(args: argparse.Namespace) -> None:
    log = Logbook(Path(args.log))
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(RogueWorker(log), server)
    pair = (Path(args.key).read_bytes(), Path(args.cert).read_bytes())
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([pair]))
    await server.start()

    async def front(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        log.write("connect")
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.gather(relay(reader, up_writer), relay(up_reader, writer))

    listener = await asyncio.start_server(front, "127.0.0.1", 0)
    address = f"127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    registry = Registry(args.redis_url, ttl_s=1.0)
    state = json.loads(args.state)
    registry.publish("worker", address, args.revision, state)
    print(f"READY {address}", flush=True)
    while True:
        await asyncio.sleep(0.2)
        await asyncio.to_thread(registry.publish, "worker", address, args.revision, state)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for name in ("--redis-url", "--revision", "--state", "--cert", "--key", "--log"):
        parser.add_argument(name, required=True)
    asyncio.run(main(parser.parse_args()))
