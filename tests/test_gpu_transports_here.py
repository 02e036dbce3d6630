"""The GPU transports' parts that need no GPU: the cuda-ipc table's format, the check
of NCCL's unique id, weightsync's NCCL calls against a stand-in library, and what a
machine without CUDA answers. The transfers themselves are in tests/gpu (marker
``gpu``), run on a GPU machine by tests/gpu/device_kit.sh."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync import transport as transports
from weightsync.client import TrainerClient
from weightsync.engine.model import PRESETS, ReferenceLM
from weightsync.errors import FailedPrecondition, TransferError
from weightsync.transport.cuda_ipc import decode_table, encode_table
from weightsync.transport.nccl_lib import Communicator

HANDLE = bytes(range(64))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 1 << 20), min_size=1, max_size=5),
       st.lists(st.tuples(st.integers(0, 4), st.integers(0, 1 << 20), st.integers(0, 4096)), max_size=40))
def test_an_ipc_table_round_trips_and_every_tensor_lies_inside_its_block(block_sizes, tensors):
    n = len(block_sizes)
    placed = [(b % n, min(off, block_sizes[b % n]), size) for b, off, size in tensors]
    placed = [(b, off, min(size, block_sizes[b] - off)) for b, off, size in placed]
    sizes = [size for _, _, size in placed]
    blocks = np.array([b if size else -1 for b, _, size in placed], dtype=np.int32)
    offsets = np.array([off for _, off, _ in placed], dtype=np.uint64)
    handles = [bytes([i]) * 64 for i in range(n)]
    table = decode_table(encode_table(handles, block_sizes, blocks, offsets), sizes)
    assert table.handles == handles
    assert table.block_sizes.tolist() == block_sizes
    assert table.blocks.tolist() == blocks.tolist() and table.offsets.tolist() == offsets.tolist()


def _one_block_table(offset: int, block: int = 0, block_size: int = 1024) -> bytes:
    return encode_table([HANDLE], [block_size], np.array([block], np.int32), np.array([offset], np.uint64))


@pytest.mark.parametrize("blob, sizes, why", [
    (b"", [8], "malformed"),
    (b"pickle" + bytes(20), [8], "malformed"),
    (_one_block_table(0), [8, 8], "lists 1 tensors for a plan of 2"),
    (_one_block_table(0)[:-1], [8], "bytes, .* expected"),
    (_one_block_table(0, block=1), [8], "block that does not exist"),
    (_one_block_table(0, block=-1), [8], "block that does not exist"),
    (_one_block_table(1020), [8], "outside its block"),
    (_one_block_table(2000), [8], "outside its block"),
    (_one_block_table((1 << 64) - 4), [8], "outside its block"),
])
def test_a_bad_ipc_table_is_refused_before_anything_is_mapped(blob, sizes, why):
    with pytest.raises(TransferError, match=why):
        decode_table(blob, sizes)


@pytest.mark.parametrize("length", [0, 127, 129])
def test_an_nccl_unique_id_of_another_length_is_refused_before_nccl_is_called(length):
    with pytest.raises(TransferError, match=f"128 bytes, got {length}"):
        Communicator(2, bytes(length), 1)


@pytest.mark.parametrize("name", ["nccl", "cuda-ipc"])
def test_without_cuda_the_gpu_transports_say_why(name):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tests/gpu covers it")
    reason = transports.unavailable_reason(transports.kind_from_name(name))
    assert reason == "no CUDA device visible to torch", reason


@pytest.mark.parametrize("name", ["nccl", "cuda-ipc"])
async def test_a_round_over_a_gpu_transport_on_a_machine_without_one_fails_typed_and_changes_nothing(
        cluster_factory, name):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tests/gpu covers it")
    cluster = cluster_factory(2)
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address, transport=name) as client:
        await client.pause()
        digests = {e.engine_id: e.weights_digest for e in (await client.get_state(include_digests=True)).engines}
        # Every agent refuses in the Broadcast's check phase, before any byte moves.
        with pytest.raises(FailedPrecondition) as failure:
            await client.broadcast(model.named_parameters(), version=1, timeout_s=60)
        assert failure.value.reason == "TRANSPORT_UNAVAILABLE", failure.value
        assert f"transport {name} unavailable" in str(failure.value)
        assert "engine-0" in str(failure.value) and "engine-1" in str(failure.value)
        state = await client.get_state(include_digests=True)
        assert state.weight_version == 0 and state.round.phase == "paused"
        for engine in state.engines:
            assert not engine.torn and engine.paused and engine.weight_version == 0
            assert engine.weights_digest == digests[engine.engine_id]
        # The same paused round then syncs over gloo.
        result = await client.broadcast(model.named_parameters(), version=1, transport="gloo", timeout_s=60)
        assert {e.engine_id for e in result.engines if e.ok} == {"engine-0", "engine-1"}
        await client.resume()



class _StandInDriver:
    """The three CUDA driver answers the cuda-ipc sender's table needs (block range,
    block id, IPC handle), for blocks this test allocates and frees: there is no GPU
    here. Like CUDA, a block allocated again at a freed block's address gets a new id
    and a new handle; tests/gpu checks the real driver."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int, int]] = {}  # base -> (size, id)
        self.next_id = 1
        self.range_calls = 0

    def allocate(self, base: int, size: int) -> None:
        self.blocks[base] = (size, self.next_id)
        self.next_id += 1

    def _find(self, address: int) -> int:
        return next(b for b, (size, _) in self.blocks.items() if b <= address < b + size)

    def allocation_range(self, address: int) -> tuple[int, int]:
        self.range_calls += 1
        base = self._find(address)
        return base, self.blocks[base][0]

    def buffer_id(self, address: int) -> int:
        return self.blocks[self._find(address)][1]

    def export_handle(self, base: int) -> bytes:
        return self.blocks[base][1].to_bytes(8, "little") * 8


class _At:
    """A tensor as the table sees it: an address and a size."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.address, self.nbytes = address, nbytes

    def data_ptr(self) -> int:
        return self.address


def test_the_ipc_table_follows_blocks_allocated_anew_at_the_same_addresses(monkeypatch):
    """A trainer that moves its model off the GPU and back with the cache emptied between
    gets new blocks at the same addresses: the table must name the new blocks (new
    handles), or engines keep copying from their mappings of the freed ones."""
    from weightsync.transport import cuda_ipc

    driver = _StandInDriver()
    for name in ("allocation_range", "buffer_id", "export_handle"):
        monkeypatch.setattr(cuda_ipc, name, getattr(driver, name))
    driver.allocate(0x10000, 4096)
    driver.allocate(0x20000, 8192)
    tensors = [_At(0x10000, 1024), _At(0x10400, 1024), _At(0x20000, 8192)]
    sizes = [t.nbytes for t in tensors]
    sender = cuda_ipc.CudaIpcSender(store=None)

    first = sender._table(tensors, remember=True)
    lookups = driver.range_calls
    assert sender._table(tensors, remember=True) is first  # same blocks: the table is reused as it is
    assert driver.range_calls == lookups

    driver.allocate(0x20000, 8192)  # freed and allocated again: same address, new block
    moved = sender._table(tensors, remember=True)
    old, new = decode_table(first, sizes), decode_table(moved, sizes)
    assert new.handles[0] == old.handles[0] and new.handles[1] != old.handles[1]
    assert new.blocks.tolist() == old.blocks.tolist() and new.offsets.tolist() == old.offsets.tolist()
    assert new.digest != old.digest  # what makes an engine map the new block
    assert sender._table(tensors, remember=True) is moved

    staged = sender._table(tensors, remember=False)  # a round's staged copies are never reused
    assert staged == moved and sender._exported is None


def test_a_cuda_ipc_receiver_meets_the_trainers_store_and_reports_a_bad_table_there():
    """cuda-ipc's control plane, which needs no GPU: an engine's receiver connects to the
    trainer's authenticated store with the round's secret, waits for the table, refuses
    a malformed one before mapping anything, and sets its ``err`` key so the trainer's
    send stops at once."""
    import threading
    import time
    import uuid

    import torch

    from weightsync.plan import BucketPlan
    from weightsync.transport.cuda_ipc import CudaIpcReceiver
    from weightsync.transport.secure_store import StoreHost
    from weightsync.transport.store import session_key
    from weightsync.v1 import common_pb2

    host = StoreHost("127.0.0.1", timeout_s=10)
    try:
        rdzv = common_pb2.Rendezvous(group_id="g", transport=common_pb2.TRANSPORT_KIND_CUDA_IPC,
                                     store_host="127.0.0.1", store_port=host.port, store_secret=host.new_secret(),
                                     world_size=2, session_id=uuid.uuid4().hex)
        plan = BucketPlan.from_tensors([("w", torch.zeros(4))], bucket_bytes=1 << 20)
        receiver, outcome = CudaIpcReceiver(), []

        def receive():
            try:
                receiver.receive(rdzv, 1, plan, [], deadline_at=time.monotonic() + 10, abort=threading.Event())
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=receive)
        thread.start()
        time.sleep(0.3)  # the receiver is waiting in the store for the table
        assert thread.is_alive() and not outcome
        trainer = host.client()
        trainer.set(session_key(rdzv, "ipc-table"), b"not a table")
        thread.join(10)
        assert not thread.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], TransferError) and "malformed" in str(outcome[0])
        assert b"malformed" in trainer.get(session_key(rdzv, "err", 1))
        receiver.close()
    finally:
        host.close()


# NCCL's side of the nccl transport against a stand-in library (tests/nccl_standin.c):
# NCCL needs a GPU. What is checked is weightsync's use of it through ctypes: the
# config it builds communicators with, its polling of a non-blocking communicator
# under the round's deadline and the peers' failure keys, and its aborts.

UID = bytes(range(128))


@pytest.fixture(scope="module")
def nccl_standin_builds(tmp_path_factory):
    import shutil
    import subprocess
    from pathlib import Path

    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler to build the NCCL stand-in")
    source = Path(__file__).with_name("nccl_standin.c")
    folder = tmp_path_factory.mktemp("nccl")
    builds = {}
    for name, flags in (("current", []), ("old", ["-DOLD_NCCL"])):
        path = folder / f"libnccl-{name}.so"
        subprocess.run([compiler, "-shared", "-fPIC", "-O1", *flags, "-o", str(path), str(source)], check=True,
                       timeout=60)
        builds[name] = str(path)
    return builds


def _use_nccl(monkeypatch, path):
    """nccl_lib loads ``path`` (its cache emptied); returns the stand-in's own handle."""
    import ctypes

    from weightsync.transport import nccl_lib
    monkeypatch.setenv("WEIGHTSYNC_NCCL_LIBRARY", path)
    monkeypatch.setattr(nccl_lib, "_lib", None)
    stub = ctypes.CDLL(path)  # the same loaded library: its counters are the ones nccl_lib's calls move
    stub.stub_calls.restype = ctypes.c_char_p
    stub.stub_config_size.restype = ctypes.c_size_t
    stub.stub_config_magic.restype = ctypes.c_uint
    stub.stub_config_version.restype = ctypes.c_uint
    return stub


@pytest.fixture
def nccl_standin(nccl_standin_builds, monkeypatch):
    return _use_nccl(monkeypatch, nccl_standin_builds["current"])


@pytest.fixture
def store_host():
    from weightsync.transport.secure_store import StoreHost
    host = StoreHost("127.0.0.1", timeout_s=10)
    yield host
    host.close()


def _rendezvous(host):
    import uuid

    from weightsync.v1 import common_pb2
    return common_pb2.Rendezvous(group_id="g", transport=common_pb2.TRANSPORT_KIND_NCCL, store_host="127.0.0.1",
                                 store_port=host.port, store_secret=host.new_secret(), world_size=2,
                                 session_id=uuid.uuid4().hex)


def _join(host, rdzv, build, *, within_s, abort=None):
    import threading
    import time

    from weightsync.transport.nccl import join_communicator
    from weightsync.transport.store import session_key
    started = time.monotonic()
    try:
        return join_communicator(build, rdzv, deadline_at=started + within_s, abort=abort or threading.Event(),
                                 watch=host.client(), stop_keys=[session_key(rdzv, "err", 1)])
    finally:
        _join.took_s = time.monotonic() - started


def test_a_communicator_is_built_non_blocking_and_polled_until_ready(nccl_standin, store_host):
    from weightsync.transport.nccl_lib import Communicator
    nccl_standin.stub_set(3, 0, 0)  # ready at the fourth poll
    comm = _join(store_host, _rendezvous(store_host), lambda store: Communicator(2, UID, 1), within_s=10)
    assert nccl_standin.stub_calls() == b"IEEEE"
    # ncclConfig_t as NCCL 2.14 laid it out: NCCL reads it by size and version.
    assert (nccl_standin.stub_config_size(), hex(nccl_standin.stub_config_magic()),
            nccl_standin.stub_config_version(), nccl_standin.stub_config_blocking()) == (24, "0xcafebeef", 21400, 0)
    assert (nccl_standin.stub_nranks(), nccl_standin.stub_rank()) == (2, 1)
    assert not comm.blocking
    comm.abort()
    assert nccl_standin.stub_calls() == b"IEEEEA"


def test_a_communicator_that_never_gets_ready_is_aborted_at_the_deadline(nccl_standin, store_host):
    from weightsync.errors import StepTimeoutError
    from weightsync.transport.nccl_lib import Communicator
    nccl_standin.stub_set(-1, 0, 0)  # its peers never come
    with pytest.raises(StepTimeoutError, match="nccl group setup"):
        _join(store_host, _rendezvous(store_host), lambda store: Communicator(2, UID, 1), within_s=2.0)
    assert 2.0 <= _join.took_s < 8
    calls = nccl_standin.stub_calls()
    assert calls.startswith(b"IE") and calls.endswith(b"A") and calls.count(b"A") == 1


def test_a_peer_failing_while_the_communicator_is_built_aborts_it_at_once(nccl_standin, store_host):
    import threading

    from weightsync.transport.nccl_lib import Communicator
    from weightsync.transport.store import session_key
    nccl_standin.stub_set(-1, 0, 0)
    rdzv = _rendezvous(store_host)
    peer = threading.Timer(0.5, lambda: store_host.client().set(session_key(rdzv, "err", 1), b"rank 1: out of memory"))
    peer.start()
    try:
        with pytest.raises(TransferError, match="rank 1: out of memory"):
            _join(store_host, rdzv, lambda store: Communicator(2, UID, 0), within_s=30)
    finally:
        peer.join()
    assert _join.took_s < 5
    assert nccl_standin.stub_calls().endswith(b"A") and nccl_standin.stub_calls().count(b"A") == 1


def test_a_build_that_fails_in_nccl_is_a_typed_error_and_is_aborted(nccl_standin, store_host):
    from weightsync.transport.nccl_lib import Communicator
    nccl_standin.stub_set(2, 0, 6)  # two polls in progress, then ncclRemoteError
    with pytest.raises(TransferError, match="remote process exited .NCCL error 6."):
        _join(store_host, _rendezvous(store_host), lambda store: Communicator(2, UID, 1), within_s=10)
    assert nccl_standin.stub_calls() == b"IEEEA"


def test_a_communicator_handed_over_after_its_caller_gave_up_is_aborted(nccl_standin, store_host):
    """The side thread was still in its store read when the deadline came: the
    communicator it builds after is aborted, not left joining peers that gave up."""
    import time

    from weightsync.errors import StepTimeoutError
    from weightsync.transport.nccl_lib import Communicator
    nccl_standin.stub_set(-1, 0, 0)

    def late_build(store):  # its store connection came in time; the rest of its build did not
        time.sleep(3.0)
        return Communicator(2, UID, 1)

    with pytest.raises(StepTimeoutError):
        _join(store_host, _rendezvous(store_host), late_build, within_s=1.5)
    assert nccl_standin.stub_calls() == b""
    deadline = time.monotonic() + 10
    while nccl_standin.stub_calls() != b"IA" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert nccl_standin.stub_calls() == b"IA"


def test_a_broadcast_nccl_is_still_queueing_is_settled_before_the_next_call(nccl_standin):
    """Until NCCL leaves ncclInProgress its kernel is not on the stream: an event
    recorded there would not wait for it. Each chunk is settled before the next."""
    from weightsync.transport import nccl_lib
    nccl_standin.stub_set(0, 2, 0)
    comm = nccl_lib.Communicator(2, UID, 0)
    settled = []

    def settle():
        while not comm.ready():
            pass
        settled.append(nccl_standin.stub_calls())

    comm.broadcast(0x1000, nccl_lib._MAX_COUNT + 10, 0, settle=settle)  # two chunks
    assert settled == [b"IBEEE", b"IBEEEBEEE"]
    assert nccl_standin.stub_calls() == b"IBEEEBEEE"
    nccl_standin.stub_set(0, 0, 0)
    comm.broadcast(0x1000, 64, 0, settle=lambda: pytest.fail("a queued broadcast needs no settling"))
    assert nccl_standin.stub_calls() == b"B"
    comm.abort()


@pytest.mark.parametrize("why", ["NCCL older than 2.14", "WEIGHTSYNC_NCCL_BLOCKING=1"])
def test_a_blocking_communicator_where_non_blocking_is_missing_or_turned_off(nccl_standin_builds, monkeypatch, why):
    from weightsync.transport.nccl_lib import Communicator
    if why.startswith("WEIGHTSYNC"):
        monkeypatch.setenv("WEIGHTSYNC_NCCL_BLOCKING", "1")
        stub = _use_nccl(monkeypatch, nccl_standin_builds["current"])
    else:
        stub = _use_nccl(monkeypatch, nccl_standin_builds["old"])
    stub.stub_set(0, 0, 0)
    comm = Communicator(3, UID, 2)
    assert comm.blocking and comm.ready()
    assert (stub.stub_calls(), stub.stub_nranks(), stub.stub_rank()) == (b"iE", 3, 2)
    comm.abort()


class _StandInProcessGroupNCCL:
    """torch's ProcessGroupNCCL as far as ``group.open_group`` uses it (torch's CPU
    build has none): building the communicator blocks until ``peers_came`` is set, as
    NCCL's blocking init does until every rank has joined."""

    built: list = []
    peers_came = None

    class Options:
        def __init__(self):
            self._timeout = None

    def __init__(self, store, rank, world_size, options):
        self.rank, self.world_size, self.options = rank, world_size, options

    def eager_connect_single_device(self, device):
        import threading
        type(self).built.append((device, threading.current_thread().name))
        assert type(self).peers_came.wait(30)


@pytest.fixture
def standin_nccl_group(monkeypatch):
    import threading

    import torch
    import torch.distributed as dist
    monkeypatch.setattr(dist, "ProcessGroupNCCL", _StandInProcessGroupNCCL, raising=False)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_StandInProcessGroupNCCL, "built", [])
    monkeypatch.setattr(_StandInProcessGroupNCCL, "peers_came", threading.Event())
    yield _StandInProcessGroupNCCL
    _StandInProcessGroupNCCL.peers_came.set()  # a build left waiting ends


@pytest.mark.parametrize("peers_come", [False, True])
def test_an_nccl_group_builds_its_communicator_on_the_joins_side_thread_within_the_deadline(
        standin_nccl_group, peers_come):
    """torch builds NCCL's communicator inside a group's first collective, a call that
    blocks with no deadline until every rank has joined; open_group builds it before it
    returns, on the side thread the round's deadline bounds, on the GPU it was given."""
    import threading
    import time
    import uuid

    import torch

    from weightsync.errors import StepTimeoutError
    from weightsync.transport.group import open_group
    from weightsync.transport.store import connect_store, host_store
    from weightsync.v1 import common_pb2

    store = host_store("127.0.0.1", timeout_s=10)
    rdzv = common_pb2.Rendezvous(group_id="g", transport=common_pb2.TRANSPORT_KIND_GROUP, group_backend="nccl",
                                 store_host="127.0.0.1", store_port=store.port, world_size=2,
                                 session_id=uuid.uuid4().hex)
    watch = connect_store("127.0.0.1", store.port, deadline_at=time.monotonic() + 10)
    if peers_come:
        standin_nccl_group.peers_came.set()
    started = time.monotonic()
    try:
        pg = open_group(rdzv, 1, watch=watch, deadline_at=started + 1.0, abort=threading.Event(),
                        device=torch.device("cuda", 1))
    except StepTimeoutError as exc:
        assert not peers_come and "nccl group setup" in str(exc)
        assert 1.0 <= time.monotonic() - started < 5
    else:
        assert peers_come and isinstance(pg, _StandInProcessGroupNCCL) and (pg.rank, pg.world_size) == (1, 2)
        assert 0 < pg.options._timeout.total_seconds() <= 1.0
    assert standin_nccl_group.built == [(torch.device("cuda", 1), "weightsync-join-g")]
