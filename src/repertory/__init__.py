"""repertory: train one language model to play every role of multi-agent conversations."""

__version__ = "0.1.0"
