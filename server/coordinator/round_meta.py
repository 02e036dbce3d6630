"""The round's state as the coordinator persists it: fields of the SQLite ``meta``
table, read at start-up and written after every step."""

from __future__ import annotations

from weightsync.statedb import get_meta, set_meta

PERSISTED = (("weight_version", "0"), ("epoch", "0"), ("round_id", "0"), ("phase", "idle"),
             ("round_engines", "[]"), ("target_version", "0"), ("group_key", ""))


def load_round_meta(conn) -> dict[str, str]:
    """The round's persisted fields (defaults where never saved). A round that was
    broadcasting when the coordinator died comes back ``failed`` with a new epoch."""
    meta = {key: get_meta(conn, key, default) for key, default in PERSISTED}
    if meta["phase"] == "broadcasting":
        # A Broadcast was running when we died: its transfer did not complete
        # here, so the next one must build a fresh group.
        meta["phase"] = "failed"
        meta["epoch"] = str(int(meta["epoch"]) + 1)
        set_meta(conn, "phase", meta["phase"])
        set_meta(conn, "epoch", meta["epoch"])
    return meta


def save_round_meta(conn, values: dict) -> None:
    for key, value in values.items():
        set_meta(conn, key, value)
