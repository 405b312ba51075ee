"""Stand-ins for the product's collaborators that more than one test module uses.

``v03``: the Store calls and the publisher of the 0.3 line, as plain objects. ``v1``: the 1.0 gateway's HTTP API
in-process and the Celery app the 1.0 dispatcher publishes through. ``lines``: either line's real dispatcher on
those fakes, with the means to feed it and read what it published. ``runner_agents``: the LitAgents the
CeleryRunner tests run on real workers.

A fake one test module alone uses stays in that module; one a second module needs moves here
(``tests/unit/test_architecture.py`` checks that no test module imports another's fakes).
"""
