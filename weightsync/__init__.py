"""weightsync: moves fresh policy weights from RL trainers into running inference engines."""
__version__ = "0.1.0"
