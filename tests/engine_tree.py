"""A multi-process stand-in for an engine such as vLLM (a test helper, not a fake of our code).

The top process forks two workers; each worker forks a grandchild; one grandchild
ignores SIGTERM, like a stuck worker, and maps the shared memory named in its
environment (``map_shared_memory``); the top process may hold a named semaphore
(``named_semaphore``). All pids go to PIDS_FILE. The top process
serves an HTTP health check on PORT (default: ephemeral), written to PORT_FILE.

    python engine_tree.py PIDS_FILE PORT_FILE [PORT]
"""

from __future__ import annotations

import http.server
import os
import signal
import socketserver
import sys
import threading
import time


def map_shared_memory() -> list:
    """With ENGINE_TREE_SHM=NAME: makes /dev/shm/NAME and maps it, never to unlink it
    (as a killed engine, or vLLM, leaves its segments); with ENGINE_TREE_SHM_MAP=PATH[:PATH]
    also maps those files (other processes' segments) once they exist."""
    import mmap

    maps = []
    paths = []
    if os.environ.get("ENGINE_TREE_SHM"):
        path = os.path.join("/dev/shm", os.environ["ENGINE_TREE_SHM"])
        with open(path, "wb") as f:
            f.truncate(1 << 20)
        paths.append(path)
    if os.environ.get("ENGINE_TREE_SHM_MAP"):
        paths += os.environ["ENGINE_TREE_SHM_MAP"].split(":")
    for path in paths:
        end = time.monotonic() + 30
        while not os.path.exists(path) and time.monotonic() < end:  # the test may make it later
            time.sleep(0.05)
        with open(path, "r+b") as f:
            maps.append(mmap.mmap(f.fileno(), 0))
    return maps


def named_semaphore():
    """With ENGINE_TREE_SEM=PATH: a named semaphore, made as a spawn-context
    multiprocessing lock makes one (vLLM's API server makes some), its /dev/shm path
    written to PATH. It is registered with a resource tracker, a child of this process,
    which unlinks it once every process sharing the tracker's pipe -- this one and
    everything it forks after -- has exited."""
    path = os.environ.get("ENGINE_TREE_SEM")
    if not path:
        return None
    import multiprocessing

    semaphore = multiprocessing.get_context("spawn").Lock()
    with open(path, "w") as f:
        f.write("/dev/shm/sem." + semaphore._semlock.name.lstrip("/"))
    return semaphore


def sleeper(ignore_term: bool) -> None:
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        held = map_shared_memory()  # noqa: F841 - mapped for as long as this process lives
    while True:
        time.sleep(1)


def worker(index: int, pids: list[int], write) -> None:
    pid = os.fork()
    if pid == 0:
        sleeper(ignore_term=index == 1)
    write(pid)
    sleeper(ignore_term=False)


def main() -> None:
    pids_file, port_file = sys.argv[1], sys.argv[2]
    port = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    lock = threading.Lock()

    def write(pid: int) -> None:
        with lock, open(pids_file, "a") as f:
            f.write(f"{pid}\n")

    write(os.getpid())
    semaphore = named_semaphore()  # noqa: F841 - held for as long as this process lives
    for i in range(2):
        pid = os.fork()
        if pid == 0:
            worker(i, [], write)
            os._exit(0)
        write(pid)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    socketserver.TCPServer.allow_reuse_address = True
    with socketserver.TCPServer(("127.0.0.1", port), Health) as server:
        with open(port_file + ".tmp", "w") as f:
            f.write(str(server.server_address[1]))
        os.replace(port_file + ".tmp", port_file)
        server.serve_forever()


if __name__ == "__main__":
    main()
