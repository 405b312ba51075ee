"""The bridge: moves Agent Lightning rollouts from the Store into Celery (``python -m bridge``)."""
