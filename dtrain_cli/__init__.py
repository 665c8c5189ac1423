"""The ``dtrain`` command line, the layer above ``dtrain``, ``coordinator`` and ``workers``."""
