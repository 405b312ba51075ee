"""The lab: the demo, the local stack, benchmarks, chaos and cluster runs, the settings-doc generator and Agent
Lightning 1.0's own processes beside a stack. Not part of the product: it needs the ``lab`` extra
(``pip install 'agl-celery-bridge[lab]'``), and ``bridge`` and ``workers`` never import it (``python -m bridge
demo`` and the other lab commands reach it by name)."""
