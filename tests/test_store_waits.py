"""The rendezvous store's waits and the trainer's own client (weightsync/transport/
secure_store.py, store.py).

A round's waits (an engine waiting for the trainer to finish writing into it, the
trainer waiting for every engine's ``done``) block in the store and wake the moment the
keys are set, instead of polling it: each poll was a round trip that cost the trainer's
and the engine's processes CPU while the round's copy wanted every core. The trainer's
own client answers in process. Real stores on ephemeral ports, real threads.
"""

from __future__ import annotations

import threading
import time

import pytest

from weightsync.errors import StepTimeoutError, TransferError
from weightsync.transport import store as store_module
from weightsync.transport.secure_store import LocalStore, SecureStore, StoreHost
from weightsync.transport.store import delete_keys, wait_for_keys


@pytest.fixture
def host():
    h = StoreHost("127.0.0.1", timeout_s=5)
    yield h
    h.close()


def _connect(host: StoreHost, prefix: str = "") -> SecureStore:
    store = SecureStore("127.0.0.1", host.port, host.new_secret(), deadline_at=time.monotonic() + 5, timeout_s=5)
    return store.with_prefix(prefix) if prefix else store


def _count_requests(host: StoreHost, monkeypatch) -> list[int]:
    """The operation code of every request the host answers from now on (a connection
    already waiting for its next request answers that one uncounted)."""
    seen: list[int] = []
    answer = host._answer

    def counted(fields):
        seen.append(fields[0][0])
        return answer(fields)

    monkeypatch.setattr(host, "_answer", counted)
    return seen


def _set_later(store, key: str, value: bytes, after_s: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(after_s), store.set(key, value)), daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("client", ["remote", "local"])
def test_wait_either_says_which_came_first_and_times_out(host, client):
    store = _connect(host, "ws/g") if client == "remote" else host.client().with_prefix("ws/g")
    other = _connect(host, "ws/g")
    assert store.wait_either(["a"], ["err"], 0.05) == (False, None, b"")  # nothing set: the timeout
    _set_later(other, "a", b"1", 0.1).join()
    assert store.wait_either(["a"], ["err"], 5) == (True, None, b"")
    other.set("err", b"engine 2 failed")
    # The wanted keys win where both are set (as check-then-fail-keys polling did) ...
    assert store.wait_either(["a"], ["err"], 5) == (True, None, b"")
    # ... and the fail key is named, unprefixed, with its value where they are not.
    assert store.wait_either(["a", "b"], ["other-err", "err"], 5) == (False, "err", b"engine 2 failed")


def test_a_wait_wakes_when_the_key_is_set_and_asks_the_store_once_per_slice(host, monkeypatch):
    requests = _count_requests(host, monkeypatch)  # before connecting: a connection's first request counts too
    engine = _connect(host)
    trainer = host.client()
    setter = _set_later(trainer, "written/1", b"1", 0.4)
    started = time.monotonic()
    wait_for_keys(engine, ["written/1"], deadline_at=time.monotonic() + 5, operation="receive",
                  fail_keys=["abort"])
    waited = time.monotonic() - started
    setter.join()
    assert 0.35 <= waited < 2.0
    # Polling looked twice (the key, then the fail key) every 5 ms: over 160 requests
    # here. Blocking: one per 25 ms slice at most, plus the set.
    assert len(requests) <= 0.4 / store_module._BLOCK_SLICE_S + 4, len(requests)


def test_a_blocking_wait_still_sees_its_abort_flag_its_deadline_and_a_peer_failure(host):
    engine = _connect(host)
    abort = threading.Event()
    threading.Timer(0.2, abort.set).start()
    started = time.monotonic()
    with pytest.raises(TransferError, match="aborted"):
        wait_for_keys(engine, ["never"], deadline_at=time.monotonic() + 30, operation="receive", abort=abort)
    assert time.monotonic() - started < 0.2 + 1.0
    with pytest.raises(StepTimeoutError, match="deadline exceeded during receive") as caught:
        wait_for_keys(engine, ["never"], deadline_at=time.monotonic() + 0.2, operation="receive")
    assert caught.value.operation == "receive"
    _set_later(host.client(), "abort", b"the trainer stopped: engine 1 exited", 0.1)
    with pytest.raises(TransferError, match="peer reported failure: the trainer stopped: engine 1 exited"):
        wait_for_keys(engine, ["never"], deadline_at=time.monotonic() + 30, operation="receive",
                      fail_keys=["abort"])


def test_a_wait_on_an_older_store_that_cannot_block_polls_instead(host, monkeypatch):
    answer = host._answer

    def older(fields):  # an earlier release's host: it knows no blocking wait
        if fields[0][0] == 9:
            return [bytes([2]), f"unknown store operation {fields[0][0]}".encode()]
        return answer(fields)

    monkeypatch.setattr(host, "_answer", older)
    engine = _connect(host)
    with pytest.raises(NotImplementedError):
        engine.wait_either(["k"], [], 0.01)
    _set_later(host.client(), "k", b"1", 0.1)
    wait_for_keys(engine, ["k"], deadline_at=time.monotonic() + 5, operation="receive")  # polled, not refused
    assert engine.check(["k"])


def test_the_trainers_own_client_answers_in_process(host, monkeypatch):
    trainer = host.client()
    assert isinstance(trainer, LocalStore)
    requests = _count_requests(host, monkeypatch)
    engine = _connect(host)
    scoped = trainer.with_prefix("ws/g")
    _set_later(engine, "ws/g/mode/1", b"push", 0.1)
    assert scoped.get("mode/1") == b"push"  # blocks until an engine sets it, as over a connection
    scoped.set("push-ok/1", b"1")
    assert engine.get("ws/g/push-ok/1") == b"1"
    assert scoped.add("n", 2) == 2 and scoped.compare_set("c", b"", b"x") == b"x"
    assert requests  # the same host answered both sides
    trainer.set_timeout(0.2)
    with pytest.raises(RuntimeError, match="timed out"):
        trainer.get("never-set")
    host.close()
    with pytest.raises(RuntimeError, match="closed"):
        trainer.set("after", b"1")


def test_a_rounds_keys_go_in_one_request(host, monkeypatch):
    trainer = host.client()
    keys = [f"ws/g/s/done/{r}" for r in range(1, 9)]
    for key in keys[:6]:
        trainer.set(key, b"1")
    trainer.set("ws/g/s/keep", b"1")
    requests = _count_requests(host, monkeypatch)
    engine = _connect(host)
    delete_keys(engine, keys)  # two were never set: fine
    assert requests == [10]  # one request, the multi-key delete
    assert engine.num_keys() == 1 and engine.check(["ws/g/s/keep"])
    assert engine.delete_keys(["ws/g/s/keep", "ws/g/s/none"]) == 1


_HOST_PROCESS = """
import sys, time
from weightsync.transport.secure_store import StoreHost
host = StoreHost("127.0.0.1", timeout_s=30)
print(host.port, host.new_secret(), flush=True)
sys.stdin.read()  # until the test closes our stdin
host.close()
"""


def _stop(pid: int) -> None:
    """SIGSTOP, then waits until every thread of ``pid`` is stopped: the group stop
    reaches each thread as it next runs, which on a loaded machine can be after the
    next request has been answered."""
    import os
    import signal

    os.kill(pid, signal.SIGSTOP)
    end = time.monotonic() + 10
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rpartition(")")[2].split()[0])
        if all(state in "Tt" for state in states):
            return
        assert time.monotonic() < end, f"process {pid} did not stop: {states}"
        time.sleep(0.01)


def _within(seconds: float, call):
    """``call()``'s result or exception, failing the test if it has neither after
    ``seconds`` (a hang is the bug these tests look for: fail, do not hang)."""
    box: dict = {}

    def run():
        try:
            box["result"] = call()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box.get("result")


def test_a_frozen_trainers_store_ends_each_wait_by_its_deadline_and_a_new_round_connects_again():
    """The trainer's process frozen mid-round (SIGSTOP: its store's connections stay
    open and answer nothing): an engine's wait ends by the round's deadline plus a
    second, its plain requests by the store's timeout plus a second; the connection
    is then given up, and the next round's ``StoreLink`` makes a new one."""
    import os
    import signal
    import subprocess
    import sys
    from types import SimpleNamespace

    from weightsync.transport.store import StoreLink

    trainer = subprocess.Popen([sys.executable, "-c", _HOST_PROCESS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    try:
        port, secret = trainer.stdout.readline().split()
        rendezvous = SimpleNamespace(store_host="127.0.0.1", store_port=int(port), store_secret=secret)
        link = StoreLink()
        engine = link.connect(rendezvous, deadline_at=time.monotonic() + 2)  # its store timeout: 2 s
        engine.set("mode/1", b"push")
        _stop(trainer.pid)
        started = time.monotonic()
        with pytest.raises((TransferError, StepTimeoutError)) as caught:
            _within(10, lambda: wait_for_keys(engine, ["written/1"], deadline_at=time.monotonic() + 1.0,
                                              operation="receive", fail_keys=["abort"]))
        assert time.monotonic() - started < 1.0 + 1.0 + 1.0, caught.value
        assert "no answer within" in str(caught.value)
        assert engine.broken
        with pytest.raises(RuntimeError, match="no answer in time"):  # never read a late answer as another's
            engine.check(["mode/1"])
        os.kill(trainer.pid, signal.SIGCONT)
        again = link.connect(rendezvous, deadline_at=time.monotonic() + 2)
        assert again is not engine and again.get("mode/1") == b"push"
        _stop(trainer.pid)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="no answer within"):
            _within(10, lambda: again.set("done/1", b"1"))
        assert time.monotonic() - started < 2 + 1.0 + 1.0  # the store timeout (2 s) and the grace
    finally:
        os.kill(trainer.pid, signal.SIGCONT)
        trainer.stdin.close()
        try:
            trainer.wait(10)
        except subprocess.TimeoutExpired:
            trainer.kill()
            trainer.wait()
