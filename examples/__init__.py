"""Examples, runnable from the repository root as modules (``python -m examples.train_calc``)."""
