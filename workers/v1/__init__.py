"""Agent Lightning 1.0 attempts: the agent program in a subprocess, its environment, its Celery task."""
