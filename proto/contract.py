"""The wire contract of weightsync.v1, recorded, and the changes that would break it.

``contract.json`` beside this script records every message's fields (number, name,
type, label), every enum's values and every RPC's request, response and streaming, as
they are in the generated descriptors. A later change to ``proto/`` must keep all of
it: a field may be added, never renumbered, retyped, renamed or dropped without being
``reserved``; an RPC may be added, never removed or given other types. These are the
wire and JSON rules of ``buf breaking``, checked without the buf CLI so that the suite
(tests/test_protos.py) can check them anywhere. After a deliberate, compatible change,
record the new contract with ``make protos``.

It also checks the naming rules of buf's STANDARD lint that keep every reply free to
evolve alone: a service is named ``...Service``; each RPC takes ``<Rpc>Request`` and
returns ``<Rpc>Response``; no message is the request or response of two RPCs.

Usage: python proto/contract.py [check|record]   (default: check)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from google.protobuf.descriptor import Descriptor, FieldDescriptor, FileDescriptor

ROOT = Path(__file__).resolve().parent.parent
RECORD = Path(__file__).resolve().parent / "contract.json"


def _files() -> list[FileDescriptor]:
    sys.path.insert(0, str(ROOT))
    from weightsync.v1 import agent_pb2, common_pb2, coordinator_pb2

    return [common_pb2.DESCRIPTOR, agent_pb2.DESCRIPTOR, coordinator_pb2.DESCRIPTOR]


def _message(desc: Descriptor, out: dict) -> None:
    out["messages"][desc.full_name] = {
        "fields": {str(f.number): _field(f) for f in desc.fields},
        "reserved": _reserved_numbers(desc),
        "oneofs": {o.name: sorted(str(f.number) for f in o.fields) for o in desc.oneofs},
    }
    for nested in desc.nested_types:
        _message(nested, out)
    for enum in desc.enum_types:
        out["enums"][enum.full_name] = {str(v.number): v.name for v in enum.values}


def _field(f: FieldDescriptor) -> list[str]:
    """A field as recorded: name, wire type, cardinality, and the message or enum it holds."""
    from google.protobuf import descriptor_pb2

    kind = descriptor_pb2.FieldDescriptorProto.Type.Name(f.type)
    held = f.message_type.full_name if f.message_type else f.enum_type.full_name if f.enum_type else ""
    return [f.name, kind, "repeated" if f.is_repeated else "singular", held]


def _reserved_numbers(desc: Descriptor) -> list[int]:
    """The field numbers ``desc`` reserves (read from its DescriptorProto)."""
    from google.protobuf import descriptor_pb2

    proto = descriptor_pb2.DescriptorProto()
    desc.CopyToProto(proto)
    return sorted({n for r in proto.reserved_range for n in range(r.start, r.end)})


def describe() -> dict:
    """The contract of the generated code, as ``contract.json`` records it."""
    out: dict = {"messages": {}, "enums": {}, "services": {}}
    for file in _files():
        for desc in file.message_types_by_name.values():
            _message(desc, out)
        for enum in file.enum_types_by_name.values():
            out["enums"][enum.full_name] = {str(v.number): v.name for v in enum.values}
        for service in file.services_by_name.values():
            out["services"][service.full_name] = {
                m.name: [m.input_type.full_name, m.output_type.full_name, m.client_streaming, m.server_streaming]
                for m in service.methods}
    return out


def breaking_changes(old: dict, new: dict) -> list[str]:
    """What ``new`` changed of ``old`` that a peer built against ``old`` would trip on."""
    problems = []
    for name, fields in ((n, m["fields"]) for n, m in old["messages"].items()):
        now = new["messages"].get(name)
        if now is None:
            problems.append(f"message {name} was removed")
            continue
        for number, (field, kind, label, type_name) in fields.items():
            got = now["fields"].get(number)
            if got is None:
                if int(number) not in now["reserved"]:
                    problems.append(f"{name}: field {number} ({field}) was removed without reserving {number}")
            elif got != [field, kind, label, type_name]:
                problems.append(f"{name}: field {number} was {[field, kind, label, type_name]}, now {got}")
        for oneof, members in old["messages"][name]["oneofs"].items():
            moved = [n for n in members if n in now["fields"] and n not in now["oneofs"].get(oneof, [])]
            if moved:
                problems.append(f"{name}: fields {moved} left oneof {oneof}")
    for name, values in old["enums"].items():
        now = new["enums"].get(name)
        if now is None:
            problems.append(f"enum {name} was removed")
            continue
        problems += [f"{name}: value {n} was {v}, now {now.get(n)}" for n, v in values.items() if now.get(n) != v]
    for name, methods in old["services"].items():
        now = new["services"].get(name)
        if now is None:
            problems.append(f"service {name} was removed")
            continue
        for method, shape in methods.items():
            if now.get(method) != shape:
                problems.append(f"{name}.{method} was {shape}, now {now.get(method)}")
    return problems


def naming_problems(contract: dict) -> list[str]:
    """Breaches of buf STANDARD's service and RPC naming rules (see the module docstring)."""
    problems, used = [], {}
    for service, methods in contract["services"].items():
        short = service.rsplit(".", 1)[-1]
        if not short.endswith("Service"):
            problems.append(f"service {service} is not named ...Service")
        for method, (request, response, _, _) in methods.items():
            package = service.rsplit(".", 1)[0]
            if request != f"{package}.{method}Request":
                problems.append(f"{short}.{method} takes {request}, not {method}Request")
            if response != f"{package}.{method}Response":
                problems.append(f"{short}.{method} returns {response}, not {method}Response")
            for message in (request, response):
                if message in used:
                    problems.append(f"{message} serves both {used[message]} and {short}.{method}")
                used[message] = f"{short}.{method}"
    return problems


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "check"
    current = describe()
    if command == "record":
        problems = naming_problems(current)
        if RECORD.exists():
            problems += breaking_changes(json.loads(RECORD.read_text()), current)
        if problems:
            print("not recorded: the contract would break\n  " + "\n  ".join(problems), file=sys.stderr)
            return 1
        RECORD.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
        print(f"recorded {RECORD.relative_to(ROOT)}")
        return 0
    if command != "check":
        print(__doc__, file=sys.stderr)
        return 2
    recorded = json.loads(RECORD.read_text())
    problems = naming_problems(current) + breaking_changes(recorded, current)
    if not problems and recorded != current:
        problems.append(f"the contract grew without being recorded: run 'make protos' and commit "
                        f"{RECORD.relative_to(ROOT)}")
    print("\n".join(problems) or "the contract holds")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
