"""Train ``CalcAgent`` with Agent Lightning while the Celery workers execute every rollout.

From the repository root, with ``pip install -e '.[agl,store]'`` done and a Redis the workers and this script
reach, start a Store, workers running the same agent, then this script::

    export AGENT_LIGHTNING_STORE_URL=http://127.0.0.1:4747 CELERY_BROKER_URL=redis://127.0.0.1:6379/0
    agl store --port 4747 &
    AGENT=examples.calc_agent:CalcAgent celery -A workers worker -c 4 &
    OPENAI_API_BASE=http://my-llm:8000/v1 WEBSHOP_MODEL=my-model python -m examples.train_calc

The workers and the trainer must name the same Store (``AGENT_LIGHTNING_STORE_URL``: the workers report to it,
and their slots in Redis are counted per Store) and the same broker (``CELERY_BROKER_URL``). On several
machines, use a host name every machine resolves (``agl store`` listens on all interfaces), and a Redis the
trainer reaches too: ``CeleryRunner`` reads the workers' free slots there. docs/path-litagent.md has the
steps. Against your own trainer the changes are the ``runner=``, ``store=`` and ``strategy=`` lines below.
"""

from __future__ import annotations

import os

import agentlightning as agl

from bridge.runner import CeleryRunner
from examples.calc_agent import CalcAgent

TASKS = [{"question": f"What is {a} + {b}?", "answer": a + b} for a, b in [(2, 3), (12, 30), (7, 8), (40, 2)]]


def main() -> None:
    store_url = os.environ["AGENT_LIGHTNING_STORE_URL"]
    llm = agl.LLM(endpoint=os.environ["OPENAI_API_BASE"], model=os.environ.get("WEBSHOP_MODEL", "gpt-4o-mini"))
    trainer = agl.Trainer(
        runner=CeleryRunner(),  # rollouts run on `celery -A workers worker`, not in this process
        n_runners=1,
        store=agl.LightningStoreClient(store_url),  # the Store the workers report to, started on its own
        strategy=agl.ClientServerExecutionStrategy(n_runners=1, managed_store=False),  # and not by the Trainer
        algorithm=agl.Baseline(polling_interval=1.0),
        initial_resources={"main_llm": llm},
    )
    trainer.fit(CalcAgent(), train_dataset=TASKS)


if __name__ == "__main__":
    main()
