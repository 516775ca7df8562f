"""The shaped link's own ceiling, measured on it: how fast TCP moves bytes from host0 to host1 one way, and both ways
at once over one connection, as a pair of a ring exchanges (Gloo's pair is one TCP connection carrying both
directions). A step's share of "the link's limit" is its bytes at the nominal rate; what TCP reaches on the same link
is the ceiling any arm can approach, and one that sends both ways at once carries its acknowledgements in the queue
of the other direction's data. Printed and recorded by ``bench network`` before its arms.

``python -m hvdtrain.bench.linkprobe serve PORT BYTES BOTH`` on one host and ``... connect ADDRESS PORT BYTES BOTH``
on the other: each prints one JSON line with the seconds its receiving took from the first byte to the last (and,
with BOTH=1, sends BYTES the other way meanwhile).
"""
from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Dict, List

CHUNK = 1 << 20


def _send(sock: socket.socket, nbytes: int) -> None:
    block = b"\0" * CHUNK
    left = nbytes
    while left > 0:
        sock.sendall(block[:min(left, CHUNK)])
        left -= min(left, CHUNK)


def _exchange(sock: socket.socket, nbytes: int, both: bool, receives: bool) -> Dict[str, float]:
    """Send (when this end sends) while receiving ``nbytes`` (when it receives); the seconds from the first byte
    received to the last."""
    sender = threading.Thread(target=_send, args=(sock, nbytes), daemon=True) if both or not receives else None
    if sender is not None:
        sender.start()
    first = last = 0.0
    got = 0
    while receives and got < nbytes:
        data = sock.recv(min(CHUNK, nbytes - got))  # not into the peer's closing byte
        if not data:
            raise RuntimeError(f"linkprobe: the connection closed after {got} of {nbytes} bytes")
        if not got:
            first = time.perf_counter()
        got += len(data)
    last = time.perf_counter()
    if sender is not None:
        sender.join()
    # An end that received says so; one that sent waits to hear it: neither closes with the other's bytes in flight.
    if receives:
        sock.sendall(b"k")
    if sender is not None and sock.recv(1) != b"k":
        raise RuntimeError("linkprobe: the other end closed before it had received every byte")
    return {"recv_seconds": last - first if receives else 0.0}


def main(argv: List[str]) -> int:
    mode = argv[0]
    both = argv[-1] == "1"
    nbytes = int(argv[-2])
    if mode == "serve":
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("0.0.0.0", int(argv[1])))
        server.listen(1)
        print("listening", flush=True)
        sock, _ = server.accept()
        result = _exchange(sock, nbytes, both, receives=True)
    else:
        address, port = argv[1], int(argv[2])
        sock = socket.create_connection((address, port), timeout=30)
        sock.settimeout(120)
        # one way: host0 only sends (the receiver's figure is the one); both ways: it receives as well
        result = _exchange(sock, nbytes, both, receives=both)
    sock.close()
    print(json.dumps(result), flush=True)
    return 0


PORT = 29700


def probe(cluster, rate_bits: float, nbytes: int = 8 << 20, repeats: int = 3, timeout: float = 120) -> Dict:
    """The fraction of ``rate_bits`` that TCP reaches from host0 to host1 one way, and each way at once over one
    connection: the medians of ``repeats`` runs of ``nbytes`` each, with every run's figure."""
    out: Dict[str, List[float]] = {"one_way": [], "both_ways": []}
    for _ in range(repeats):
        for kind in out:
            both = "1" if kind == "both_ways" else "0"
            args = [sys.executable, "-m", "hvdtrain.bench.linkprobe"]
            server = subprocess.Popen([*cluster.prefix(1), *args, "serve", str(PORT), str(nbytes), both],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                if server.stdout.readline().strip() != "listening":
                    raise RuntimeError("linkprobe: host1's end did not start: " + server.stderr.read().strip())
                client = subprocess.run([*cluster.prefix(0), *args, "connect", cluster.addresses[1], str(PORT),
                                         str(nbytes), both], capture_output=True, text=True, timeout=timeout)
                served, err = server.communicate(timeout=timeout)
            finally:
                if server.poll() is None:
                    server.kill()
                    server.wait()
            if client.returncode or server.returncode:
                raise RuntimeError("linkprobe failed: " + (client.stderr or err).strip().splitlines()[-1])
            seconds = [json.loads(served.splitlines()[-1])["recv_seconds"]]
            if both == "1":
                seconds.append(json.loads(client.stdout.splitlines()[-1])["recv_seconds"])
            out[kind].append(min(nbytes * 8 / rate_bits / s for s in seconds))  # the slower direction's
    return {"bytes": nbytes, "repeats": repeats, **{k: statistics.median(v) for k, v in out.items()},
            "samples": out}


def measure(cluster, rate: str) -> Dict:
    """:func:`probe` on the cluster at its rate (tc's syntax), printed, as ``{"link_probe": ...}``; a failure is a
    warning, as ``{"link_probe_error": ...}``: the figures it would add to are kept."""
    from .costmodel import rate_bits
    try:
        result = probe(cluster, rate_bits(rate))
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"hvdtrain: warning: {e}; the results are written without the link's own ceiling", file=sys.stderr,
              flush=True)
        return {"link_probe_error": str(e)}
    print(describe(result), flush=True)
    return {"link_probe": result}


def describe(result: Dict) -> str:
    return (f"bench: the link itself (host0 and host1, {result['bytes'] >> 20} MiB, median of {result['repeats']}): "
            f"one TCP stream {100 * result['one_way']:.1f}% of the rate, one connection both ways at once "
            f"{100 * result['both_ways']:.1f}% each way")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
