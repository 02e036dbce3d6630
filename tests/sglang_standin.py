"""A STAND-IN for an SGLang server (SGLang needs CUDA and cannot run on this machine).

It implements the endpoints weightsync uses and enforces SGLang's documented
contract, failure modes included, so the adapter is tested against them:
- ``/release_memory_occupation`` asserts the server is idle (no running requests);
- ``/resume_memory_occupation`` with a tag that was not released raises KeyError in
  SGLang's scheduler and kills it: here the whole process exits;
- ``/continue_generation`` does not check memory state (it is the caller's job);
- the weight update group is real: ``/init_weights_update_group`` joins the
  trainer's group the way SGLang does (torch's rendezvous at ``tcp://master``, a
  ``PrefixStore(group_name)``, torch's group helper), and
  ``/update_weights_from_distributed`` receives every tensor by a real broadcast from
  rank 0 (gloo on this machine, nccl in SGLang on a GPU), or with ``load_format``
  ``"flattened_bucket"`` all of them as one broadcast of their bytes end to end, then
  loads them by name:
  an unknown name fails mid-way and leaves the weights partly updated, as SGLang's
  ``load_weights`` does;
- an update with ``flush_cache`` while requests are held by an in-place pause fails
  the cache flush, which SGLang's scheduler asserts on: the process exits.
Every POST is appended to CALL_LOG (one JSON object per line). ``/start_requests``,
``/standin/weights``, ``/standin/paused`` and ``/standin/break_version`` are test hooks, not SGLang
endpoints; ``--slow-state S`` makes ``/health`` and ``/model_info`` take S seconds.

    python sglang_standin.py PORT_FILE CALL_LOG --model-dir DIR [--tp-size N] [--drop-param NAME]
                             [--die-during-update] [--port P]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.distributed_c10d import _new_process_group_helper, _world

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from weightsync.packing import weights_digest  # noqa: E402  (the test hook's digest)

ARGS = argparse.Namespace(die_during_update=False, fail_version_update=False, slow_state=0.0)  # main() fills it; tests import the recipe
state = {"paused": "", "released": set(), "running": 0, "weight_version": "default"}  # SGLang boots with "default"
lock = threading.Lock()           # control state
weights_lock = threading.Lock()   # one weight update at a time, as SGLang's model_update_lock
params: dict[str, torch.Tensor] = {}
groups: dict[str, list[dist.ProcessGroup]] = {}  # one group per tp worker
GROUP_TIMEOUT = timedelta(seconds=120)


def join_update_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                      backend: str) -> dist.ProcessGroup:
    """SGLang's recipe for its update group (the same torch calls, in the same order)."""
    store, rank, world_size = next(dist.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                   timeout=GROUP_TIMEOUT))
    store.set_timeout(GROUP_TIMEOUT)
    store = dist.PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name,
                                      timeout=GROUP_TIMEOUT)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def join_as_another_worker(master_address: str, master_port: int, rank: int, world_size: int,
                           group_name: str) -> dist.ProcessGroup:
    """A second tp worker of the same SGLang. In SGLang each worker is a process of its
    own running the recipe above; in one process torch refuses a second group under the
    same name, so this worker is a bare gloo group on exactly the store keys the
    recipe's group uses (torch's helper prefixes ``<group_name>/`` and ``cpu/``)."""
    store, rank, world_size = next(dist.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                   timeout=GROUP_TIMEOUT))
    keyed = dist.PrefixStore("cpu/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
    return dist.ProcessGroupGloo(keyed, rank, world_size, GROUP_TIMEOUT)


def _broadcast_from_0(weight: torch.Tensor, pg: dist.ProcessGroup):
    if isinstance(pg, dist.ProcessGroupGloo):  # a bare group (join_as_another_worker)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return pg.broadcast([weight], opts)
    return dist.broadcast(weight, src=0, group=pg, async_op=True)


def on_every_worker(fn, count: int) -> list:
    """``fn(worker)`` for each of SGLang's ``count`` tp workers at once (each is a
    process in SGLang; a thread here): the group's collectives need every rank."""
    results: list = [None] * count

    def run(worker: int) -> None:
        try:
            results[worker] = fn(worker)
        except Exception as exc:
            results[worker] = exc

    threads = [threading.Thread(target=run, args=(w,)) for w in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [r for r in results if isinstance(r, Exception)]
    if failed:
        raise failed[0]
    return results


def receive(names, dtypes, shapes, pg) -> list[tuple[str, torch.Tensor]]:
    """One worker's part of update_weights_from_distributed: post every broadcast, wait."""
    received, handles = [], []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        weight = torch.empty(shape, dtype=getattr(torch, dtype))
        handles.append(_broadcast_from_0(weight, pg))
        received.append((name, weight))
    for i, handle in enumerate(handles):
        handle.wait()
        if ARGS.die_during_update and i == 0:
            os._exit(72)
    return received


def receive_flattened(names, dtypes, shapes, pg) -> list[tuple[str, torch.Tensor]]:
    """One worker's part of update_weights_from_distributed with load_format
    "flattened_bucket", as SGLang's FlattenedTensorBucket does it: empty tensors, their
    bytes end to end (no padding) in one uint8 tensor, one broadcast of it, then each
    tensor cut back out by byte offsets and viewed as its dtype (which fails, as in
    SGLang, for a tensor that starts at an offset its element size does not divide)."""
    empties = [torch.empty(shape, dtype=getattr(torch, dtype)) for dtype, shape in zip(dtypes, shapes, strict=True)]
    flat = torch.cat([t.flatten().view(torch.uint8) for t in empties])
    _broadcast_from_0(flat, pg).wait()
    if ARGS.die_during_update:
        os._exit(72)
    received, start = [], 0
    for name, t in zip(names, empties, strict=True):
        end = start + t.nbytes
        received.append((name, flat[start:end].view(t.dtype).reshape(t.shape)))
        start = end
    return received


def receive_and_load(names, dtypes, shapes, pgs, load_format=None) -> None:
    """SGLang's update_weights_from_distributed on every tp worker (each receives the
    full tensors and would load its own shards), then load by name. Here the workers
    share one copy of the model: worker 0's tensors are loaded, and every other worker
    must have received the same bytes."""
    how = receive_flattened if load_format == "flattened_bucket" else receive
    per_worker = on_every_worker(lambda w: how(names, dtypes, shapes, pgs[w]), len(pgs))
    for other in per_worker[1:]:
        if any(not torch.equal(a, b) for (_, a), (_, b) in zip(per_worker[0], other, strict=True)):
            raise RuntimeError("tp workers received different bytes")
    for name, weight in per_worker[0]:  # load_weights: stops at the first bad name, partly updated
        params[name].copy_(weight)


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
        if self.path in ("/health", "/model_info"):
            time.sleep(ARGS.slow_state)  # an engine too busy to answer quickly
        if self.path == "/health":
            return self._reply(200, {})
        if self.path == "/model_info":
            if state.get("version_broken"):
                return self._reply(500, {"error": "test hook: /model_info broken"})
            return self._reply(200, {"model_path": ARGS.report_model_path or ARGS.model_dir, "is_generation": True,
                                     "weight_version": state["weight_version"]})
        if self.path == "/get_server_info":
            return self._reply(200, {"model_path": ARGS.model_dir, "tp_size": ARGS.tp_size, "pp_size": 1,
                                     "dp_size": 1, "weight_version": state["weight_version"]})
        if self.path == "/standin/weights":
            with weights_lock:
                return self._reply(200, {"digest": weights_digest(sorted(params.items())),
                                         "groups": sorted(groups)})
        if self.path == "/standin/paused":  # test hook: the scheduler's pause state
            with lock:
                return self._reply(200, {"paused": state["paused"]})
        return self._reply(404, {"error": "not found"})

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        with open(ARGS.call_log, "a") as log:
            log.write(json.dumps({"path": self.path, "body": body}) + "\n")
        if self.path in ("/init_weights_update_group", "/update_weights_from_distributed",
                         "/destroy_weights_update_group"):
            return self._weights(body)
        with lock:
            if self.path == "/standin/break_version":  # test hook: /model_info answers HTTP 500
                state["version_broken"] = bool(body.get("broken", True))
                return self._reply(200, {})
            if self.path == "/pause_generation":
                if body.get("mode") not in ("abort", "retract", "in_place"):
                    return self._reply(400, {"error": f"bad mode {body.get('mode')}"})
                if body["mode"] == "abort":
                    state["running"] = 0
                state["paused"] = body["mode"]
                return self._reply(200, {})
            if self.path == "/continue_generation":
                state["paused"] = ""
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
            if self.path == "/update_weight_version":
                if ARGS.fail_version_update:
                    return self._reply(500, {"error": "injected: update_weight_version failed"})
                state["weight_version"] = str(body["new_version"])
                return self._reply(200, {"success": True, "new_version": state["weight_version"]})
            if self.path == "/start_requests":  # test hook: requests in flight
                state["running"] += int(body.get("n", 1))
                return self._reply(200, {"running": state["running"]})
        return self._reply(404, {"error": "not found"})

    def _weights(self, body: dict) -> None:
        name = body.get("group_name", "")
        if self.path == "/init_weights_update_group":
            if not name or name in groups:
                return self._reply(400, {"success": False, "message": f"bad or existing group name {name!r}"})
            try:
                # Every tp worker joins, at rank_offset + its tp rank, as SGLang's do.
                host, port = body["master_address"], int(body["master_port"])
                offset, world = int(body["rank_offset"]), int(body["world_size"])
                groups[name] = on_every_worker(
                    lambda w: join_update_group(host, port, offset, world, name, body.get("backend", "nccl"))
                    if w == 0 else join_as_another_worker(host, port, offset + w, world, name), ARGS.tp_size)
            except Exception as exc:
                return self._reply(400, {"success": False, "message": f"Failed to initialize custom process "
                                                                      f"group: {exc}."})
            return self._reply(200, {"success": True, "message": "Succeeded to initialize custom process group."})
        if self.path == "/destroy_weights_update_group":
            pgs = groups.pop(name, None)
            if pgs is None:
                return self._reply(400, {"success": False, "message": "The group to be destroyed does not exist."})
            dist.destroy_process_group(pgs[0])  # the recipe's group; the others are dropped with the list
            return self._reply(200, {"success": True, "message": "Succeeded to destroy custom process group."})
        if name not in groups:
            return self._reply(400, {"success": False, "message": f"Group {name} not in {sorted(groups)}"})
        with weights_lock:
            try:
                receive_and_load(body["names"], body["dtypes"], body["shapes"], groups[name],
                                 body.get("load_format"))
            except Exception as exc:
                return self._reply(400, {"success": False, "message": f"Failed to update parameter online: "
                                         f"{type(exc).__name__}: {exc}. The full weights of the ModelRunner "
                                         "are partially updated. Please discard the whole weights."})
            if body.get("flush_cache", True) and state["paused"] == "in_place" and state["running"]:
                os._exit(71)  # "Cache flush failed after updating weights": the scheduler's assert
            return self._reply(200, {"success": True, "message": "Succeeded to update parameter online."})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port_file")
    parser.add_argument("call_log")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--drop-param", default="", help="serve a model that lacks this checkpoint tensor")
    parser.add_argument("--report-model-path", default="",
                        help="what /model_info reports as model_path (a hub id, say), if not --model-dir")
    parser.add_argument("--die-during-update", action="store_true",
                        help="crash (as a scheduler would) after the first tensor of an update arrived")
    parser.add_argument("--slow-state", type=float, default=0.0,
                        help="seconds /health and /model_info take to answer (a busy engine)")
    parser.add_argument("--fail-version-update", action="store_true",
                        help="answer /update_weight_version with HTTP 500 (the weights themselves load)")
    parser.add_argument("--port", type=int, default=0, help="listen here (0: an ephemeral port)")
    parser.parse_args(namespace=ARGS)
    for path in sorted(glob.glob(os.path.join(ARGS.model_dir, "*.safetensors"))):
        params.update(load_file(path))
    params.pop(ARGS.drop_param, None)
    server = ThreadingHTTPServer(("127.0.0.1", ARGS.port), Handler)
    with open(ARGS.port_file + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(ARGS.port_file + ".tmp", ARGS.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
