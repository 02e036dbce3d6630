"""The applications built on weightsync: the command line, the demo, the bench and the
local cluster they start. The core (``weightsync.*`` outside this package, ``server/``,
``client/``) never imports from here; ``tests/test_lint.py`` checks that.
"""
