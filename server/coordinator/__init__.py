"""The coordinator process: the control plane (``weightsync coordinator``).

``service`` (the gRPC handlers), ``round`` (a round's steps and state), ``sync_ledger`` (each
logical sync's attempts), ``registry`` (engines and availability), ``agent_calls`` and
``broadcast_progress`` (calls to agents, a Broadcast's events), ``catch_up`` (fenced engines
from a ready peer), ``main`` (start and shutdown). Never imports the agent's side.
"""
