"""One rank of a sharded trainer (FSDP2, or tensor parallel, over gloo, on CPU): the
sharded-trainer tests and ``weightsync bench --trainer-ranks``.

Started like torchrun starts a rank (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` in the environment). Wraps the engines' reference model (``--model``)
with ``fully_shard`` (``--parallel fsdp``; ``hsdp``: over a 2-D mesh, two replica
groups each sharding over half the ranks), torch's tensor parallel (``--parallel tp``:
each block's ``qkv`` and ``fc1`` column-wise, ``proj`` and ``fc2`` row-wise; the rest
plain tensors every rank holds whole), both (``--parallel fsdp-tp``: tensor parallel
within pairs of ranks, FSDP2 across the pairs, as torchtitan composes them), or
expert parallel (``--parallel ep``, a mixture-of-experts ``--model``: plain tensors, each
rank offering the shared ones and only its own experts, expert ``e`` on rank ``e mod
world``; every rank moves its whole copy alike, so rank 0's is the full model the check
gathers), moves every rank's own shard
by seeded noise each round (so rounds differ; replicated tensors alike on every rank),
and syncs it for ``--rounds`` rounds:

- ``--mode sharded``: every rank sends its own shards (``DistributedTrainerClient``;
  with ``--transport group`` or ``--gather`` they are gathered into rank 0, which sends
  them whole);
- ``--mode gather``: the baseline: all-gather every parameter to rank 0, which sends
  the full tensors (``TrainerClient``); the others wait at a barrier.

``--verify-digest``: every round carries the digest of the parts the ranks send, which
each engine checks against what it loaded before committing.
``--attest``: before each round every rank scores the probe sequences with the model
(FSDP2's forward is a collective) and the round carries that probe; from version
``--stale-from`` on, the ranks score them before moving the weights (the engines must
then refuse the round).
Each rank prints one JSON line per round:
    {"rank", "round", "ok", "error_type", "error", "seconds", "ended", "bytes", "digest_ok"}
(``attest_max_diff`` too with ``--attest``: the engines' largest difference; ``--mode
sharded`` adds ``engines``: {id: {"transport", "relayed_by"}}, what each received over)
(``gather`` adds ``gather_s``: the all-gather's share of ``seconds``)
``digest_ok`` (rank 0; after a good round, not timed): every engine's digest equals the
digest of the full, unsharded state dict (gathered for the check only; ``digest_check``
says what the engines hold where it is false; ``full_digest``: that state dict's digest
by name, for engines that give none, such as SGLang). SIGINT cancels the running round on that
rank: it prints the round's line and stops.
Before each round a rank prints ``{"rank", "starting": VERSION}`` (a test that kills or
signals a rank mid-round waits for it; its engines are slowed by fault injection).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import torch
import torch.distributed as dist

from weightsync.attest import Probe
from weightsync.client import TrainerClient
from weightsync.client.distributed import DistributedTrainerClient
from weightsync.engine.model import ModelConfig, ReferenceLM
from weightsync.errors import WeightSyncError
from weightsync.lifecycle import exit_without_finalizing, wait_for_file
from weightsync.packing import weights_digest
from weightsync.plan import DEFAULT_BUCKET_BYTES


def sharded_model(config: ModelConfig):
    """The engines' model (same config and seed), wrapped with FSDP2: every parameter a
    DTensor placed Shard(0) over the world."""
    from torch.distributed.fsdp import fully_shard
    model = ReferenceLM(config)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def tensor_parallel_model(config: ModelConfig):
    """The engines' model with torch's tensor parallel over the world (a 1-D mesh):
    each block's ``qkv`` and ``fc1`` column-wise (weights and biases Shard(0)), ``proj``
    and ``fc2`` row-wise (weights Shard(1), biases Replicate()); the embeddings, norms
    and head stay plain tensors, whole on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    model = ReferenceLM(config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        parallelize_module(block, mesh, {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                                         "fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return model


def hsdp_model(config: ModelConfig):
    """The engines' model with FSDP2 over a 2-D mesh (HSDP): two replica groups, each
    sharding every parameter over its half of the ranks (placements Replicate(),
    Shard(0)): two ranks hold each shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    world = dist.get_world_size()
    if world % 2:
        raise SystemExit("--parallel hsdp takes an even number of ranks")
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = ReferenceLM(config)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp_over_tp_model(config: ModelConfig):
    """The engines' model with tensor parallel within pairs of ranks and FSDP2 across
    the pairs (a (world/2, 2) mesh, "dp" x "tp"): column-wise weights end up
    ``_StridedShard(0)`` over dp and ``Shard(0)`` over tp (a row range: tp's chunk, then
    FSDP's chunk of it), row-wise weights ``Shard(0)`` and ``Shard(1)`` (a block of rows
    and columns), the rest ``Shard(0)`` over dp (the pair's two ranks hold the same rows)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    world = dist.get_world_size()
    if world % 2 or world < 4:
        raise SystemExit("--parallel fsdp-tp takes an even number of ranks, 4 or more")
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    model = ReferenceLM(config)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                                               "fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _shard_coordinate(p) -> tuple[int, ...] | None:
    """Which slice of ``p`` this rank holds (its coordinates along the mesh dimensions
    that shard it), or None for a tensor every rank holds alike (a plain tensor, or
    Replicate() everywhere). Replicas of a slice (HSDP) share the coordinates."""
    from torch.distributed.tensor import DTensor, Replicate
    if not isinstance(p, DTensor):
        return None
    found = tuple(p.device_mesh.get_local_rank(mesh_dim=mesh_dim) for mesh_dim, placement in enumerate(p.placements)
                  if not isinstance(placement, Replicate))
    return found or None


def move(model, seed: int) -> None:
    """Seeded noise on this rank's own shards -- the same on every replica of a shard
    -- and the same noise on every rank's copy of a replicated tensor (no collective)."""
    with torch.no_grad():
        for i, (_, p) in enumerate(model.named_parameters()):
            local = p.to_local() if hasattr(p, "to_local") else p
            coordinate = _shard_coordinate(p)
            salt = 0 if coordinate is None else 1 + sum(c * 97 ** k for k, c in enumerate(coordinate))
            gen = torch.Generator().manual_seed(seed * 1_000_003 + i * 1009 + salt)
            local.add_(0.01 * torch.randn(local.shape, generator=gen))


PROBE_SEQUENCES = [[1, 2, 3, 4, 5, 6, 7, 8], [200, 17, 42, 9], [65, 66]]


def score(model) -> Probe:
    """The attestation probe of the model as it is now (a collective: every rank runs
    the forward pass together)."""
    with torch.no_grad():
        return Probe.from_model(lambda tokens: model(tokens), PROBE_SEQUENCES)


def full_state(model) -> list[tuple[str, torch.Tensor]]:
    """The full, unsharded tensors (a collective on every rank): the independent check,
    and the gather baseline's payload."""
    return [(name, p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone())
            for name, p in model.named_parameters()]


def expert_parallel_model(config: ModelConfig):
    """The engines' model, whole, on every rank (what each rank offers is cut by
    ``offered``)."""
    if not config.n_experts:
        raise SystemExit("--parallel ep takes a mixture-of-experts --model (n_experts > 0)")
    return ReferenceLM(config)


def offered(model, parallel: str, rank: int, world: int) -> list[tuple[str, torch.Tensor]]:
    """What this rank passes to ``update_weights``: every parameter, or under expert
    parallelism the shared ones and this rank's experts (``...experts.E....``, E mod
    world == rank)."""
    named = list(model.named_parameters())
    if parallel != "ep":
        return named

    def mine(name: str) -> bool:
        parts = name.split(".")
        return "experts" not in parts or int(parts[parts.index("experts") + 1]) % world == rank
    return [(n, p) for n, p in named if mine(n)]


def _engine_lines(result) -> dict:
    """Each engine's part of a round's result, for the round's line."""
    return {e.engine_id: {"transport": e.transport, "relayed_by": e.relayed_by, "ok": e.ok} for e in result.engines}


class _StallingClient(DistributedTrainerClient):
    """Tests (``--stall-send RANK:VERSION``): in round ``stall_version`` this rank, once
    rank 0 hands it a lane (a gather's or a round's), prints ``{"rank", "stalling"}``
    and waits before sending, its heartbeat going on, so a test can kill it there."""

    def __init__(self, *args, stall_version: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stall_version = stall_version
        self.version = 0  # the round under way, set by the caller

    async def start(self) -> _StallingClient:
        await super().start()
        sender = self.rank_sender
        if sender is not None:  # ranks > 0: their lanes' sends wait first
            send = sender.send_lane

            def stalling_send(*args, **kwargs):  # one lane's send, on its own thread
                if self.version == self.stall_version:
                    print(json.dumps({"rank": self.rank, "stalling": self.version}), flush=True)
                    time.sleep(STALL_S)
                return send(*args, **kwargs)

            sender.send_lane = stalling_send
        return self


STALL_S = 120.0
PARALLEL = {"fsdp": sharded_model, "hsdp": hsdp_model, "tp": tensor_parallel_model, "fsdp-tp": fsdp_over_tp_model,
            "ep": expert_parallel_model}


async def run(args: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    config = ModelConfig.from_json(args.model)
    model = PARALLEL[args.parallel](config)
    common = dict(host=args.host, transport=args.transport, bucket_bytes=args.bucket_bytes,
                  default_timeout_s=args.timeout)
    if args.mode == "sharded":
        stall_rank, _, stall_version = args.stall_send.partition(":")
        if stall_rank and int(stall_rank) == rank:
            client = _StallingClient(args.coordinator, gather=args.gather or None, stall_version=int(stall_version),
                                     **common)
        else:
            client = DistributedTrainerClient(args.coordinator, gather=args.gather or None, **common)
    else:
        client = TrainerClient(args.coordinator, **common) if rank == 0 else None
    if client is not None:
        await client.start()
    # Listed once, as the README advises at many parameters (torch's named_parameters()
    # walks every module: 20-150 ms a call at 20k tensors); the rounds update the same
    # tensors in place, so the list stays true.
    listed = offered(model, args.parallel, rank, dist.get_world_size()) if args.mode == "sharded" else []
    try:
        for r in range(args.first_version, args.first_version + args.rounds):
            if args.go and r > args.first_version:  # the caller reads something between rounds
                await asyncio.to_thread(wait_for_file, os.path.join(args.go, f"go-{r}"), timeout_s=args.timeout)
            stale = args.attest and args.stale_from and r >= args.stale_from
            probe = score(model) if stale else None
            move(model, r)
            if args.attest and not stale:
                probe = score(model)
            line: dict = {"rank": rank, "round": r, "ok": False, "error_type": "", "error": "", "digest_ok": None}
            print(json.dumps({"rank": rank, "starting": r}), flush=True)
            started = time.monotonic()
            try:
                if args.mode == "sharded":
                    if isinstance(client, _StallingClient):
                        client.version = r
                    named = listed
                    if rank == args.drop_on_rank:  # tests: this rank fails to offer one of its shards
                        named = named[1:]
                    result = await client.update_weights(named, version=r, timeout_s=args.timeout,
                                                         key=f"{args.key}-{r}" if args.key else None, attest=probe,
                                                         verify_digest=args.verify_digest)
                    line["ok"] = result.ok
                    line["phases_s"] = {"pause": round(result.pause_seconds, 4),
                                        "transfer": round(result.transfer_seconds, 4),
                                        "resume": round(result.resume_seconds, 4)}
                    line["engines"] = _engine_lines(result)
                    if probe is not None:
                        line["attest_max_diff"] = max(e.attest_max_diff or 0.0 for e in result.engines)
                else:
                    full = full_state(model)  # the all-gather: part of the baseline's time
                    line["gather_s"] = round(time.monotonic() - started, 4)
                    if rank == 0:
                        result = await client.update_weights(full, version=r, timeout_s=args.timeout)
                        line["ok"] = result.ok
                    else:
                        line["ok"] = True
                    dist.barrier()
            except asyncio.CancelledError as exc:  # SIGINT: this rank stops after the round ended
                line["error_type"], line["error"] = "CancelledError", str(exc.__cause__ or exc)[:400]
                line["seconds"], line["ended"] = round(time.monotonic() - started, 4), time.time()
                print(json.dumps(line), flush=True)
                raise
            except WeightSyncError as exc:
                line["error_type"], line["error"] = type(exc).__name__, str(exc)[:400]
                failed = getattr(exc, "result", None)  # SyncFailed: each engine's outcome
                if failed is not None:
                    line["engines"] = _engine_lines(failed)
            line["seconds"], line["ended"] = round(time.monotonic() - started, 4), time.time()
            last = r == args.first_version + args.rounds - 1
            if (args.check_digests or (args.check_digests_last and last)) and line["ok"]:  # a collective: only when every rank is known alive
                full = full_state(model)
                if rank == 0:
                    local = await asyncio.to_thread(weights_digest, full)
                    line["full_digest"] = await asyncio.to_thread(weights_digest, sorted(full))  # by name
                    check = await client.check_engines(digest=local, version=r)
                    line["digest_ok"] = check.ok
                    if not check.ok:
                        line["digest_check"] = check.describe()
            line["bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
            print(json.dumps(line), flush=True)
    finally:
        if client is not None:
            await client.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sharded_trainer")
    parser.add_argument("coordinator")
    parser.add_argument("--host", default="127.0.0.1", help="address engines reach this rank at")
    parser.add_argument("--model", required=True, help="the engines' --model JSON")
    parser.add_argument("--mode", choices=("sharded", "gather"), default="sharded")
    parser.add_argument("--parallel", choices=tuple(PARALLEL), default="fsdp",
                        help="how the model is sharded: FSDP2 (Shard(0)), HSDP (two replica groups of FSDP2), "
                             "tensor parallel (Shard(0) and Shard(1)), FSDP2 over tensor parallel (blocks) or expert "
                             "parallel (each rank its own experts, whole)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--first-version", type=int, default=1)
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--gather", action="store_true",
                        help="--mode sharded: gather the parts into rank 0, which sends them as one trainer")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES)
    parser.add_argument("--key", default="", help="idempotency key prefix (KEY-VERSION per round)")
    parser.add_argument("--go", default="", metavar="DIR",
                        help="before each round after the first, wait (up to --timeout) for DIR/go-VERSION")
    parser.add_argument("--stall-send", default="", metavar="RANK:VERSION",
                        help="tests: in that round, that rank waits before sending its lane (its heartbeat going on)")
    parser.add_argument("--drop-on-rank", type=int, default=-1,
                        help="tests: this rank leaves its first tensor out (its shards then do not cover it)")
    parser.add_argument("--check-digests", action="store_true", help="after every good round")
    parser.add_argument("--verify-digest", action="store_true",
                        help="every round verified by the parts' digest (update_weights(verify_digest=True))")
    parser.add_argument("--attest", action="store_true",
                        help="carry an attestation probe scored by every rank before the round")
    parser.add_argument("--stale-from", type=int, default=0,
                        help="with --attest: from this version on, score the probe before the weights move")
    parser.add_argument("--check-digests-last", action="store_true", help="after the last round, if good")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    try:
        asyncio.run(run(args))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_finalizing(main())
