"""What runs an episode: the built-in WebShop loop, or any Agent Lightning ``LitAgent`` (``AGENT=module.path:attr``).

* ``webshop_loop``, ``prompts``, ``llm``, ``ratelimit``, ``webshop``, ``inputs``: the built-in WebShop agent, its
  LLM calls under the cluster-wide rate limit, its environment client and its input's validation;

* ``loading``: what the operator configured (``AGENT``, ``AGENT_HOOKS``), imported once per process; the
  ``agentlightning`` package is imported only here and only when ``AGENT`` is not ``webshop``;
* ``capture``: the agent's ``openai`` SDK calls, and Agent Lightning's emitters, as spans of the attempt;
* ``litagent``: one attempt of a LitAgent (resources, hooks, the call, its return value), in place of the
  WebShop episode: leases, fencing, heartbeats and the report are the execution module's, unchanged;
* ``spans``: spans an agent returns, re-filed under the attempt.

A broker message never makes a worker import anything: it only names the agent its sender expects, and
``ConfiguredAgent.accepts`` compares that name with what this worker was configured to run.
"""
