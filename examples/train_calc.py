"""Train ``CalcAgent`` with Agent Lightning while the Celery workers execute every rollout.

Start an ``agl store``, Redis and workers running the same agent, then this script from the repository root::

    agl store --port 4747 &
    AGENT=examples.calc_agent:CalcAgent celery -A workers worker &
    OPENAI_API_BASE=http://my-llm:8000/v1 WEBSHOP_MODEL=my-model python -m examples.train_calc

``AGENT_LIGHTNING_STORE_URL`` (default ``http://localhost:4747``) and ``CELERY_BROKER_URL`` name the Store and
the broker here as on the workers. Against your own trainer the change is the ``runner=CeleryRunner()`` line.
"""

from __future__ import annotations

import os

import agentlightning as agl

from bridge.runner import CeleryRunner
from examples.calc_agent import CalcAgent

TASKS = [{"question": f"What is {a} + {b}?", "answer": a + b} for a, b in [(2, 3), (12, 30), (7, 8), (40, 2)]]


def main() -> None:
    store_url = os.environ.get("AGENT_LIGHTNING_STORE_URL", "http://localhost:4747")
    llm = agl.LLM(endpoint=os.environ["OPENAI_API_BASE"], model=os.environ.get("WEBSHOP_MODEL", "gpt-4o-mini"))
    trainer = agl.Trainer(
        runner=CeleryRunner(),  # <- the one-line change: rollouts run on `celery -A workers worker`
        n_runners=1,
        store=agl.LightningStoreClient(store_url),  # the Store the workers report to
        strategy=agl.ClientServerExecutionStrategy(n_runners=1, managed_store=False),
        algorithm=agl.Baseline(polling_interval=1.0),
        initial_resources={"main_llm": llm},
    )
    trainer.fit(CalcAgent(), train_dataset=TASKS)


if __name__ == "__main__":
    main()
