"""The tiny test server in its own process, for the load test (its RSS is the server's alone).

    python -m tests.server.tiny_server [--max-batch 8] [--max-queue 16] [--k 3] [--max-len 256]
        [--delay-s 0] [--drain-timeout 30]

Binds 127.0.0.1 on a free port and prints "PORT <n>" once it serves. It stops by itself
when its standard input closes (the test ended or died) or after --max-seconds; SIGTERM
drains as `verispec serve` does (the same make_server).
"""

import argparse
import sys
import threading
import time

import torch
from tests.server.helpers import free_socket, make_state
from verispec.server.app import make_server


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=16)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--max-seconds", type=float, default=300)
    p.add_argument("--delay-s", type=float, default=0.0, help="sleep per target forward pass")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    state = make_state(drafter="draft", k=args.k, max_batch=args.max_batch, max_queue=args.max_queue,
                       max_len=args.max_len, delay_s=args.delay_s, drain_timeout_s=args.drain_timeout)
    server = make_server(state, log_level="warning")
    sock = free_socket()

    def announce():
        while not server.started:
            time.sleep(0.02)
        print(f"PORT {sock.getsockname()[1]}", flush=True)

    def watchdog():
        t0 = time.monotonic()
        threading.Thread(target=lambda: (sys.stdin.read(), setattr(server, "should_exit", True)),
                         daemon=True).start()
        while not server.should_exit:
            if time.monotonic() - t0 > args.max_seconds:
                server.should_exit = True
            time.sleep(0.5)

    threading.Thread(target=announce, daemon=True).start()
    threading.Thread(target=watchdog, daemon=True).start()
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
