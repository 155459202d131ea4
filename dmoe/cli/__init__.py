"""The programs: ``dmoe-server``, ``dmoe-train``, ``dmoe-dht``, ``dmoe-monitor`` and the demo (``dmoe-demo``).

What only programs need lives here too: argument and TOML configuration (``config``), signal handling and
orphan detection (``signals``), and the allocator setting of long-running processes (``allocator``). The library
never calls these on its own.
"""
