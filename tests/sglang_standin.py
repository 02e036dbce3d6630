"""A STAND-IN for an SGLang server (SGLang needs CUDA and cannot run on this machine).

It implements the control endpoints weightsync uses and enforces SGLang's documented
contract, failure modes included, so the adapter's ledger is tested against them:
- ``/release_memory_occupation`` asserts the server is idle (no running requests);
- ``/resume_memory_occupation`` with a tag that was not released raises KeyError in
  SGLang's scheduler and kills it: here the whole process exits;
- ``/continue_generation`` does not check memory state (it is the caller's job).
Every call is appended to CALL_LOG (one JSON object per line).

    python sglang_standin.py PORT_FILE CALL_LOG
"""

from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

state = {"paused": False, "released": set(), "running": 0, "weight_version": "0"}
lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass

    def do_GET(self):
        if self.path == "/health":
            return self._reply(200, {})
        if self.path == "/model_info":
            return self._reply(200, {"model_path": "standin", "weight_version": state["weight_version"]})
        return self._reply(404, {"error": "not found"})

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        with open(sys.argv[2], "a") as log:
            log.write(json.dumps({"path": self.path, "body": body}) + "\n")
        with lock:
            if self.path == "/pause_generation":
                if body.get("mode") not in ("abort", "retract", "in_place"):
                    return self._reply(400, {"error": f"bad mode {body.get('mode')}"})
                if body["mode"] == "abort":
                    state["running"] = 0
                state["paused"] = True
                return self._reply(200, {})
            if self.path == "/continue_generation":
                state["paused"] = False
                return self._reply(200, {})
            if self.path == "/release_memory_occupation":
                if state["running"]:
                    return self._reply(500, {"error": "AssertionError: release_memory_occupation needs an idle "
                                                      f"server, {state['running']} requests running"})
                state["released"].update(body.get("tags") or ["weights", "kv_cache"])
                return self._reply(200, {})
            if self.path == "/resume_memory_occupation":
                tags = body.get("tags") or ["weights", "kv_cache"]
                if not set(tags) <= state["released"]:
                    os._exit(70)  # KeyError in the scheduler: SGLang dies
                state["released"].difference_update(tags)
                return self._reply(200, {})
            if self.path == "/start_requests":  # test hook: requests in flight
                state["running"] += int(body.get("n", 1))
                return self._reply(200, {"running": state["running"]})
        return self._reply(404, {"error": "not found"})


def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    server.serve_forever()


if __name__ == "__main__":
    main()
