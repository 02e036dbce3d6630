"""Typed errors and their translation to and from gRPC status details.

Every error that crosses a process boundary is a ``google.rpc.Status`` carrying an
``ErrorInfo`` (reason, domain, metadata). Servers raise ``WeightSyncError`` subclasses
and ``abort_with`` turns them into a status; clients call ``from_rpc_error`` to get the
same typed exception back. The reason string is the contract, not the class name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "weightsync.dev"


class WeightSyncError(Exception):
    """Base class of every weightsync error.

    Attributes:
        reason: stable machine-readable reason (UPPER_SNAKE_CASE).
        code: the gRPC status code this error maps to.
        metadata: extra string fields (engine id, operation, ...).
    """

    reason = "INTERNAL"
    code = grpc.StatusCode.INTERNAL
    # True when the operation failed before it changed anything anywhere: the
    # idempotency store then forgets the key instead of storing the failure, so a
    # retry once the system is healthy runs afresh (see ``nothing_changed``).
    nothing_ran = False

    def __init__(self, message: str, *, reason: str | None = None,
                 code: grpc.StatusCode | None = None,
                 metadata: Mapping[str, str] | None = None) -> None:
        message = bounded(message, MAX_MESSAGE_BYTES)
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason
        if code is not None:
            self.code = code
        self.metadata: dict[str, str] = {
            bounded(str(k), MAX_METADATA_BYTES): bounded(str(v), MAX_METADATA_BYTES)
            for k, v in list((metadata or {}).items())[:MAX_METADATA_ENTRIES]}

    def __str__(self) -> str:
        return f"[{self.reason}] {self.message}"


# Errors travel in a status's trailing metadata, message and ErrorInfo both: a message
# that echoes a 10k-character field made grpc answer RESOURCE_EXHAUSTED ("metadata size
# exceeds hard limit") instead of the real error. Every error is bounded when made.
MAX_MESSAGE_BYTES = 1024
# Metadata of a Receive's error when every byte had arrived and a later step failed (the
# digest, the attestation probe, the version commit): the trainer's send is not the
# cause, so the coordinator does not stop the lane, which other engines may still read.
AFTER_TRANSFER = "after_transfer"
MAX_METADATA_BYTES = 256
MAX_METADATA_ENTRIES = 16


def bounded(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` bytes of UTF-8 (at a character boundary), with a
    marker giving the original length."""
    data = text.encode("utf-8", errors="replace")
    if len(data) <= limit:
        return text
    marker = f"...[cut, {len(data)} bytes in all]"
    return data[:limit - len(marker)].decode("utf-8", errors="ignore") + marker


@contextlib.contextmanager
def nothing_changed() -> Iterator[None]:
    """Marks every ``WeightSyncError`` raised inside as "nothing ran" (see ``nothing_ran``).

    Wrap only checks that precede the first change: "no engine is available right
    now" must not become the key's final answer.
    """
    try:
        yield
    except WeightSyncError as exc:
        exc.nothing_ran = True
        raise


class InvalidArgument(WeightSyncError):
    """A request is malformed or names something that does not exist."""

    reason = "INVALID_ARGUMENT"
    code = grpc.StatusCode.INVALID_ARGUMENT


class IdempotencyConflict(WeightSyncError):
    """The idempotency key was already used for a different request."""

    reason = "IDEMPOTENCY_KEY_REUSED"
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(WeightSyncError):
    """The system is not in a state where the operation can run."""

    reason = "FAILED_PRECONDITION"
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unsupported(FailedPrecondition):
    """This engine cannot do what was asked (a pause mode, generation through the agent,
    an attestation probe). The reason names what; nothing ran."""

    reason = "UNSUPPORTED"
    nothing_ran = True


class DigestWithheld(FailedPrecondition):
    """The engine gives no digest of its weights, and will not until something changes:
    it cannot compute one (SGLang), or holds weights weightsync did not send it (its
    boot weights) and so cannot vouch for them. Not a momentary failure to read: asking
    again gives the same answer. The message says why."""

    reason = "NO_DIGEST"


class PermissionDenied(WeightSyncError):
    """The caller's role may not make this call (see ``weightsync.roles``)."""

    reason = "PERMISSION_DENIED"
    code = grpc.StatusCode.PERMISSION_DENIED


class PlanUnknown(FailedPrecondition):
    """A request named its plan by ``plan_id`` alone, and this server does not hold that
    plan (it restarted, or forgot it): send the whole plan again. Nothing ran."""

    reason = "PLAN_UNKNOWN"
    nothing_ran = True


class EngineUnavailable(WeightSyncError):
    """An engine (or its agent) cannot be reached or stopped heartbeating."""

    reason = "ENGINE_UNAVAILABLE"
    code = grpc.StatusCode.UNAVAILABLE


class CoordinatorUnavailable(WeightSyncError):
    """The coordinator cannot be reached at the address the client was given (nothing
    answers there, or the connection failed): not an engine's fault."""

    reason = "COORDINATOR_UNAVAILABLE"
    code = grpc.StatusCode.UNAVAILABLE


def unreachable(error: grpc.RpcError) -> bool:
    """Whether a failed call never reached a weightsync server: UNAVAILABLE from the
    channel itself (refused, reset, no route), with no error details of ours."""
    if not hasattr(error, "code") or error.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    return not hasattr(error, "trailing_metadata") or rpc_status.from_call(error) is None


class EngineFault(WeightSyncError):
    """The engine hit a hard fault (for example a step with its KV cache asleep)."""

    reason = "ENGINE_FAULT"
    code = grpc.StatusCode.INTERNAL


class TornWeightsError(WeightSyncError):
    """A transfer failed part-way; the engine holds partially updated weights."""

    reason = "TORN_WEIGHTS"
    code = grpc.StatusCode.FAILED_PRECONDITION


class EngineOutputMismatch(TornWeightsError):
    """An engine loaded the bytes but does not compute what the trainer's model computes:
    its log-probs on the attestation probe differ beyond the tolerance. The engine is
    torn and stays paused; ``metadata["max_diff"]`` has the largest difference."""

    reason = "ENGINE_OUTPUT_MISMATCH"
    code = grpc.StatusCode.DATA_LOSS


class TransferError(WeightSyncError):
    """The data-plane transfer failed (peer died, bytes did not arrive, ...)."""

    reason = "TRANSFER_FAILED"
    code = grpc.StatusCode.ABORTED


class OperationAborted(WeightSyncError):
    """The operation was running when its server died; it was not re-run."""

    reason = "OPERATION_ABORTED"
    code = grpc.StatusCode.ABORTED


class StateNotWritable(WeightSyncError):
    """A server cannot write its state database (the disk is full, an I/O error, a
    read-only file): the call that needed the write changed nothing; it can be made
    again once the database can be written."""

    reason = "STATE_NOT_WRITABLE"
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class StepTimeoutError(WeightSyncError, TimeoutError):
    """A deadline expired; ``operation`` names what was running."""

    reason = "DEADLINE_EXCEEDED"
    code = grpc.StatusCode.DEADLINE_EXCEEDED

    def __init__(self, message: str, *, operation: str, **kwargs) -> None:
        metadata = dict(kwargs.pop("metadata", None) or {})
        metadata.setdefault("operation", operation)
        super().__init__(message, metadata=metadata, **kwargs)
        self.operation = operation


_BY_REASON: dict[str, type[WeightSyncError]] = {
    cls.reason: cls
    for cls in (InvalidArgument, IdempotencyConflict, FailedPrecondition, PermissionDenied, PlanUnknown,
                EngineUnavailable, CoordinatorUnavailable,
                EngineFault, TornWeightsError, EngineOutputMismatch, TransferError, OperationAborted,
                StateNotWritable)
}


# Reasons an ``Unsupported`` carries: each names what the engine cannot do, and all come
# back to a client as ``Unsupported`` with the reason kept.
UNSUPPORTED_REASONS = frozenset({"UNSUPPORTED", "PAUSE_MODE_UNSUPPORTED", "GENERATION_UNSUPPORTED",
                                 "ATTESTATION_UNSUPPORTED", "TRANSPORT_UNSUPPORTED", "DIGEST_UNSUPPORTED",
                                 "ENGINE_CANNOT_RECEIVE", "GROUP_LAYOUT_UNSUPPORTED"})

_BY_CODE: dict[grpc.StatusCode, type[WeightSyncError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: EngineUnavailable,
    grpc.StatusCode.ALREADY_EXISTS: IdempotencyConflict,
    grpc.StatusCode.ABORTED: OperationAborted,
}


def to_status(error: WeightSyncError) -> status_pb2.Status:
    """Encodes an error as a google.rpc.Status with an ErrorInfo detail."""
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN, metadata=error.metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    return status_pb2.Status(code=error.code.value[0], message=error.message, details=[detail])


async def abort_with(context: grpc.aio.ServicerContext, error: WeightSyncError) -> None:
    """Aborts the current RPC with ``error`` (never returns)."""
    await context.abort_with_status(rpc_status.to_status(to_status(error)))


def from_status(code: int, message: str, details: list[any_pb2.Any] | None = None) -> WeightSyncError:
    """Builds the typed exception described by a status code, message and details."""
    reason, metadata = None, {}
    for detail in details or []:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, metadata = info.reason, dict(info.metadata)
    status_code = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    if reason == StepTimeoutError.reason or (reason is None and status_code == grpc.StatusCode.DEADLINE_EXCEEDED):
        return StepTimeoutError(message, operation=metadata.get("operation", "unknown"), metadata=metadata)
    if reason in UNSUPPORTED_REASONS:
        return Unsupported(message, reason=reason, code=status_code, metadata=metadata)
    if reason in _BY_REASON:
        return _BY_REASON[reason](message, metadata=metadata, code=status_code)
    # An unknown (or absent) reason still gets the class its status code implies.
    cls = _BY_CODE.get(status_code, WeightSyncError)
    return cls(message, reason=reason or status_code.name, code=status_code, metadata=metadata)


def from_rpc_error(error: grpc.RpcError, *, operation: str | None = None) -> WeightSyncError:
    """Turns a failed gRPC call into the matching typed ``WeightSyncError``."""
    status = rpc_status.from_call(error) if hasattr(error, "trailing_metadata") else None
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = error.details() if hasattr(error, "details") else str(error)
    details = list(status.details) if status is not None else []
    result = from_status(code.value[0], message or code.name, details)
    if operation and isinstance(result, StepTimeoutError) and result.operation == "unknown":
        result = StepTimeoutError(result.message, operation=operation, metadata=result.metadata)
    return result


def coordinator_error(error: grpc.RpcError, *, coordinator: str | None, operation: str) -> WeightSyncError:
    """The typed error of a failed call to the coordinator at ``coordinator``: a call
    that never reached it is ``CoordinatorUnavailable`` naming the address (not an
    engine's fault); anything else is the error the server sent."""
    if coordinator is not None and unreachable(error):
        return CoordinatorUnavailable(
            f"cannot reach the coordinator at {coordinator} ({error.details() or error.code().name}) during "
            f"{operation}: check the address, and that `weightsync coordinator` is running and listening there",
            metadata={"coordinator": coordinator, "operation": operation})
    return from_rpc_error(error, operation=operation)


def outcome_error(reason: str, message: str, *, operation: str = "unknown", code: int = 0) -> WeightSyncError:
    """Rebuilds the typed error recorded in an ``EngineOutcome`` (reason, then status code)."""
    if reason == StepTimeoutError.reason:
        return StepTimeoutError(message, operation=operation)
    if reason in UNSUPPORTED_REASONS:
        return Unsupported(message, reason=reason)
    if reason in _BY_REASON:
        return _BY_REASON[reason](message)
    status = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    cls = _BY_CODE.get(status, WeightSyncError)
    return cls(message, reason=reason or "UNKNOWN", code=status)


__all__ = [
    "AFTER_TRANSFER", "DOMAIN", "WeightSyncError", "InvalidArgument", "IdempotencyConflict", "FailedPrecondition",
    "DigestWithheld", "PermissionDenied", "PlanUnknown", "Unsupported", "EngineUnavailable", "CoordinatorUnavailable", "unreachable", "EngineFault", "TornWeightsError", "EngineOutputMismatch", "TransferError", "OperationAborted",
    "StateNotWritable", "StepTimeoutError", "bounded", "to_status", "abort_with", "from_status", "from_rpc_error", "outcome_error", "coordinator_error",
]
