"""The agent process: the sidecar beside each engine (``weightsync agent``).

``service`` (the gRPC handlers and the engine's control), ``fence``, ``pause_keeper``,
``engine_watch``, ``readiness``, ``weight_export`` (catch-up source), ``launcher`` (an engine it
owns), ``main`` (start and shutdown). Never imports the coordinator's side.
"""
