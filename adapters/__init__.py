"""Broker adapters: thin translations of the Adapter contract to each broker's calls.

Import the one you use: ``reliable_sub.adapters.memory``, ``.redis_streams`` or ``.pubsub``.
"""

from .base import Adapter, Capabilities

__all__ = ["Adapter", "Capabilities"]
