"""Stand-in for `epd serve <role>` in launcher tests: gRPC health on EPD_HOST:EPD_PORT, a
grandchild process (to prove the launcher cleans up descendants), and its EPD_* settings printed
as one JSON line. Run as `python fake_epd.py serve <role>`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


def main() -> None:
    role = sys.argv[2]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"{os.environ['EPD_HOST']}:{os.environ['EPD_PORT']}")
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    settings = {k: v for k, v in os.environ.items() if k.startswith("EPD_")}
    print(json.dumps({"role": role, "helper_pid": helper.pid, "env": settings}), flush=True)
    server.start()
    server.wait_for_termination()


if __name__ == "__main__":
    main()
