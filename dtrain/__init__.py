"""dtrain: fault-tolerant, multi-datacenter, asynchronous (DiLoCo-style) training on JAX."""

__version__ = "0.1.0"
