"""The worker process's lifecycle: set-up, slot adverts, drain, stuck threads, metrics, health, clients."""
