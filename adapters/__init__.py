"""Broker adapters: thin translations of the Adapter contract to each broker's calls.

Import the one you use: ``reliable_sub.adapters.memory``, ``.redis_streams`` or ``.pubsub``. Each
is written against public ``reliable_sub`` names only, as a third party's adapter would be.
"""

from reliable_sub.ports import Adapter, Capabilities

__all__ = ["Adapter", "Capabilities"]
