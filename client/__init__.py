"""Trainer-side API of weightsync."""

from weightsync.arena import place_on_huge_pages
from weightsync.attest import Probe
from weightsync.client.engine import EngineClient
from weightsync.client.loop_lag import LoopLagProbe
from weightsync.client.retry import RetryPolicy
from weightsync.client.trainer import EngineResult, SyncFailed, SyncResult, TrainerClient
from weightsync.client.verify import EngineHolding, WeightsCheck

__all__ = ["TrainerClient", "SyncResult", "EngineResult", "SyncFailed", "RetryPolicy", "LoopLagProbe",
           "EngineClient", "Probe", "WeightsCheck", "EngineHolding",
           "place_on_huge_pages"]
