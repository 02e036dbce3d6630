"""The vLLM adapter's answers to a vLLM that misbehaves, without vLLM.

A stand-in HTTP server answers as vLLM 0.32 does (the same paths and bodies); the
real behaviour behind each answer is checked against a real vLLM in the vLLM tier
(``tests/vllm/test_vllm_restart.py``, ``tests/vllm/test_vllm_e2e.py``). Here, where
``make test SKIP_VLLM=1`` leaves that tier out, the adapter's side is pinned down:
- a ``collective_rpc`` that vLLM says timed out makes every later call to the
  workers refused without reaching vLLM (its replies are out of step), asks for a
  restart, and a relaunch clears it;
- vLLM's version recording an unfinished receive reads as the version it started
  from, with the version it was moving to;
- a ``/sleep`` whose call failed is counted asleep;
- a vLLM started again by whatever runs it reads as its boot version record again:
  the agent's watch counts that as a restart (an engine it did not launch), and the
  digest of what the adapter received into the old process is no longer vouched for;
  an agent started beside a vLLM synced before it vouches for what every worker says
  it loaded whole, and for nothing while a receive is recorded unfinished;
- the worker's receive ends before vLLM stops waiting for it.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from weightsync.engine.vllm import VllmAdapter, worker_deadline_s
from weightsync.errors import DigestWithheld, EngineFault, EngineUnavailable, StepTimeoutError
from weightsync.server.agent.engine_watch import EngineWatch


class StandIn:
    """A vLLM stand-in: ``answers`` maps "METHOD /path" to (status, body); every request
    is recorded in ``calls``."""

    def __init__(self) -> None:
        self.answers: dict[str, tuple[int, dict]] = {}
        self.calls: list[str] = []
        self.stall = threading.Event()  # set: requests wait until it is cleared (a stalled server)
        self.cut: set[str] = set()  # "METHOD /path"s answered with half a body, then the connection closed
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                key = f"{self.command} {self.path.split('?')[0]}"
                outer.calls.append(key)
                if outer.stall.is_set():
                    outer.released.wait(10)
                status, body = outer.answers.get(key, (200, {}))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if key in outer.cut:  # as a server killed while it writes its answer
                    self.wfile.write(data[:len(data) // 2])
                    self.close_connection = True
                    return
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the caller gave up before a stalled answer came: what a stall test does

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        self.released = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def vllm():
    stand_in = StandIn()
    yield stand_in
    stand_in.close()


def test_a_vllm_that_dies_while_it_answers_is_unavailable_not_a_failed_transfer(vllm):
    """A vLLM killed mid-answer (its headers sent, half its body) broke the agent's call
    with http.client's IncompleteRead, which is neither an OSError nor a URLError: the
    round reported the engine's receive as TRANSFER_FAILED, not ENGINE_UNAVAILABLE
    (found by tests/vllm/test_vllm_restart.py killing vLLM mid-round, once in several runs)."""
    adapter = VllmAdapter(vllm.url, timeout_s=5)
    vllm.answers["POST /collective_rpc"] = (200, {"results": [{"vocab_size": 8}]})
    vllm.cut.add("POST /collective_rpc")
    with pytest.raises(EngineUnavailable, match="unreachable"):
        adapter.collective_rpc("weightsync_probe_limits", timeout_s=1)


def test_a_worker_call_vllm_timed_out_stops_all_later_calls_until_a_relaunch(vllm):
    adapter = VllmAdapter(vllm.url, timeout_s=5)
    vllm.answers["POST /collective_rpc"] = (200, {"results": [{"vocab_size": 8}]})
    assert adapter.collective_rpc("weightsync_probe_limits", timeout_s=1) == [{"vocab_size": 8}]
    vllm.answers["POST /collective_rpc"] = (500, {"error": {"message": "Call to collective_rpc method failed: "
                                                             "RPC call to weightsync_probe_limits timed out."}})
    with pytest.raises(EngineFault, match="must be restarted"):
        adapter.collective_rpc("weightsync_probe_limits", timeout_s=1)
    assert "must be restarted" in adapter.restart_needed() and "must be restarted" in adapter.fault()
    vllm.answers["POST /collective_rpc"] = (200, {"results": [{"vocab_size": 8}]})
    asked = vllm.calls.count("POST /collective_rpc")
    with pytest.raises(EngineFault, match="must be restarted"):
        adapter.collective_rpc("weightsync_probe_limits", timeout_s=1)  # its answer would be another call's
    assert vllm.calls.count("POST /collective_rpc") == asked, "the call reached vLLM"
    adapter.engine_restarted()
    assert adapter.restart_needed() == ""
    assert adapter.collective_rpc("weightsync_probe_limits", timeout_s=1) == [{"vocab_size": 8}]


def test_a_worker_call_that_fails_otherwise_asks_for_no_restart(vllm):
    adapter = VllmAdapter(vllm.url, timeout_s=5)
    vllm.answers["POST /collective_rpc"] = (500, {"error": {"message": "Call to collective_rpc method failed: "
                                                             "worker extension not loaded"}})
    with pytest.raises(EngineFault, match="not loaded"):
        adapter.collective_rpc("weightsync_probe_limits", timeout_s=1)
    assert adapter.restart_needed() == ""


def test_an_unfinished_receive_reads_as_its_old_version_and_names_the_new(vllm):
    adapter = VllmAdapter(vllm.url, timeout_s=5)
    vllm.answers["GET /weight_info"] = (200, {"weight_version": adapter.receiving_marker(7, 6)})
    assert adapter.weight_version == 6 and adapter.torn_to() == 7
    vllm.answers["GET /weight_info"] = (200, {"weight_version": "7"})
    assert adapter.weight_version == 7 and adapter.torn_to() is None
    vllm.answers["GET /weight_info"] = (200, {"weight_version": "weightsync-receiving-garbage"})
    assert adapter.weight_version == 0 and adapter.torn_to() is None  # unreadable: behind anything


def test_a_vllm_started_again_behind_the_agent_is_told_by_its_boot_version_record(vllm):
    adapter = VllmAdapter(vllm.url, timeout_s=5)
    watch = EngineWatch(adapter)
    try:
        vllm.answers["GET /weight_info"] = (200, {"weight_version": "default"})
        watch.poll_once()
        assert watch.reboots == 0 and adapter.version_is_boot()  # booted, never synced: nothing to tell
        with pytest.raises(DigestWithheld, match="boot weights"):
            adapter.weights_digest()
        # synced by an agent before this one: the workers say what they last loaded whole
        vllm.answers["GET /weight_info"] = (200, {"weight_version": "2"})
        vllm.answers["POST /collective_rpc"] = (200, {"results": [{"digest": "d0"}, {"digest": ""}]})
        with pytest.raises(DigestWithheld, match="do not all vouch"):  # one worker's receive was cut
            adapter.weights_digest()
        vllm.answers["POST /collective_rpc"] = (200, {"results": [{"digest": "d0"}, {"digest": "d0"}]})
        assert adapter.weights_digest() == "d0"
        vllm.answers["GET /weight_info"] = (200, {"weight_version": adapter.receiving_marker(3, 2)})
        with pytest.raises(DigestWithheld, match="moving to version 3"):  # never the bytes of before
            adapter.weights_digest()
        adapter.last_received_digest = ""
        adapter.last_received_digest = "d1"  # what a receive into this process loaded
        watch.committed(3)
        vllm.answers["GET /weight_info"] = (200, {"weight_version": adapter.receiving_marker(4, 3)})
        watch.poll_once()  # a receive under way is weightsync's record too
        vllm.answers["GET /weight_info"] = (200, {"weight_version": "3"})
        watch.poll_once()
        assert watch.reboots == 0 and adapter.weights_digest() == "d1"
        vllm.answers["GET /weight_info"] = (500, {})  # down while it restarts: unknown, not a restart yet
        watch.poll_once()
        assert watch.reboots == 0 and not watch.snapshot.version_known
        assert adapter.weights_digest() == ""  # what vLLM holds cannot be vouched for
        vllm.answers["GET /weight_info"] = (200, {"weight_version": "default"})
        watch.poll_once()
        watch.poll_once()
        assert watch.reboots == 1 and watch.snapshot.weight_version == 0  # counted once
        with pytest.raises(DigestWithheld, match="boot weights"):  # not the old process's digest
            adapter.weights_digest()
    finally:
        watch.close()


def test_an_engine_the_agent_launched_is_the_launchers_to_count(vllm):
    adapter = VllmAdapter(vllm.url, timeout_s=5)
    watch = EngineWatch(adapter, launcher=object())  # only its presence matters here
    try:
        watch.committed(2)
        vllm.answers["GET /weight_info"] = (200, {"weight_version": "default"})
        watch.poll_once()
        assert watch.reboots == 0
    finally:
        watch.close()


def test_a_sleep_whose_call_timed_out_is_counted_asleep(vllm):
    adapter = VllmAdapter(vllm.url, timeout_s=0.5)
    vllm.stall.set()  # the server takes the call, and answers too late
    with pytest.raises(StepTimeoutError):
        adapter.sleep(["kv_cache"])
    assert adapter.asleep == ["kv_cache", "weights"]  # so every resume wakes first


def test_the_workers_receive_ends_before_vllm_stops_waiting():
    for left in (0.5, 4.0, 30.0, 180.0, 3600.0):
        worker = worker_deadline_s(left)
        assert left / 2 <= worker < left
    assert worker_deadline_s(180.0) == pytest.approx(180.0 - 5.0 - 9.0)


def test_a_sharded_trainers_owners_go_whole_once_then_by_key_and_whole_again_to_a_worker_that_forgot(vllm):
    """A sharded trainer's owners (every rank's parts: megabytes at 20k tensors) go to
    vLLM's workers whole once, then by their key while the workers keep them; a worker
    that no longer keeps them (it keeps the last few; vLLM restarted behind the
    adapter's back) answers OwnersUnknown before receiving anything, and gets them
    whole in the same receive. Each round's lanes always go in full. (What the real
    worker does with both: tests/vllm/test_vllm_e2e.py, a sharded round by key.)"""
    import time

    from google.protobuf import json_format

    from tests.test_sharding import chunk_holdings
    from weightsync.engine.adapter import Delivery
    from weightsync.sharding import Owners, assign, describe
    from weightsync.transport.from_senders import SenderLane
    from weightsync.v1 import common_pb2

    plan, planned = assign([describe(h) for h in chunk_holdings(2)], bucket_bytes=64)
    owners = Owners.from_proto(planned.to_proto(), plan)  # as the agent has them: checked, with their key
    worker_keeps: set[str] = set()
    sent: list[tuple[bool, list[str]]] = []  # per call: parts sent whole?, the lanes' sessions

    def collective_rpc(method, *args, timeout_s):
        owners_json, key = args[6], args[7]
        assert args[8] == "", "the parts were to be hashed in a round that does not verify"
        msg = json_format.Parse(owners_json, common_pb2.Owners())
        whole = any(s.tensors for s in msg.senders)
        sent.append((whole, [s.lane.session_id for s in msg.senders]))
        if not whole and key not in worker_keeps:
            return [{"error": f"OwnersUnknown: this worker keeps no owners {key}"}]
        worker_keeps.add(key)
        return [{"digest": "d", "bytes": plan.total_bytes}]

    adapter = VllmAdapter(vllm.url)
    adapter.collective_rpc = collective_rpc

    def receive(round_: int) -> dict[str, str]:
        lanes = tuple(SenderLane(common_pb2.Rendezvous(session_id=f"s{round_}-{r}", sender=r), owners.part_plan(r),
                                 None, r) for r in owners.sender_ranks)
        adapter.receive(Delivery(rendezvous=lanes[0].rendezvous, rank=1, plan=plan, receiver=None,
                                 deadline_at=time.monotonic() + 10, abort=threading.Event(), senders=lanes, owners=owners, version=round_))
        return adapter.receive_stats()

    assert "owners" not in receive(1).get("sent_by_key", "")
    assert "owners" in receive(2)["sent_by_key"]
    worker_keeps.clear()
    assert "owners" not in receive(3).get("sent_by_key", "")
    assert [whole for whole, _ in sent] == [True, False, False, True], sent
    assert all(sessions == [f"s{r}-0", f"s{r}-1"] for r, (_, sessions) in zip((1, 2, 3, 3), sent, strict=True))


async def test_a_vllm_seen_booted_again_is_not_resumed_by_the_pause_keeper(vllm):
    """A vLLM booted paused (``--scheduler-cls weightsync.engine.vllm_boot_paused.scheduler``,
    checked with a real vLLM in tests/vllm/test_vllm_restart.py) and restarted behind its
    agent holds its boot weights, paused, while the agent still lets the old process run.
    The poll that tells the restart also finds it paused; the pause keeper, which puts a
    differing engine back, checked before the reboot handler had fenced it and woke it
    (``/wake_up``): the boot weights served until the fence paused it again. It now leaves
    an engine seen booted again to that handler. (The agent's engine commands and fence
    are stand-ins: only what the keeper may use of them.)"""
    import asyncio
    import types

    from weightsync.server.agent.engine_ledger import EngineLedger
    from weightsync.server.agent.pause_keeper import PauseKeeper

    adapter = VllmAdapter(vllm.url, timeout_s=5)
    watch = EngineWatch(adapter)
    control = types.SimpleNamespace(engine_id="vllm-0", watch=watch, adapter=adapter, fault=lambda: "",
                                    record=lambda *args, **kw: None)

    async def run_on_engine(fn, *args, **kwargs):
        return fn(*args, **kwargs)

    control.run_on_engine = run_on_engine
    fence = types.SimpleNamespace(fenced=False, lock=asyncio.Lock())
    keeper = PauseKeeper(EngineLedger(), control, fence)
    try:
        watch.committed(3)  # the agent synced the old process
        vllm.answers["GET /weight_info"] = (200, {"weight_version": "default"})
        vllm.answers["GET /is_paused"] = (200, {"is_paused": True})
        vllm.answers["POST /wake_up"] = (200, {"status": "awake"})
        watch.poll_once()
        assert watch.reboots == 1 and watch.reboot_pending
        await keeper.check()
        assert "POST /wake_up" not in vllm.calls and "POST /resume" not in vllm.calls, vllm.calls
        # Once the handler has taken it (and would have fenced it), a paused engine the
        # agent lets run is woken: the keeper's own work, unchanged.
        watch._reboots_handled = watch.reboots
        await keeper.check()
        assert "POST /wake_up" in vllm.calls
    finally:
        watch.close()


def test_a_launched_vllm_that_does_not_boot_paused_is_named_at_start():
    """The agent warns when the vLLM command it launches lacks the boot-paused scheduler
    (its relaunches would serve boot weights until the agent's pause), in either way of
    writing the option, and says nothing when it is there."""
    from weightsync.engine.vllm import BOOT_PAUSED_SCHEDULER, boot_paused_hint

    serve = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"]
    assert BOOT_PAUSED_SCHEDULER in boot_paused_hint(serve)
    assert BOOT_PAUSED_SCHEDULER in boot_paused_hint([*serve, "--scheduler-cls", "my.own.Scheduler"])
    assert boot_paused_hint([*serve, "--scheduler-cls", BOOT_PAUSED_SCHEDULER]) == ""
    assert boot_paused_hint([*serve, f"--scheduler-cls={BOOT_PAUSED_SCHEDULER}"]) == ""


def test_the_boot_paused_scheduler_is_the_one_vllm_would_build_paused(monkeypatch):
    """``weightsync.engine.vllm_boot_paused.scheduler`` builds vLLM's asynchronous
    scheduler where vLLM schedules asynchronously (its default on GPU) and the plain one
    otherwise, with vLLM's own arguments, and pauses it before it returns. A real vLLM
    booted with it (the plain one: vLLM on CPU does not schedule asynchronously) is
    checked in tests/vllm/test_vllm_restart.py; the asynchronous branch has not run in a
    real vLLM here. vLLM's classes are stand-ins that record what they were given."""
    pytest.importorskip("vllm")
    import types

    from vllm.v1.core.sched.interface import PauseState

    from weightsync.engine import vllm_boot_paused

    class Built:
        def __init__(self, *args, **kwargs) -> None:
            self.args, self.kwargs, self.states = args, kwargs, []

        def set_pause_state(self, state) -> None:
            self.states.append(state)

    class Plain(Built):
        pass

    class Async(Built):
        pass

    monkeypatch.setattr(vllm_boot_paused, "Scheduler", Plain)
    monkeypatch.setattr(vllm_boot_paused, "AsyncScheduler", Async)
    for asynchronous, kind in ((True, Async), (False, Plain)):
        config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(async_scheduling=asynchronous))
        built = vllm_boot_paused.scheduler(vllm_config=config, kv_cache_config="kv", block_size=16)  # as vLLM calls it
        assert type(built) is kind and built.args == (config,)
        assert built.kwargs == {"kv_cache_config": "kv", "block_size": 16}
        assert built.states == [PauseState.PAUSED_ALL]
