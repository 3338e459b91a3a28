"""Tiny TCP throughput probe run inside a network namespace by :mod:`netns`.

What it does:
    ``python linkcheck.py recv PORT`` listens on ``PORT``, prints ``READY`` once it is
    listening, accepts one connection, reads until the peer closes and prints one JSON line
    ``{"bytes": N, "seconds": S}`` where ``S`` runs from the first to the last received byte.
    ``python linkcheck.py send HOST PORT SECONDS`` connects (retrying until the receiver
    listens) and writes as fast as the socket accepts for ``SECONDS``, then closes.

Why:
    :meth:`megatron_ext.netbench.netns.ShapedNetwork.check_links` needs to show that the
    shaping it installed gives the requested rate before a long training run starts. The
    receiver's clock is used because bytes still sitting in the sender's socket buffer
    have not crossed the link yet.

Constraints:
    Standard library only and run by file path (not ``python -m``), so it works inside a
    namespace whatever the package installation state, and never imports torch.
"""

import json
import socket
import sys
import time

_CHUNK = 1 << 18


def _receive(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("0.0.0.0", port))
        server.listen(1)
        print("READY", flush=True)
        conn, _ = server.accept()
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        total = 0
        first = last = None
        with conn:
            while True:
                count = conn.recv_into(view)
                if count == 0:
                    break
                last = time.perf_counter()
                if first is None:
                    first = last
                total += count
    seconds = (last - first) if first is not None else 0.0
    print(json.dumps({"bytes": total, "seconds": seconds}), flush=True)


def _send(host: str, port: int, seconds: float) -> None:
    deadline = time.monotonic() + 10.0
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=2.0)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    payload = b"\0" * _CHUNK
    with conn:
        conn.settimeout(None)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)


def main(argv) -> int:
    """Entry point; see the module docstring for the two modes."""
    if len(argv) == 2 and argv[0] == "recv":
        _receive(int(argv[1]))
        return 0
    if len(argv) == 4 and argv[0] == "send":
        _send(argv[1], int(argv[2]), float(argv[3]))
        return 0
    print("usage: linkcheck.py recv PORT | send HOST PORT SECONDS", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
