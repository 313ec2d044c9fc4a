"""The standalone engine: the JSON-RPC socket server, its method table and the synchronous client.

This package's ``__init__`` imports nothing, so the client modules (``_protocol``, ``_location``,
``_client``; standard library only) never pull in Trio. The server modules are imported by
``gadget-engine serve`` alone.
"""
