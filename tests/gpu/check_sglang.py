"""GPU check: weightsync against a REAL SGLang server (needs CUDA and `pip install sglang`).

The CPU suite tests the SGLang adapter against a stand-in; this script runs the same
rounds against SGLang itself, on a machine that has it:

    python tests/gpu/check_sglang.py --model-path MODEL_DIR [--rounds 3] [--port 30000]
                                     [--group-layout tensors|flattened]

It starts a local coordinator and one agent that launches
``python -m sglang.launch_server`` (``--engine sglang --launch``), then runs
``--rounds`` Pause/Broadcast/Resume rounds over the ``group`` transport with the
checkpoint's own tensors moved by seeded noise, in the group transport's layout
(``--group-layout flattened``: SGLang's ``flattened_bucket``, a broadcast per run of
tensors; the agent is then started with ``--sglang-flattened-bucket``). The backend is nccl from a second
GPU when there are two (trainer tensors on cuda:1, SGLang on cuda:0), else gloo
from host memory (SGLang receives over gloo into its GPU tensors). The second round
also offloads the KV cache (release / resume with the agent's ledger).

After every round it checks, through SGLang's own API:
- ``/get_weights_by_name`` of a few tensors equals the trainer's values;
- ``/model_info`` reports the round's version;
- a greedy ``/generate`` answers and differs from the previous round's;
and at the end that a bad plan (a tensor the model lacks) is refused with SGLang
still serving the last round's weights. It prints one JSON summary and exits 0 only
if every check passed. Every process it starts is stopped on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import sys
import tempfile
import time
import urllib.request

import torch
from safetensors.torch import load_file

from weightsync.apps.local_cluster import LocalCluster
from weightsync.client import TrainerClient
from weightsync.errors import InvalidArgument

CHECKED = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def call(url: str, path: str, body: dict | None = None, timeout_s: float = 60) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def generate(url: str) -> str:
    out = call(url, "/generate", {"text": "The weights of a policy", "sampling_params": {
        "temperature": 0, "max_new_tokens": 16}})
    return out["text"]


def served_matches(url: str, name: str, tensor: torch.Tensor) -> bool:
    got = torch.tensor(call(url, "/get_weights_by_name", {"name": name, "truncate_size": 4}))
    want = tensor[:4].float().cpu()
    return got.shape == want.shape and torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2)


async def rounds(address: str, url: str, checkpoint: list[tuple[str, torch.Tensor]], n: int, device: str,
                 layout: str) -> dict:
    report: dict = {"rounds": [], "ok": True}
    previous = generate(url)
    async with TrainerClient(address, transport="group", group_layout=layout) as client:
        for i in range(n):
            version = i + 1
            g = torch.Generator().manual_seed(version)
            weights = [(name, (t.float() + 0.05 * torch.randn(t.shape, generator=g)).to(t.dtype).to(device))
                       for name, t in checkpoint]
            started = time.monotonic()
            result = await client.update_weights(weights, version=version, mode="keep", offload_kv=(i == 1),
                                                 timeout_s=300)
            seconds = time.monotonic() - started
            named = dict(weights)
            text = generate(url)
            checks = {
                "synced": result.ok,
                "version": call(url, "/model_info").get("weight_version") == str(version),
                "weights": all(served_matches(url, name, named[name]) for name in CHECKED if name in named),
                "output_changed": text != previous,
            }
            report["rounds"].append({"version": version, "seconds": round(seconds, 3), **checks})
            report["ok"] &= all(checks.values())
            previous = text
        bad = checkpoint + [("model.layers.999.mlp.up_proj.weight", torch.zeros(4, 4))]
        await client.pause()
        try:
            await client.broadcast(bad, version=n + 1, timeout_s=60)
            refused = False
        except InvalidArgument:
            refused = True
        await client.resume()
        report["bad_plan_refused"] = refused and generate(url) == previous
        report["ok"] &= report["bad_plan_refused"]
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True, help="local folder with the model's safetensors")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--group-layout", default="tensors", choices=["tensors", "flattened"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU with SGLang installed", file=sys.stderr)
        return 2
    two_gpus = torch.cuda.device_count() >= 2
    device = "cuda:1" if two_gpus else "cpu"
    checkpoint: list[tuple[str, torch.Tensor]] = []
    for path in sorted(glob.glob(os.path.join(args.model_path, "*.safetensors"))):
        checkpoint += sorted(load_file(path).items())
    url = f"http://127.0.0.1:{args.port}"
    launch = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model_path, "--port",
              str(args.port), "--host", "127.0.0.1", "--base-gpu-id", "0", "--mem-fraction-static", "0.5",
              "--enable-memory-saver"]
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(
            tmp, engines=1, agent_timeout_s=900,
            agent_args=["--engine", "sglang", "--engine-url", url, "--health-url", f"{url}/health",
                        "--checkpoint-dir", args.model_path, "--launch-timeout", "900",
                        *(["--sglang-flattened-bucket"] if args.group_layout == "flattened" else []),
                        "--launch", "--", *launch]) as cluster:
        report = asyncio.run(rounds(cluster.address, url, checkpoint, args.rounds, device, args.group_layout))
    report["backend"] = "nccl" if two_gpus else "gloo"
    report["group_layout"] = args.group_layout
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
