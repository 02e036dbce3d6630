"""``weightsync bench``: transfer time of weightsync against the alternatives, in one run."""
