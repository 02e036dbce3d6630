"""weightsync: moves fresh policy weights from RL trainers into running inference engines."""

import os as _os

# weightsync forks only to exec (engines, agents, benchmarks' workers). gRPC's fork
# support would restart its poller in the forked child between fork and exec, where
# Popen has already closed gRPC's epoll fd; the child can then abort before exec.
# Must be set before grpc is first imported.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__version__ = "0.1.0"
