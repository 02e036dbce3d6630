"""What the vLLM tier's tests share: starting real vLLM servers (plain, or launched by a
weightsync agent), asking them for greedy completions with log-probs, and the
references a synced vLLM is checked against.

The references are independent of the reload path under test: a vLLM *booted fresh*
on the round's checkpoint (its boot-time loader, never ``reload_weights``), and the
trainer's own model (Hugging Face transformers) scoring the same tokens.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import getpass
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from tests.conftest import start_coordinator, wait_available
from tests.vllm.make_tiny_model import MAX_POSITIONS
from weightsync.engine.vllm import BOOT_PAUSED_SCHEDULER
from weightsync.lifecycle import free_port, spawn, stop_process, wait_for_file, weightsync_command
from weightsync.reaper import kill_trackers_last, remove_orphaned_shm, shm_mapped_by

HERE = Path(__file__).parent
_VLLM_SETTINGS = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                  "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_CI_ENV": "1"}
_scratch: str | None = None


def vllm_env() -> dict[str, str]:
    """The environment a test's vLLM runs in: this process's, the settings above, and a
    scratch directory of this process's own for what vLLM leaves behind when it stops
    (its ZeroMQ sockets in VLLM_RPC_BASE_PATH, and a ``vllm_dist_*`` file store in the
    temp dir at every boot: hundreds a day of suite runs), removed at exit. Made on
    first use: rank processes that import this module but start no vLLM, and are
    stopped by a signal (no atexit), must leave nothing. Short path: a socket path must
    stay under 108 bytes, so not tmp_path. Inductor keeps its cache where it would be
    without the new temp dir, so compiled kernels still serve every later boot."""
    global _scratch
    if _scratch is None:
        inductor_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
            tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
        _scratch = tempfile.mkdtemp(prefix="ws-vllm-")
        atexit.register(shutil.rmtree, _scratch, ignore_errors=True)
        _VLLM_SETTINGS.update(VLLM_RPC_BASE_PATH=_scratch, TMPDIR=_scratch, TORCHINDUCTOR_CACHE_DIR=inductor_cache)
    return {**os.environ, **_VLLM_SETTINGS}


EXTENSION = ["--worker-extension-cls", "weightsync.engine.vllm_worker.WeightsyncWorkerExtension"]
# vLLM boots paused until its agent lets it run (weightsync/engine/vllm_boot_paused.py):
# every vLLM an agent launches here runs so, as the README advises.
BOOT_PAUSED = ["--scheduler-cls", BOOT_PAUSED_SCHEDULER]
PROMPTS = [(5, 6, 7), (11, 3, 8, 1), (42,)]
# Teacher-forced probe sequences (token ids inside every tiny model's vocabulary).
PROBE_SEQUENCES = [[5, 6, 7, 8, 9, 10, 11, 12], [11, 3, 8, 1, 40, 2, 90, 17, 4], [42, 43, 44, 45]]
LOGPROB_ATOL = 1e-3  # fp32 on CPU: vLLM's kernels vs another vLLM or transformers differ by ~1e-6


def make_model(out: str, *, arch: str = "llama", tied: bool = False, seed: int = 0, experts: int = 8,
               layers: int = 2, intermediate: int = 128) -> str:
    subprocess.run([sys.executable, str(HERE / "make_tiny_model.py"), out, "--arch", arch, "--seed", str(seed),
                    "--experts", str(experts), "--layers", str(layers), "--intermediate", str(intermediate),
                    *(["--tied"] if tied else [])], check=True, timeout=300, capture_output=True)
    return out


def vllm_server(model: str, port: int, *extra: str, tensor_parallel: int = 1) -> list[str]:
    # Tensor parallel on vLLM's CPU backend needs its multiprocessing executor.
    executor = ["--distributed-executor-backend", "uni"] if tensor_parallel == 1 else [
        "--distributed-executor-backend", "mp", "--tensor-parallel-size", str(tensor_parallel)]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
            "--max-model-len", str(MAX_POSITIONS), "--enforce-eager", *executor, "--host", "127.0.0.1", "--port", str(port),
            *extra]


def kill_vllm(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGKILLs a vLLM started with ``spawn`` and every process it started (its process
    group: a container's restart takes all of it), and waits until none is left. Killing
    the API server alone left its engine core and worker running, 1.9 GB each time.
    Then removes what the killed processes left in /dev/shm, as a container's restart
    drops its /dev/shm and the agent's reaper does for a vLLM it launched: every suite
    run left this vLLM's message queues there (a 240 and a 160 MiB file). Its
    multiprocessing resource tracker is killed last, given a moment to unlink the named
    semaphores the others registered, as the agent's reaper does (killed with them, it
    left one in /dev/shm each time)."""
    server = psutil.Process(proc.pid)
    started = server.create_time()
    tree = [server, *server.children(recursive=True)]
    mapped = shm_mapped_by(p.pid for p in tree)
    kill_trackers_last(tree)
    os.killpg(proc.pid, signal.SIGKILL)  # what the tree had left in its group
    proc.wait(timeout=timeout_s)
    end = time.monotonic() + timeout_s
    while True:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        if time.monotonic() > end:
            raise AssertionError(f"processes of vLLM's group {proc.pid} outlived SIGKILL")
        time.sleep(0.05)
    remove_orphaned_shm(mapped, made_since=started)


def wait_healthy(url: str, proc, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM at {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"vLLM at {url} not healthy after {timeout_s}s")


@dataclass
class Stack:
    """A coordinator and one agent that launched vLLM with weightsync's worker extension."""

    address: str
    url: str
    agent: subprocess.Popen
    tmp: str
    model: str


def start_vllm_agent(address: str, model: str, tmp: str, *, engine_id: str = "vllm-0",
                     faults: str = "", tensor_parallel: int = 1,
                     agent_args: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """An agent that launches vLLM (with weightsync's worker extension, booted paused) and registers
    with the coordinator at ``address``; returns (agent process, vLLM url). The caller
    stops the agent (which stops vLLM). ``agent_args``: more of the agent's options."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = vllm_env()
    if tensor_parallel > 1:
        # vLLM's CPU workers bind their OpenMP threads to NUMA nodes, one node each; a
        # one-node machine must say which cores each worker takes (here: one core each,
        # wrapping around on a machine with fewer cores than workers).
        cores = os.cpu_count() or 1
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(w % cores) for w in range(tensor_parallel))
    fault_args: list[str] = []
    if faults:
        env["WEIGHTSYNC_FAULTS"] = faults
        fault_args = ["--enable-fault-injection"]
    port_file = os.path.join(tmp, f"{engine_id}.addr")
    with open(os.path.join(tmp, f"{engine_id}.log"), "w") as log:
        agent = spawn(weightsync_command(
            "agent", "--insecure", "--coordinator", address, "--engine", "vllm", "--engine-url", url,
            "--engine-id", engine_id, "--port-file", port_file,
            "--health-url", f"{url}/health", "--launch-timeout", "300", "--shutdown-grace", "10", *fault_args,
            *agent_args, "--launch", "--", *vllm_server(model, port, *EXTENSION, *BOOT_PAUSED, tensor_parallel=tensor_parallel)),
            env=env, stdout=log, stderr=log)
    try:
        wait_for_file(port_file, timeout_s=360, proc=agent)
        wait_available(address, [engine_id], timeout_s=60)
    except BaseException:
        stop_process(agent, grace_s=20)
        raise
    return agent, url


def stop_vllm_agent(agent: subprocess.Popen) -> None:
    """Stops an agent, and with it the vLLM it launched. The agent's reaper removes the
    shared-memory files vLLM leaves (its CPU communicator never unlinks its own; a
    stopped vLLM once left its executor's message queues, 400 MiB)."""
    stop_process(agent, grace_s=20)


@contextlib.contextmanager
def agent_stack(model: str, tmp: str, *, engine_id: str = "vllm-0", faults: str = "") -> Iterator[Stack]:
    """Starts the coordinator and the agent (which launches vLLM); always stops both.
    ``faults``: a WEIGHTSYNC_FAULTS rule list; the agent then runs with fault injection on."""
    coordinator, address, _ = start_coordinator(tmp)
    try:
        agent, url = start_vllm_agent(address, model, tmp, engine_id=engine_id, faults=faults)
        try:
            yield Stack(address, url, agent, tmp, model)
        finally:
            stop_vllm_agent(agent)
    finally:
        stop_process(coordinator, grace_s=10)


async def ready_for_a_test(address: str, url: str, timeout_s: float = 300) -> None:
    """Brings a shared stack to a known state whatever the previous test left behind
    (a timeout mid-pause, torn weights): the round resumed (torn allowed: the test
    syncs what it needs), vLLM unpaused and healthy, the engine available. Waits by
    readiness, each wait bounded by ``timeout_s``."""
    from weightsync.client import TrainerClient

    end = time.monotonic() + timeout_s
    await asyncio.to_thread(wait_available, address, ["vllm-0"], timeout_s)
    async with TrainerClient(address) as client:
        state = await client.get_state()
        if state.round.phase != "idle" or any(e.paused for e in state.engines):
            await client.resume(allow_torn=True, timeout_s=max(1.0, end - time.monotonic()))
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                pass
            if get(url, "/is_paused")["is_paused"] is False:
                return
        except OSError:
            pass
        if time.monotonic() > end:
            raise TimeoutError(f"vLLM at {url} not serving (healthy and unpaused) after {timeout_s}s")
        await asyncio.sleep(0.1)


class FreshVllms:
    """Plain vLLM servers (no weightsync), each booted on its own model directory."""

    def __init__(self, models: list[str], tmp: str) -> None:
        env = vllm_env()
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        for i, model in enumerate(models):
            port = free_port()
            with open(os.path.join(tmp, f"fresh-{i}.log"), "w") as log:
                self.procs.append(spawn(vllm_server(model, port), env=env, stdout=log, stderr=log))
            self.urls.append(f"http://127.0.0.1:{port}")

    def wait(self, timeout_s: float = 420) -> None:
        for url, proc in zip(self.urls, self.procs, strict=True):
            wait_healthy(url, proc, timeout_s=timeout_s)

    def stop(self) -> None:
        for proc in self.procs:
            stop_process(proc, grace_s=20)


def post(url: str, path: str, body: dict, timeout_s: float = 60) -> dict:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=10) as response:
        return json.loads(response.read())


def complete(url: str, model: str, prompt=(5, 6, 7), max_tokens: int = 12, timeout_s: float = 60) -> str:
    body = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0}
    return post(url, "/v1/completions", body, timeout_s)["choices"][0]["text"]


def completions(url: str, model: str) -> list[str]:
    return [complete(url, model, prompt) for prompt in PROMPTS]


def hold(ask, wait_s: float = 3.0) -> tuple[threading.Thread, list]:
    """Runs ``ask()`` on a thread of its own and gives it ``wait_s``; returns the thread
    and the list its answer lands in (empty while vLLM holds it)."""
    answers: list = []
    thread = threading.Thread(target=lambda: answers.append(ask()), daemon=True)
    thread.start()
    thread.join(timeout=wait_s)
    return thread, answers


def hold_completions(url: str, model: str, wait_s: float = 3.0) -> tuple[threading.Thread, list]:
    """``hold`` of a completion of each of the PROMPTS."""
    return hold(lambda: completions(url, model), wait_s)


@dataclass
class Greedy:
    """A greedy completion: token ids and the log-prob vLLM gave each."""

    tokens: list[int]
    logprobs: list[float]


def served_model(url: str) -> str:
    """The model id a vLLM serves (its model directory, which differs between servers)."""
    return get(url, "/v1/models")["data"][0]["id"]


def greedy(url: str, prompt, max_tokens: int = 12) -> Greedy:
    body = {"model": served_model(url), "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
            "ignore_eos": True, "return_tokens_as_token_ids": True}
    logprobs = post(url, "/v1/completions", body)["choices"][0]["logprobs"]
    return Greedy([int(t.split(":")[1]) for t in logprobs["tokens"]], [float(x) for x in logprobs["token_logprobs"]])


def greedy_all(url: str) -> list[Greedy]:
    return [greedy(url, prompt) for prompt in PROMPTS]


def assert_same_outputs(got: list[Greedy], want: list[Greedy], what: str) -> None:
    """Same greedy tokens, and log-probs within LOGPROB_ATOL, prompt by prompt."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.tokens == w.tokens, f"{what}: prompt {PROMPTS[i]} greedy tokens {g.tokens} != {w.tokens}"
        worst = max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs, strict=True))
        assert worst <= LOGPROB_ATOL, f"{what}: prompt {PROMPTS[i]} log-probs differ by {worst}"


def sharded_ranks(folder: str, address: str, model_dir: str, *rounds: str, go: str = "", world: int = 2):
    """``world`` trainer ranks (``tests/vllm/sharded_rank.py``, as torchrun starts them)
    each sending its slices of ``rounds`` (``VERSION,SEED,TRANSPORT,rows|columns|blocks[,attest]``)."""
    from weightsync.apps.trainer_ranks import TrainerRanks
    args = ["--model-dir", model_dir, *(["--go", go] if go else []), *(a for r in rounds for a in ("--round", r))]
    return TrainerRanks(folder, address, world, args, module="tests.vllm.sharded_rank")


async def sync_sharded(folder: str, address: str, model_dir: str, version: int, seed: int, transport: str,
                       layout: str = "rows", timeout_s: float = 300) -> None:
    """One sharded round at ``version`` (weights ``round_weights(checkpoint, seed)``):
    every rank (two; four for ``blocks``) exits cleanly, each having seen the round end ok."""
    world = 4 if layout == "blocks" else 2
    with sharded_ranks(folder, address, model_dir, f"{version},{seed},{transport},{layout}", world=world) as ranks:
        assert await asyncio.to_thread(ranks.wait, timeout_s) == [0] * world, ranks.tail()
        assert all(ranks.rounds(r)[version]["ok"] for r in range(world)), ranks.tail()


def checkpoint(model_dir: str) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    return [(n, weights[n]) for n in sorted(weights)]


def round_weights(base: list[tuple[str, torch.Tensor]], seed: int) -> list[tuple[str, torch.Tensor]]:
    """A trainer step's worth of change to every tensor, deterministic per seed."""
    g = torch.Generator().manual_seed(seed)
    return [(n, t + 0.5 * torch.randn(t.shape, generator=g)) for n, t in base]


def save_checkpoint(base_dir: str, weights: list[tuple[str, torch.Tensor]], out: str) -> str:
    """``base_dir`` (config, tokenizer) with ``weights`` as its safetensors."""
    from safetensors.torch import save_file
    shutil.copytree(base_dir, out)
    save_file(dict(weights), os.path.join(out, "model.safetensors"))
    return out


def trainer_model(model_dir: str, weights: list[tuple[str, torch.Tensor]]):
    """The trainer's own model (transformers) holding ``weights``: an independent reference."""
    from transformers import AutoConfig, AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(dict(weights), strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    if missing:  # tied: lm_head is the embedding
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def trainer_logits_fn(model):
    """``tokens [B, T] -> logits [B, T, V]`` for ``Probe.from_model``."""
    return lambda tokens: model(tokens).logits


def trainer_greedy(model, prompt, max_tokens: int = 12) -> Greedy:
    """Greedy decoding by the trainer's model, with the log-prob of each chosen token."""
    tokens = list(prompt)
    out, logprobs = [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            nxt = int(torch.argmax(lp))
            out.append(nxt)
            logprobs.append(float(lp[nxt]))
            tokens.append(nxt)
    return Greedy(out, logprobs)


async def assert_broken_round_caught_then_healed(stack: Stack, weights, version: int, model, attest) -> None:
    """A round whose reload fault injection breaks (the agent's ``skip_post_load`` rule
    for ``version``): the bytes and their digest are right, the outputs are not.
    Attestation fails the round (ENGINE_OUTPUT_MISMATCH), the engine torn and still
    paused at its previous version, a plain resume refused; the next good round heals
    it, and vLLM then answers as ``model`` (the trainer's) does."""
    import pytest

    from weightsync.client import TrainerClient
    from weightsync.errors import EngineOutputMismatch

    async with TrainerClient(stack.address) as client:
        before = (await client.get_state()).engines[0].weight_version
        assert before < version
        with pytest.raises(EngineOutputMismatch) as caught:
            await client.update_weights(weights, version=version, timeout_s=180, verify_digest=True, attest=attest)
        engine = caught.value.result.engines[0]
        assert not engine.ok and engine.error_reason == "ENGINE_OUTPUT_MISMATCH"
        assert engine.attest_max_diff > 0.1, engine
        assert "log-prob difference" in engine.error_message
        state = (await client.get_state()).engines[0]
        assert state.torn and state.paused and state.weight_version == before
        assert get(stack.url, "/is_paused")["is_paused"] is True, "nothing may resume onto mixed weights"
        resumed = await client.resume()
        assert not resumed.engines[0].ok and resumed.engines[0].error_reason == "TORN_WEIGHTS"
        assert get(stack.url, "/is_paused")["is_paused"] is True

        result = await client.update_weights(weights, version=version + 1, timeout_s=180, attest=attest)
        assert result.ok and result.engines[0].attest_max_diff <= 1e-3
    assert get(stack.url, "/is_paused")["is_paused"] is False
    assert_same_outputs(greedy_all(stack.url), [trainer_greedy(model, p) for p in PROMPTS],
                        "the good round after the broken one")


def vllm_server_process(agent_pid: int) -> psutil.Process:
    """The vLLM API server the agent launched (not the reaper above it, whose command
    line holds the same words)."""
    for proc in psutil.Process(agent_pid).children(recursive=True):
        try:
            if proc.cmdline()[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]:
                return proc
        except psutil.NoSuchProcess:
            continue
    raise AssertionError("the agent has no vLLM server under it")


def vllm_workers(agent_pid: int) -> list[psutil.Process]:
    """vLLM's worker processes (where the weights are received)."""
    found = []
    for proc in psutil.Process(agent_pid).children(recursive=True):
        try:
            if proc.name().startswith("VLLM::Worker"):
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    assert found, "vLLM has no worker process"
    return found


async def agent_events(tmp: str, engine_id: str = "vllm-0") -> list[tuple[str, dict]]:
    """The agent's event log (kind, fields), oldest first; its address is in ``tmp``."""
    from weightsync.client.engine import EngineClient

    with open(os.path.join(tmp, f"{engine_id}.addr")) as f:
        async with EngineClient(f.read().strip()) as engine:
            return [(e.kind, dict(e.fields)) for e in await engine.events()]


async def wait_ready_and(address: str, url: str, path: str, key: str, want: object, timeout_s: float = 60) -> None:
    """Waits until the coordinator reports the (only) engine ready and vLLM's ``GET path``
    answers ``{key: want}``."""
    from weightsync.client import TrainerClient

    end = time.monotonic() + timeout_s
    async with TrainerClient(address) as client:
        while True:
            engine = (await client.get_state()).engines[0]
            answer = get(url, path)
            if engine.ready and answer.get(key) == want:
                return
            assert time.monotonic() < end, f"not ready with {path} {key}={want!r}: {engine}, {answer}"
            await asyncio.sleep(0.2)
