"""Operator commands of the product: ``python -m bridge status`` and ``autoscale``, and Flower's login check
(``python -m bridge.ops.flower``). They need only the product's dependencies, never the ``lab`` extra."""
